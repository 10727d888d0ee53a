"""The KV cache tensors: paged blocks for the full-attention layers, one ring row per sequence
for the sliding layers (docs/DESIGN.md §3), FP8 scales, and block / ring row copies for the
offload tier and disaggregated transfer.

Memory: one tensor per kind so a transport can register each as a single region.
- full:    [n_full, 2 (K, V), num_blocks, block_size, Hkv, D]; block b of full layer l is
           `full[l, 0, b]` / `full[l, 1, b]`.
- sliding: [n_sliding, 2, max_seqs + 1, ring_len, Hkv, D]; position p of the sequence in ring
           row r is slot p % ring_len. Row `max_seqs` is a scratch row: padded rows of a CUDA
           graph batch point at it, so they never touch a live sequence's ring. ring_len is the
           window, plus the draft tokens with speculative decoding: a verify step writes its
           N + 1 positions before attending, and the N rejected ones must not overwrite keys
           the next step's queries still see.
"""

from __future__ import annotations

import torch

from ..config import BeamConfig
from .types import EngineError, KVCapacityError, LayerKV

KV_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


class KVCache:
    def __init__(self, cfg: BeamConfig, num_blocks: int, block_size: int, max_seqs: int,
                 kv_dtype: str, device: torch.device,
                 k_scales: dict[int, float] | None = None, v_scales: dict[int, float] | None = None,
                 ring_len: int | None = None):
        if kv_dtype not in KV_TORCH_DTYPES:
            raise EngineError(f"kv dtype must be one of {sorted(KV_TORCH_DTYPES)}, got {kv_dtype!r}")
        self.cfg, self.block_size, self.max_seqs = cfg, block_size, max_seqs
        self.num_blocks, self.kv_dtype = num_blocks, kv_dtype
        self.window = cfg.sliding_window
        self.ring_len = ring_len or cfg.sliding_window
        if self.ring_len < self.window:
            raise EngineError(f"KV cache: ring_len {self.ring_len} < sliding_window {self.window}")
        dtype = KV_TORCH_DTYPES[kv_dtype]
        hkv, d = cfg.num_key_value_heads, cfg.head_dim
        self.full_layers, self.sliding_layers = cfg.full_layers, cfg.sliding_layers
        self.full = torch.zeros(len(self.full_layers), 2, num_blocks, block_size, hkv, d,
                                dtype=dtype, device=device)
        self.sliding = torch.zeros(len(self.sliding_layers), 2, max_seqs + 1, self.ring_len, hkv, d,
                                   dtype=dtype, device=device)
        self._slot = {layer: i for i, layer in enumerate(self.full_layers)}
        self._slot.update({layer: i for i, layer in enumerate(self.sliding_layers)})
        k_scales, v_scales = k_scales or {}, v_scales or {}
        self.k_scale = {i: float(k_scales.get(i, 1.0)) for i in range(cfg.num_hidden_layers)}
        self.v_scale = {i: float(v_scales.get(i, 1.0)) for i in range(cfg.num_hidden_layers)}
        # fp32 0-d tensors the ops take (kept on the device so CUDA graphs capture no copies)
        self.k_scale_t = {i: torch.tensor(s, dtype=torch.float32, device=device)
                          for i, s in self.k_scale.items()}
        self.v_scale_t = {i: torch.tensor(s, dtype=torch.float32, device=device)
                          for i, s in self.v_scale.items()}
        self._free_rows = list(range(max_seqs))

    @property
    def scratch_row(self) -> int:
        return self.max_seqs

    @property
    def nbytes(self) -> int:
        return self.full.numel() * self.full.element_size() + \
            self.sliding.numel() * self.sliding.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of decoder layer i (full: paged; sliding: rings)."""
        store = self.full if self.cfg.is_full(i) else self.sliding
        return store[self._slot[i], 0], store[self._slot[i], 1]

    def layers(self) -> tuple[LayerKV, ...]:
        out = []
        for i in range(self.cfg.num_hidden_layers):
            k, v = self.layer(i)
            kind = "full" if self.cfg.is_full(i) else "sliding"
            out.append(LayerKV(i, kind, k, v, self.k_scale[i], self.v_scale[i]))
        return tuple(out)

    # ------------------------------------------------------------------ ring rows
    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def allocate_row(self) -> int:
        if not self._free_rows:
            raise KVCapacityError(f"KV cache: all {self.max_seqs} sliding-window ring rows are in use")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        if not 0 <= row < self.max_seqs or row in self._free_rows:
            raise EngineError(f"KV cache: ring row {row} freed twice or never allocated")
        self._free_rows.append(row)

    # ------------------------------------------------------------------ block copies (tier)
    def read_block(self, block_id: int) -> torch.Tensor:
        """A copy of one block of every full layer: [n_full, 2, block_size, Hkv, D]."""
        return self.full[:, :, block_id].clone()

    def write_block(self, block_id: int, kv: torch.Tensor) -> None:
        want = self.full[:, :, block_id]
        if tuple(kv.shape) != tuple(want.shape) or kv.dtype != want.dtype:
            raise EngineError(f"KV tier returned a block of shape {list(kv.shape)} {kv.dtype}, "
                              f"this engine's blocks are {list(want.shape)} {want.dtype}")
        want.copy_(kv)
