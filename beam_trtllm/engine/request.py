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
    drafts: list[int] = field(default_factory=list)  # speculative: tokens the next step verifies
    draft_cands: tuple | None = None  # (cand_ids [N, k], cand_scores [N, k]) of sampled drafts
    draft_feats: object | None = None  # adaptive verification: their estimator features [N]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_between(self, lo: int, hi: int) -> list[int]:
        """all_ids[lo:hi] without building all_ids (a decode step of a 1M-token request)."""
        n = len(self.prompt_ids)
        if hi <= n:
            return self.prompt_ids[lo:hi]
        if lo >= n:
            return self.output_ids[lo - n:hi - n]
        return self.prompt_ids[lo:] + self.output_ids[:hi - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed


@dataclass
class Chunk:
    """Work for one request in one step: positions [start, start + n). With speculative
    decoding the last len(drafts) of them are draft tokens after the last known one (a verify
    chunk: every row's logits are read). `pending`: a decode chunk whose one token is the
    previous step's sample, still on the device (an overlapped step, overlap.py)."""

    request: Request
    start: int
    n: int
    drafts: tuple[int, ...] = ()
    pending: bool = False

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the last known token, so its logits give the next one."""
        return self.pending or self.start + self.n - len(self.drafts) == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """Its tokens (a pending chunk's: 0, overwritten on the device by the step)."""
        if self.pending:
            return [0]
        req, known = self.request, self.n - len(self.drafts)
        return req.ids_between(self.start, self.start + known) + list(self.drafts)
