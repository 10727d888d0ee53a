"""Paged KV blocks of the full-attention layers: free queue, reference counts, chained prefix
hashes, KV events and the hooks of a secondary (offload) tier.

A block is *free* when no request holds it (ref count 0). A free block that is full and whose
KV was written keeps its hash, so a later request with the same prefix can take it back
(prefix reuse); it is evicted only when the allocator hands it out again. The free queue is
LRU: blocks freed by a request go to the tail last-block-first, so a prefix's tail is evicted
before its head (the head is the part more prompts share). Every count is exact: `check()`
verifies the invariants and tests call it.

Hashes chain: hash(block) = H(parent hash, the block's token ids), so equal hashes mean equal
prefixes. Dynamo's KV router hashes the published token ids itself; our hashes are only the
engine's ids for `removed` events and parent links (see docs/DESIGN.md §3).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .types import EngineError, StoredBlock

# offload(block_hash, parent_hash, token_ids, kv) / fetch(block_hash) -> kv or None
OffloadFn = Callable[[int, "int | None", tuple, torch.Tensor], None]
FetchFn = Callable[[int], "torch.Tensor | None"]


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Chained 63-bit hash of one full block (fits Dynamo's u64/i64 block ids)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"root" if parent is None else parent.to_bytes(8, "little"))
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids))
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None,
                 start_block: int = 0) -> list[int]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on (chained)."""
    out = []
    for b in range(start_block, len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[b * block_size:(b + 1) * block_size])
        out.append(parent)
    return out


@dataclass
class _Block:
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 read_block: Callable[[int], torch.Tensor] | None = None,
                 write_block: Callable[[int, torch.Tensor], None] | None = None):
        if num_blocks < 1 or block_size < 1:
            raise EngineError(f"block manager needs >= 1 block of >= 1 token, got "
                              f"{num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id (reusable blocks)
        self._events: list[tuple[str, list]] = []
        self._read_block, self._write_block = read_block, write_block
        self.offload: OffloadFn | None = None
        self.fetch: FetchFn | None = None
        self.stats = {"hits": 0, "fetched": 0, "evicted": 0, "offloaded": 0}

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def hash_of(self, block_id: int) -> int | None:
        return self._blocks[block_id].block_hash

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        """n blocks with ref count 1, evicting the least recently freed cached blocks."""
        if n > len(self._free):
            raise EngineError(f"KV cache: {n} blocks requested, {len(self._free)} free")
        return [self._take_free() for _ in range(n)]

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        self._evict(block_id)
        self._blocks[block_id].ref_count = 1
        return block_id

    def _evict(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) == block_id:
            del self._cached[block.block_hash]
            self.stats["evicted"] += 1
            if self.offload is not None and self._read_block is not None:
                self.offload(block.block_hash, block.parent_hash, block.token_ids,
                             self._read_block(block_id))
                self.stats["offloaded"] += 1
            self._event("removed", block.block_hash)
        block.block_hash, block.parent_hash, block.token_ids = None, None, ()

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference of each block (a request's table, in position order)."""
        for block_id in reversed(block_ids):  # tail first: the shared head is evicted last
            block = self._blocks[block_id]
            if block.ref_count <= 0:
                raise EngineError(f"KV cache: block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    # ------------------------------------------------------------------ prefix reuse
    def match_prefix(self, token_ids: Sequence[int], max_blocks: int) -> list[int]:
        """Take a reference on the longest cached chain of full blocks of `token_ids` (at most
        `max_blocks`); on a miss, ask the secondary tier (`fetch`) before giving up."""
        hashes = chain_hashes(token_ids[: max_blocks * self.block_size], self.block_size)
        taken: list[int] = []
        parent = None
        for i, h in enumerate(hashes):
            block_id = self._cached.get(h)
            if block_id is None:
                block_id = self._fetch(h, parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
                if block_id is None:
                    break
            else:
                self._ref(block_id)
                self.stats["hits"] += 1
            taken.append(block_id)
            parent = h
        return taken

    def _ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _fetch(self, h: int, parent: int | None, token_ids: Sequence[int]) -> int | None:
        if self.fetch is None or self._write_block is None or not self._free:
            return None
        kv = self.fetch(h)
        if kv is None:
            return None
        block_id = self._take_free()
        self._write_block(block_id, kv)
        self.register(block_id, h, parent, token_ids)
        self.stats["fetched"] += 1
        return block_id

    def register(self, block_id: int, h: int, parent: int | None, token_ids: Sequence[int]) -> bool:
        """Mark a full, written block reusable under hash `h`. If another block already holds
        that prefix, this one stays private (it is freed like any other) and False is returned."""
        block = self._blocks[block_id]
        if len(token_ids) != self.block_size:
            raise EngineError(f"KV cache: block {block_id} registered with {len(token_ids)} "
                              f"tokens, block size is {self.block_size}")
        if h in self._cached or block.block_hash is not None:
            return False
        block.block_hash, block.parent_hash, block.token_ids = h, parent, tuple(token_ids)
        self._cached[h] = block_id
        self._event("stored", StoredBlock(h, parent, block.token_ids))
        return True

    # ------------------------------------------------------------------ events
    def _event(self, kind: str, item) -> None:
        if self._events and self._events[-1][0] == kind:
            self._events[-1][1].append(item)
        else:
            self._events.append((kind, [item]))

    def drain_events(self) -> list[tuple[str, list]]:
        """[("stored", [StoredBlock..]) | ("removed", [hash..])] in the order they happened."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Raise if the accounting is inconsistent (used by tests after every scenario)."""
        for i, block in enumerate(self._blocks):
            if block.ref_count < 0:
                raise AssertionError(f"block {i}: negative ref count")
            if (block.ref_count == 0) != (i in self._free):
                raise AssertionError(f"block {i}: ref count {block.ref_count} but "
                                     f"{'in' if i in self._free else 'not in'} the free queue")
        for h, i in self._cached.items():
            if self._blocks[i].block_hash != h:
                raise AssertionError(f"cached hash {h} points at block {i} holding another hash")
