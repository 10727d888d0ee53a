"""Public types of the engine API (docs/DESIGN.md §4): sampling parameters, step outputs, KV
descriptions for disaggregation, KV events, and the engine's error type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class EngineError(ValueError):
    """A request, engine dir or option the engine refuses; the message names what and why."""


class KVCapacityError(EngineError):
    """Not enough free KV memory *now* (blocks or ring rows); retrying later can succeed."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (the names vLLM and Dynamo use).

    temperature 0 is greedy; top_k 0, top_p 1.0 and min_p 0 disable those filters. `seed` makes
    the request's samples reproducible on its own, whatever else is in the batch. `logprobs` is
    the number of top alternatives reported per token (0: only the chosen token's), None: none.
    Penalties as vLLM and the OpenAI API define them: frequency/presence over the generated
    tokens (subtracted from the logits), repetition over prompt and generated tokens (divides
    a positive logit, multiplies a negative one). `logit_bias`: (token id, bias) pairs added to
    the logits. `structural_tag`: an xgrammar structural tag (JSON) the output must match
    (beam_trtllm/chat/grammar.py).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise EngineError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise EngineError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise EngineError(f"SamplingParams.top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise EngineError(f"SamplingParams.logprobs must be None or >= 0, got {self.logprobs!r}")
        if any(not s for s in self.stop):
            raise EngineError("SamplingParams.stop has an empty string")
        if not 0 <= self.min_p <= 1:
            raise EngineError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise EngineError(f"SamplingParams.{name} must be in [-2, 2], got "
                                  f"{getattr(self, name)!r}")
        if not self.repetition_penalty > 0:
            raise EngineError(f"SamplingParams.repetition_penalty must be > 0, got "
                              f"{self.repetition_penalty!r}")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise EngineError("SamplingParams.logit_bias values must be in [-100, 100]")

    @property
    def penalized(self) -> bool:
        """True when a frequency, presence or repetition penalty applies (needs the history)."""
        return bool(self.frequency_penalty or self.presence_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def shapes_logits(self) -> bool:
        """True when the logits are changed before sampling (penalties, bias, grammar)."""
        return bool(self.penalized or self.logit_bias or self.structural_tag)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the `n` most likely tokens with theirs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What one `step()` produced for one request.

    `text` is the detokenized delta of `new_token_ids` (held back while it could be the start
    of a stop string; a matched stop string and what follows are cut off).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    text: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose full-layer KV came from the prefix cache


@dataclass(frozen=True)
class StoredBlock:
    """A full KV block that became reusable: Dynamo's router hashes `token_ids` itself;
    `block_hash` / `parent_hash` are the engine's ids for removals and parent links."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


class KVEventSink(Protocol):
    def stored(self, blocks: list[StoredBlock]) -> None: ...

    def removed(self, block_hashes: list[int]) -> None: ...


@dataclass(frozen=True)
class KVUsage:
    used_blocks: int
    total_blocks: int
    block_size: int

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks


@dataclass(frozen=True)
class LayerKV:
    """The cache tensors of one layer: full layers [num_blocks, block_size, Hkv, D] (block
    `b` is `k[b]`), sliding layers [max_seqs + 1, window, Hkv, D] (ring row `r` is `k[r]`)."""

    layer: int
    kind: str  # "full" | "sliding"
    k: torch.Tensor
    v: torch.Tensor
    k_scale: float
    v_scale: float


@dataclass(frozen=True)
class KVHandle:
    """Where one request's KV lives (disaggregation, docs/DESIGN.md §4).

    The first `num_tokens` positions' full-layer KV is in `block_ids` (in order, position p in
    block `block_ids[p // block_size]`, row `p % block_size`) of every full layer's tensors;
    the sliding layers' last window is ring row `ring_row` (position p in slot p % window).
    A transport copies those rows between two engines' `layers`; `first_token` is the token
    the prefill engine sampled after the prompt (None in a fresh reservation).
    """

    request_id: str
    num_tokens: int
    block_size: int
    block_ids: tuple[int, ...]
    ring_row: int
    layers: tuple[LayerKV, ...] = field(repr=False)
    first_token: int | None = None
    kv_dtype: str = "bf16"
