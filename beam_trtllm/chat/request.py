"""An OpenAI chat request -> what the Beam workers run: the prompt's token ids (special tokens
only where the template put them), the output grammar, and Dynamo's preprocessed request.

Every parameter is either honoured or refused with a ChatRequestError (HTTP 400) naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ChatRequestError
from .grammar import turn_structural_tag
from .tools import tool_schemas

MAX_N = 16
MAX_TOP_LOGPROBS = 20
# Honoured here or by the workers (requests.py); anything else is refused by name.
SUPPORTED = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "n", "stream", "stream_options",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "logprobs",
    "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "chat_template_kwargs", "chat_template_args", "ignore_eos", "nvext", "thinking_token_budget", "include_reasoning",
    "user", "metadata", "store",
}
# Metadata the API defines with no effect on the output.
NO_EFFECT = {"user", "metadata", "store"}


@dataclass
class ChatPlan:
    prompt_ids: list[int]
    tools: dict[str, dict]
    structural_tag: str | None
    n: int
    logprobs: int | None
    include_reasoning: bool
    preproc: dict[str, Any]


def _number(request: dict, name: str, lo: float, hi: float, default=None):
    v = request.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ChatRequestError(f"{name} must be a number in [{lo}, {hi}], got {v!r}", param=name)
    return v


def _logit_bias(request: dict, vocab_size: int) -> dict[str, float]:
    bias = request.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ChatRequestError("logit_bias must map token ids to numbers", param="logit_bias")
    out = {}
    for k, v in bias.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise ChatRequestError(f"logit_bias key {k!r} is not a token id",
                                   param="logit_bias") from None
        if not 0 <= tid < vocab_size or isinstance(v, bool) or not isinstance(v, (int, float)) \
                or not -100 <= v <= 100:
            raise ChatRequestError(f"logit_bias[{k!r}] needs a token id in [0, {vocab_size}) "
                                   f"and a bias in [-100, 100], got {v!r}", param="logit_bias")
        out[str(tid)] = float(v)
    return out


def _logprobs(request: dict) -> int | None:
    want = request.get("logprobs")
    top = request.get("top_logprobs")
    if top is not None and not want:
        raise ChatRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    if not want:
        return None
    if top is None:
        return 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ChatRequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                               param="top_logprobs")
    return top


def _check_parameters(request: dict) -> None:
    for name in request:
        if name not in SUPPORTED:
            raise ChatRequestError(f"unsupported parameter {name!r}: Beam's chat endpoint does "
                                   "not implement it", param=name)
    for name, value in (request.get("nvext") or {}).items():
        if name not in ("extra_fields", "max_thinking_tokens"):
            raise ChatRequestError(f"unsupported parameter 'nvext.{name}'", param=f"nvext.{name}")


def plan_chat(request: dict, tokenizer, vocab_size: int, eos_token_ids: list[int],
              compile_check=None) -> ChatPlan:
    """Validate `request` and build its plan; `compile_check(tag)` raises if the grammar
    cannot be compiled (the frontend compiles it once, so a bad schema is a 400 here)."""
    _check_parameters(request)
    tools = tool_schemas(request.get("tools"))
    # Dynamo's HTTP layer hands chat_template_kwargs over as chat_template_args, with its
    # aliases of enable_thinking (thinking, thinking_mode) added
    kwargs = request.get("chat_template_kwargs") or request.get("chat_template_args") or {}
    if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking", "thinking",
                                                      "thinking_mode"}:
        raise ChatRequestError("chat_template_kwargs supports only enable_thinking",
                               param="chat_template_kwargs")
    thinking = kwargs.get("enable_thinking", kwargs.get("thinking"))
    budget = request.get("thinking_token_budget", (request.get("nvext") or {}).get(
        "max_thinking_tokens"))
    if budget is not None and (not isinstance(budget, int) or budget < 1):
        raise ChatRequestError("thinking_token_budget must be an integer >= 1",
                               param="thinking_token_budget")
    choice = request.get("tool_choice")
    # with tool_choice none the tools are not declared at all (Dynamo's default, too)
    shown_tools = None if choice == "none" else request.get("tools")
    tag = turn_structural_tag(tools, choice, request.get("response_format"), thinking,
                              parallel=request.get("parallel_tool_calls", True) is not False,
                              thinking_budget=budget)
    if tag is not None and compile_check is not None:
        compile_check(tag)
    if "messages" not in request:
        raise ChatRequestError("messages is required", param="messages")
    prompt = tokenizer.chat_ids(request["messages"], tools=shown_tools)
    n = request.get("n", 1) or 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ChatRequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}", param="n")
    logprobs = _logprobs(request)
    preproc = _preproc(request, prompt, eos_token_ids, vocab_size, tag, logprobs)
    return ChatPlan(prompt, tools, tag, n, logprobs,
                    request.get("include_reasoning", True) is not False, preproc)


def _preproc(request, prompt, eos_token_ids, vocab_size, tag, logprobs) -> dict:
    stop = request.get("stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stop):
        raise ChatRequestError("stop must be a string or a list of non-empty strings",
                               param="stop")
    top_k = request.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise ChatRequestError("top_k must be an integer >= -1", param="top_k")
    max_tokens = request.get("max_completion_tokens") or request.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ChatRequestError("max_tokens must be an integer >= 1", param="max_tokens")
    beam = {"logit_bias": _logit_bias(request, vocab_size)}
    if tag is not None:
        beam["structural_tag"] = tag
    return {
        "model": request.get("model"),
        "token_ids": prompt,
        "stop_conditions": {"max_tokens": max_tokens, "stop": stop,
                            "stop_token_ids": list(request.get("stop_token_ids") or []),
                            "ignore_eos": bool(request.get("ignore_eos", False))},
        "sampling_options": {
            "n": 1,
            "temperature": _number(request, "temperature", 0, 2),
            "top_p": _number(request, "top_p", 1e-9, 1),
            "top_k": top_k if top_k and top_k > 0 else None,
            "min_p": _number(request, "min_p", 0, 1, 0.0),
            "seed": request.get("seed"),
            "frequency_penalty": _number(request, "frequency_penalty", -2, 2, 0.0),
            "presence_penalty": _number(request, "presence_penalty", -2, 2, 0.0),
            "repetition_penalty": _number(request, "repetition_penalty", 1e-6, 10, 1.0),
        },
        "output_options": {"logprobs": logprobs, "skip_special_tokens": False},
        "eos_token_ids": list(eos_token_ids),
        "annotations": [],
        "extra_args": {"beam": beam},
    }
