"""Dynamo's preprocessed request <-> the engine's SamplingParams and output chunks."""

from __future__ import annotations

from typing import Any

# Engine finish reasons -> what Dynamo's Rust layer understands.
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled"}


def sampling_params(request: dict, max_seq_len: int, role: str):
    """SamplingParams from `sampling_options` / `stop_conditions` / `eos_token_ids`.

    max_tokens defaults to what is left of the context. EOS ids come from the request (the
    frontend reads them from generation_config.json) unless `ignore_eos`; the engine also
    knows its own. Prefill workers compute one token (the handoff contract).
    """
    from dynamo.common.backend.logprobs import parse_logprob_options

    from beam_trtllm.engine.types import SamplingParams

    so = request.get("sampling_options") or {}
    sc = request.get("stop_conditions") or {}
    prompt_len = len(request["token_ids"])
    max_tokens = sc.get("max_tokens") or max(1, max_seq_len - prompt_len)
    if role == "prefill":
        max_tokens = 1
    ignore_eos = bool(sc.get("ignore_eos") or False)
    stop_ids = list(sc.get("stop_token_ids_hidden") or [])
    if not ignore_eos:
        stop_ids += list(request.get("eos_token_ids") or [])
    top_k = so.get("top_k")
    logprobs, _ = parse_logprob_options(request.get("output_options") or {})
    _refuse_unsupported(so, sc, request.get("output_options") or {})
    beam = (request.get("extra_args") or {}).get("beam") or {}
    return SamplingParams(
        max_tokens=int(max_tokens),
        temperature=float(so.get("temperature") if so.get("temperature") is not None else 0.0),
        top_k=int(top_k) if top_k is not None and top_k > 0 else 0,
        top_p=float(so.get("top_p") if so.get("top_p") is not None else 1.0),
        seed=so.get("seed"),
        stop_token_ids=tuple(stop_ids),
        stop=tuple(sc.get("stop") or ()),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        min_p=float(so.get("min_p") or 0.0),
        frequency_penalty=float(so.get("frequency_penalty") or 0.0),
        presence_penalty=float(so.get("presence_penalty") or 0.0),
        repetition_penalty=float(so.get("repetition_penalty") or 1.0),
        logit_bias=tuple((int(t), float(b)) for t, b in (beam.get("logit_bias") or {}).items()),
        structural_tag=beam.get("structural_tag"),
    )


def _refuse_unsupported(so: dict, sc: dict, oo: dict) -> None:
    """What Dynamo's Rust path may forward that the engine cannot honour: an error naming it
    (the frontend answers 400), never accepted and ignored."""
    if oo.get("prompt_logprobs"):  # /v1/completions `echo` arrives as prompt_logprobs=1
        raise ValueError("echo / prompt_logprobs is not supported: the engine computes logits "
                         "only for the rows it samples")
    if (so.get("n") or 1) != 1:
        raise ValueError(f"n={so['n']}: the engine samples one sequence per request")
    if so.get("guided_decoding"):
        raise ValueError("guided decoding (guided_json / guided_regex / guided_choice / "
                         "guided_grammar) is not supported; use response_format on "
                         "/v1/chat/completions")
    if sc.get("min_tokens"):
        raise ValueError("min_tokens is not supported")


def output_chunk(out, num_generated: int) -> dict[str, Any]:
    """One streamed chunk; the terminal one carries finish_reason and usage."""
    chunk: dict[str, Any] = {"token_ids": list(out.new_token_ids), "index": 0}
    if out.logprobs:
        chunk["log_probs"] = [lp.logprob for lp in out.logprobs]
        tops = [[{"rank": r + 1, "token_id": t, "logprob": p} for r, (t, p) in enumerate(lp.top)]
                for lp in out.logprobs]
        if any(tops):
            chunk["top_logprobs"] = tops
    if out.finished:
        chunk["finish_reason"] = FINISH_REASONS.get(out.finish_reason, out.finish_reason)
        chunk["completion_usage"] = {
            "prompt_tokens": out.num_prompt_tokens,
            "completion_tokens": num_generated,
            "total_tokens": out.num_prompt_tokens + num_generated,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
        }
    return chunk
