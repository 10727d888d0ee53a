"""What the chat processor refuses before a request costs tokenization or any worker time.

The limits come from the model card the workers registered (no number is configured twice):
`runtime_config.context_length` is the engine's `max_seq_len` (worker.py registers it) and
`runtime_config.runtime_data.beam_max_isl` the graph's `disaggregation.max_isl`. The token
rule itself is the workers' (`dynamo_graphs.admission.check_admission`), run here after
tokenizing and before routing, so that in a disaggregated graph an over-long chat request is
refused before prefill is scheduled (the decode-side check stays for /v1/completions, which
Dynamo's Rust path tokenizes and routes itself).

Before tokenizing, two checks that cost one pass over the request's strings:
- U+FFFD anywhere: Dynamo 1.6.1's HTTP layer accepts a body with invalid UTF-8 by replacing
  each bad byte with U+FFFD (it logs "Accepted request after replacing invalid UTF-8"), so
  the processor cannot tell a typed U+FFFD from a broken body and refuses both.
- Characters: one token covers at most `max_token_chars` characters (the longest token of
  the vocabulary), so text longer than `longest_prompt * max_token_chars` cannot fit the
  context whatever it tokenizes to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from dynamo_graphs.admission import AdmissionError, Limits, check_admission

from .errors import ChatRequestError

MAX_ISL_KEY = "beam_max_isl"  # runtime_data key the workers publish (worker.py)
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class ChatLimits:
    limits: Limits
    max_token_chars: int  # the longest token of the vocabulary, in characters

    @property
    def max_chars(self) -> int:
        return self.limits.longest_prompt * self.max_token_chars

    def check_text(self, request: dict) -> None:
        """Refuse invalid UTF-8 (as U+FFFD) and text that cannot fit, before tokenizing."""
        total = 0
        for where, text in _strings(request.get("messages"), "messages"):
            if REPLACEMENT in text:
                raise ChatRequestError(
                    f"{where} contains U+FFFD: the request body was not valid UTF-8 (invalid "
                    "bytes arrive replaced by U+FFFD, which is refused)", param="messages")
            total += len(text)
        for where, text in _strings(request.get("tools"), "tools"):
            total += len(text)
        if total > self.max_chars:
            raise ChatRequestError(
                f"messages and tools hold {total} characters; a prompt of at most "
                f"{self.limits.longest_prompt} tokens (context length "
                f"{self.limits.max_seq_len}) has at most {self.max_chars}", param="messages")

    def check_prompt(self, request_id: str, prompt_len: int, max_tokens: int | None) -> None:
        try:
            check_admission(request_id, prompt_len, max_tokens or 0, "agg", self.limits)
        except AdmissionError as exc:
            raise ChatRequestError(str(exc), param="max_tokens" if prompt_len
                                   <= self.limits.longest_prompt else "messages") from None


def limits_from_card(runtime_config: Any, vocab: list[str], where: str) -> ChatLimits:
    """The limits of a registered model from its card's runtime config (a dict)."""
    rc = runtime_config if isinstance(runtime_config, dict) else {}
    ctx = rc.get("context_length")
    if type(ctx) is not int or ctx < 2:
        raise RuntimeError(f"model card of {where} has no context_length in its runtime "
                           f"config ({ctx!r}): the chat processor cannot check prompt lengths")
    isl = (rc.get("runtime_data") or {}).get(MAX_ISL_KEY)
    isl = isl if type(isl) is int and isl > 0 else None
    return ChatLimits(Limits(ctx, isl), max(1, max(map(len, vocab), default=1)))


def _strings(value: Any, where: str) -> Iterator[tuple[str, str]]:
    """Every string in a JSON value, with its path (messages[1].content)."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{where}[{i}]")
