"""DraftKV: the drafter's own paged K/V cache.

It is indexed like the engine's full-layer cache: the same block ids, block size and block
tables as the target's (vLLM numbers the drafter's KV layers after the target's and indexes
them by the target's token positions; shared/research/dflash2.md §3), so slot(p) =
block_table[p // block_size] * block_size + p % block_size.

`cache` is [L, 2 (K, V), num_blocks, block_size, nkv, d]. It is a view of a buffer with one
more slot per (layer, K/V): the scratch slot, where writes with slot -1 land, so that `write`
keeps a fixed shape (no filtering, no host sync: CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from .config import DraftConfig, DraftError


class DraftKV:
    def __init__(self, dcfg: DraftConfig, num_blocks: int, block_size: int,
                 device: torch.device | str, dtype: torch.dtype):
        if num_blocks < 1 or block_size < 1:
            raise DraftError(f"DraftKV: num_blocks {num_blocks} and block_size {block_size} "
                             "must be positive")
        self.cfg, self.num_blocks, self.block_size, self.dtype = dcfg, num_blocks, block_size, dtype
        self.num_layers = dcfg.num_hidden_layers
        self.num_slots = num_blocks * block_size
        shape = (self.num_layers, 2, self.num_slots + 1, dcfg.num_key_value_heads, dcfg.head_dim)
        self._store = torch.zeros(shape, dtype=dtype, device=device)
        self.cache = self._store[:, :, :self.num_slots].unflatten(2, (num_blocks, block_size))

    @property
    def device(self) -> torch.device:
        return self._store.device

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    def _safe(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.where(slots >= 0, slots, torch.full_like(slots, self.num_slots))

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [T] int64 (-1: skip), k / v [L, T, nkv, d]: store every layer's K/V."""
        want = (self.num_layers, slots.shape[0], self.cfg.num_key_value_heads, self.cfg.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise DraftError(f"DraftKV.write: k {list(k.shape)} / v {list(v.shape)}, expected "
                             f"{list(want)}")
        safe = self._safe(slots)
        self._store[:, 0].index_copy_(1, safe, k.to(self.dtype))
        self._store[:, 1].index_copy_(1, safe, v.to(self.dtype))

    def write_layer(self, layer: int, slots: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """One layer's K/V (k / v [T, nkv, d]) at slots [T] (-1: skip)."""
        # an op that mutates the store: a traced index_copy_ on a view of it made
        # torch.compile copy the whole store twice a layer (62 of a 305 us draft step on an
        # H200, 2026-12-04)
        torch.ops.beam_draft.kv_write(self._store, layer, self._safe(slots), k.to(self.dtype),
                                      v.to(self.dtype))

    def read_layer(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [*slots.shape, nkv, d] of `layer` at slots (any shape, -1 reads the scratch)."""
        safe = self._safe(slots).reshape(-1)
        k = self._store[layer, 0].index_select(0, safe)
        v = self._store[layer, 1].index_select(0, safe)
        tail = k.shape[1:]
        return k.view(*slots.shape, *tail), v.view(*slots.shape, *tail)

    @staticmethod
    def slots_of(block_table: torch.Tensor, positions: torch.Tensor,
                 block_size: int) -> torch.Tensor:
        """Slots of positions [R, P] (int64) through block_table [R, M]; negative positions
        give -1. Block ids are clamped into the table (padded rows of a graph batch)."""
        valid = positions >= 0
        pos = positions.clamp(min=0)
        col = (pos // block_size).clamp(max=block_table.shape[1] - 1)
        block = block_table.long().gather(1, col).clamp(min=0)
        slots = block * block_size + pos % block_size
        return torch.where(valid, slots, torch.full_like(slots, -1))


@torch.library.custom_op("beam_draft::kv_write", mutates_args=("store",))
def _kv_write(store: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
    """store [L, 2, S + 1, nkv, d]: layer `layer`'s K and V rows at slots [T] (no -1)."""
    store[layer, 0].index_copy_(0, slots, k)
    store[layer, 1].index_copy_(0, slots, v)


@_kv_write.register_fake
def _(store, layer, slots, k, v) -> None:
    return None
