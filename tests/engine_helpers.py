"""Shared pieces of the engine tests: tiny engine dirs built once per session (BF16, and FP32
for token-exact checks against the canonical model), transformers' BeamForCausalLM in FP32 as
the oracle, memoized oracle generations, and a driver for ragged schedules.

Why FP32: the engine's BF16 rounding points follow transformers', but BF16 sums in another
order flip near-tied random-weight tokens, so token equality with the model is asserted for an
FP32 engine (the same scheduling, paging, rings, restore and ops; differences ~1e-6 of a logit)
and the BF16 engine is held to KL / top-1 bounds (test_model.py) and to its own tokens under
other schedules and cache states (test_cache_invariance.py)."""

from __future__ import annotations

import pytest
import torch

from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.types import SamplingParams

# Small blocks and budgets so a few dozen tokens already span many blocks, several chunks and
# more than the tiny's sliding window of 8.
TINY_OPTS = dict(max_batch=4, max_seq_len=160, max_num_tokens=24, block_size=4)


@pytest.fixture(scope="session")
def tiny_engine_dir(tiny_dir, tmp_path_factory):
    return build_engine(tiny_dir, tmp_path_factory.mktemp("engines") / "tiny-bf16",
                        BuildOptions(**TINY_OPTS))


@pytest.fixture(scope="session")
def tiny_fp32_engine_dir(tiny_dir, tmp_path_factory):
    return build_engine(tiny_dir, tmp_path_factory.mktemp("engines") / "tiny-fp32",
                        BuildOptions(**TINY_OPTS, dtype="float32"))


@pytest.fixture(scope="session")
def ref_fp32(tiny_model):
    """transformers' BeamForCausalLM (eager, FP32) of the tiny checkpoint: the oracle."""
    return tiny_model


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def prompts(seed: int, lengths, vocab: int = 508) -> list[list[int]]:
    """Random prompts over the learned vocabulary (the 4 special tokens are the last ids)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


_REF_CACHE: dict = {}


def ref_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The model's greedy continuation (transformers, with its KV cache), memoized."""
    from beam_trtllm.hf_model import stream

    key = (id(model), tuple(prompt), n)
    if key not in _REF_CACHE:
        _REF_CACHE[key] = [int(t[0]) for t in stream(model, torch.tensor([prompt]), n)]
    return _REF_CACHE[key]


def drive(engine: Engine, arrivals: dict[int, list[tuple]], max_steps: int = 10_000,
          on_step=None) -> dict[str, dict]:
    """Add requests at the given step numbers ({step: [(id, prompt, sampling), ...]}), step
    until everything finished; returns {id: {"tokens", "finish_reason", "text"}}."""
    results: dict[str, dict] = {}
    step = 0
    while step <= max(arrivals, default=0) or engine.has_unfinished():
        for rid, prompt, sampling in arrivals.get(step, []):
            engine.add_request(rid, prompt, sampling)
            results[rid] = {"tokens": [], "finish_reason": None, "text": ""}
        for out in engine.step():
            res = results[out.request_id]
            res["tokens"] += out.new_token_ids
            res["text"] += out.text
            if out.finished:
                res["finish_reason"] = out.finish_reason
        if on_step is not None:
            on_step(step)
        step += 1
        assert step < max_steps, "engine did not finish"
    return results


@pytest.fixture(autouse=False)
def one_thread():
    """The tiny model's ops are far too small to split across threads: with two threads
    (and other tests sharing the two cores) each op pays OpenMP hand-offs, 10-20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def all_logits(engine: Engine, prompt: list[int], n: int, run=None
               ) -> tuple[torch.Tensor, list[int]]:
    """Greedy-generate n tokens and return the logits the engine computed at every position
    (its prefill chunks' rows and each decode step's), [len(prompt) + n - 1, V], with the
    tokens. The engine samples only each chunk's last row; this also reads the other rows
    of the same forward pass. `run(engine, prompt, params)` -> token ids generates instead
    of `engine.generate` (a parallel rank steps in lockstep with the others)."""
    import dataclasses

    rows: list[torch.Tensor] = []
    sampled = engine.model.logits

    def every_row(x, s):
        every = torch.arange(x.shape[0], device=x.device)
        rows.append(sampled(x, dataclasses.replace(s, logits_rows=every)))
        return sampled(x, s)

    engine.model.logits = every_row
    try:
        if run is None:
            tokens = engine.generate([prompt], greedy(n))[0]["token_ids"]
        else:
            tokens = run(engine, prompt, greedy(n))
    finally:
        engine.model.logits = sampled
    return torch.cat(rows), tokens


def kl_top1(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[float, float]:
    """Mean KL(p || q) in nats per position and the top-1 agreement of two logit rows sets."""
    lp, lq = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean()
    return float(kl), float((lp.argmax(-1) == lq.argmax(-1)).float().mean())
