"""Admission: what a worker refuses before the request costs anything (no KV, no step).

The limits are the engine's context (`max_seq_len`: prompt + generated tokens) and, on a
prefill worker, the graph's `max_isl` (longest prompt; validated against the engine at
launch, `launch.check_engine_limits`). Every refusal is an `AdmissionError` whose message names
the request and the limit; the worker turns it into HTTP 400.

Where each check can run, with Dynamo 1.6.1's disaggregated path: the frontend sends the
prefill worker the prompt with `max_tokens` rewritten to 1, so the prefill worker can only
check the prompt length; prompt + `max_tokens` is checked on the decode worker, which then
tells the prefill worker to free the prompt's KV at once (`DecodeSide.decline`), instead of
leaving it pinned until the handoff TTL.
"""

from __future__ import annotations

from dataclasses import dataclass


class AdmissionError(ValueError):
    """A request refused before any work; the message names it and the limit."""


@dataclass(frozen=True)
class Limits:
    max_seq_len: int  # the engine's context: prompt + generated tokens
    max_isl: int | None = None  # longest prompt (disaggregated graphs); None = max_seq_len - 1

    @property
    def longest_prompt(self) -> int:
        ceiling = self.max_seq_len - 1  # one position for the first generated token
        return ceiling if self.max_isl is None else min(self.max_isl, ceiling)


def check_admission(request_id: str, prompt_len: int, max_tokens: int, role: str,
                    limits: Limits) -> None:
    """Refuse a request that can never run: an empty or too-long prompt (every role), or
    prompt + max_tokens beyond the context (agg and decode: they generate)."""
    if prompt_len == 0:
        raise AdmissionError(f"request {request_id}: the prompt is empty")
    if prompt_len > limits.longest_prompt:
        which = ("the graph's max_isl" if limits.max_isl is not None
                 and limits.max_isl < limits.max_seq_len - 1 else "the context length")
        raise AdmissionError(
            f"request {request_id}: the prompt has {prompt_len} tokens; {which} allows "
            f"{limits.longest_prompt} (context length {limits.max_seq_len}, which must leave "
            "room for at least one generated token)")
    if role != "prefill" and prompt_len + max_tokens > limits.max_seq_len:
        raise AdmissionError(
            f"request {request_id}: {prompt_len} prompt tokens + max_tokens {max_tokens} "
            f"exceed the context length {limits.max_seq_len}")
