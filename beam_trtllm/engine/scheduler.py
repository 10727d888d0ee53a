"""Continuous batching: which requests compute which tokens in the next step.

Each step has a token budget (`max_num_tokens`) and at most `max_batch` running sequences.
Running requests go first, oldest first (decode = 1 token; an unfinished prompt continues as
a chunk of what budget is left), then waiting requests are admitted in arrival order while
budget, a ring row and the blocks of their first chunk are free. A request's first chunk
starts after its longest cached prefix (see `_admit`). When a running request needs a block
and none is free, the newest running request is preempted: its KV is dropped (its full
blocks stay cached, so re-admission usually hits them) and it waits at the head of the queue.
`add` refuses a request that could never fit, so the oldest request always makes progress.

With `separate_prefill` (the engine's batch-invariant mode) a step is all decode (and verify)
chunks or all prefill chunks: when both kinds have work the two alternate, so decode rows
never share a step, and its shapes, with a prompt's rows.
"""

from __future__ import annotations

from collections import deque

from .block_manager import BlockManager, chain_hashes
from .kv_cache import KVCache
from .request import Chunk, Request, State


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, blocks: BlockManager, kv: KVCache, max_batch: int, max_num_tokens: int,
                 num_sliding_layers: int, window: int, separate_prefill: bool = False):
        self.blocks, self.kv = blocks, kv
        self.separate_prefill = separate_prefill
        self._last_kind = "decode"
        self.block_size = blocks.block_size
        self.max_batch, self.max_num_tokens = max_batch, max_num_tokens
        # Positions to recompute to rebuild the sliding layers' window (docs/DESIGN.md §3).
        self.restore_span = num_sliding_layers * (window - 1) if num_sliding_layers else 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[Chunk]:
        if not self.separate_prefill:
            return self._schedule(None)
        decode = any(r.num_uncomputed == 1 for r in self.running)
        prefill = bool(self.waiting) or any(r.num_uncomputed > 1 for r in self.running)
        kind = "prefill" if prefill and (not decode or self._last_kind == "decode") else "decode"
        chunks = self._schedule(kind)
        if not chunks and kind == "prefill" and decode:  # nothing admissible: decode instead
            kind, chunks = "decode", self._schedule("decode")
        self._last_kind = kind
        return chunks

    def _schedule(self, kind: str | None) -> list[Chunk]:
        """The step's chunks; kind "decode" / "prefill": only that kind (None: both)."""
        budget = self.max_num_tokens
        chunks: list[Chunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if kind is not None and (req.num_uncomputed == 1) != (kind == "decode"):
                i += 1
                continue
            n = min(req.num_uncomputed, budget)
            drafts = tuple(req.drafts[:budget - 1]) if req.num_uncomputed == 1 else ()
            if drafts and not self._ensure_blocks(req, req.num_computed + n + len(drafts)):
                drafts = ()  # no blocks for the drafts: verify nothing rather than preempt
            n += len(drafts)
            if not self._ensure_blocks(req, req.num_computed + n):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is req:
                    break
                continue
            chunks.append(Chunk(req, req.num_computed, n, drafts))
            budget -= n
            i += 1
        while (kind != "decode" and self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_batch):
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            chunks.append(chunk)
            budget -= chunk.n
        return chunks

    def _ensure_blocks(self, req: Request, num_tokens: int) -> bool:
        need = cdiv(num_tokens, self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.blocks.num_free:
            return False
        req.block_ids += self.blocks.allocate(need)
        return True

    def _admit(self, req: Request, budget: int) -> Chunk | None:
        """Take the cached prefix, a ring row and the first chunk's blocks, or nothing."""
        if self.kv.free_rows == 0:
            return None
        # At least one token must be computed so the step has logits to sample from.
        hit = self.blocks.match_prefix(req.all_ids, (req.num_tokens - 1) // self.block_size)
        cached = len(hit) * self.block_size
        restart = max(0, cached - self.restore_span)
        n = min(req.num_tokens - restart, budget)
        need = cdiv(restart + n, self.block_size) - len(hit)
        if need > self.blocks.num_free:
            self.blocks.free(hit)
            return None
        req.block_ids = hit + self.blocks.allocate(max(0, need))
        req.ring_row = self.kv.allocate_row()
        req.hashes = chain_hashes(req.all_ids[:cached], self.block_size)
        req.full_cached, req.num_computed, req.hist_start = cached, restart, restart
        if req.num_preemptions == 0:
            req.num_cached_tokens = cached
        req.state = State.RUNNING
        self.running.append(req)
        return Chunk(req, restart, n)

    # ------------------------------------------------------------------ after a step
    def commit(self, chunk: Chunk, num_accepted: int = 0) -> None:
        """The chunk's KV is written: advance and make newly full blocks reusable. A verify
        chunk keeps the KV of its known token and its `num_accepted` accepted drafts."""
        req = chunk.request
        req.num_computed = chunk.start + chunk.n - len(chunk.drafts) + num_accepted
        self.register_full_blocks(req)

    def ensure_blocks(self, req: Request, num_tokens: int) -> bool:
        """Blocks for positions < num_tokens (the drafter's block), if free ones are left."""
        return self._ensure_blocks(req, num_tokens)

    def register_full_blocks(self, req: Request) -> None:
        full = min(req.num_computed // self.block_size, len(req.block_ids))
        if len(req.hashes) >= full:  # no new full block (most decode steps)
            return
        bs = self.block_size
        while len(req.hashes) < full:  # (not all_ids: a 1M-token list every block_size steps)
            b = len(req.hashes)
            parent = req.hashes[-1] if req.hashes else None
            ids = req.ids_between(b * bs, (b + 1) * bs)
            h = chain_hashes(ids, bs, parent)[0]
            self.blocks.register(req.block_ids[b], h, parent, ids)
            req.hashes.append(h)

    # ------------------------------------------------------------------ releasing KV
    def preempt(self, req: Request) -> None:
        self._drop_kv(req)
        self.running.remove(req)
        req.state = State.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _drop_kv(self, req: Request) -> None:
        if req.block_ids:
            self.blocks.free(req.block_ids)
        if req.ring_row is not None:
            self.kv.free_row(req.ring_row)
        req.block_ids, req.ring_row, req.hashes = [], None, []
        req.num_computed = req.full_cached = req.hist_start = 0
        req.drafts, req.draft_cands = [], None  # drafted against KV that is gone

    def finish(self, req: Request, keep_kv: bool = False) -> None:
        """Leave the running set; free its KV unless it is pinned for export."""
        if req in self.running:
            self.running.remove(req)
        elif req.state == State.WAITING and req in self.waiting:
            self.waiting.remove(req)
        if keep_kv:
            req.state = State.PINNED
        else:
            self._drop_kv(req)
            req.state = State.FINISHED

    def release(self, req: Request) -> None:
        """Free a pinned export or an unused reservation."""
        self._drop_kv(req)
        req.state = State.FINISHED

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
