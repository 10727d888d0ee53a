"""One request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .types import SamplingParams


class State(enum.Enum):
    WAITING = "waiting"      # queued (new, or preempted: its KV was dropped)
    RUNNING = "running"      # holds blocks and a ring row, computing
    PINNED = "pinned"        # prefill-only and done: KV kept for export until release()
    RESERVED = "reserved"    # kv_reserve()d on a decode engine, waiting for add_request()
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: int
    max_total: int                    # prompt + generated tokens it may reach
    prefill_only: bool = False
    output_ids: list[int] = field(default_factory=list)
    state: State = State.WAITING
    block_ids: list[int] = field(default_factory=list)
    ring_row: int | None = None
    num_computed: int = 0             # positions whose KV (full blocks and ring) is written
    full_cached: int = 0              # positions < this had full-layer KV from the prefix cache
    hist_start: int = 0               # sliding layers never read ring keys below this position
    hashes: list[int] = field(default_factory=list)  # chained hashes of its first full blocks
    num_cached_tokens: int = 0        # prompt tokens served by the prefix cache (reported)
    pending_first: int | None = None  # decode side of a handoff: the token to emit first
    finish_reason: str | None = None
    detok: object | None = None
    grammar: object | None = None     # xgrammar GrammarMatcher of a constrained request
    num_preemptions: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed


@dataclass
class Chunk:
    """Work for one request in one step: positions [start, start + n)."""

    request: Request
    start: int
    n: int

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the last known token, so its logits give the next one."""
        return self.start + self.n == self.request.num_tokens
