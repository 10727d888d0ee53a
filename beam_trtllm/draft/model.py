"""DFlash2Drafter: the DFlash2 block drafter of a Beam target (`DFlash2BeamDraftModel`,
shared/research/dflash2.md §3-§6) over its own paged K/V (kv.py).

One step of a request: the target's verified tokens leave their states at `target_layer_ids`;
`context_kv` turns them into every draft layer's K/V (written by the caller into DraftKV at
their slots); `draft` runs the block [anchor, mask x N] at positions P0..P0+N through the
layers (its own K/V written at P0..P0+N first, then non-causal window attention over keys
[P0-w+1, P0+N]), takes the top-k candidates of each mask row from the target's head, scores
them against the candidates one position back, and walks the lattice left to right.

`draft` is CUDA-graph capturable: for a given R (and block-table width M) every shape is fixed,
nothing reads a device value on the host (no .item() / .tolist() / data-dependent shapes), and
the walk is N steps of tensor ops. Constants it needs (RoPE frequencies, offsets, the mask id)
are made on the device at construction, so a capture launches no host-to-device copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from . import layers as L
from .config import DraftConfig, DraftError
from .kv import DraftKV
from .quant import SCALE_SUFFIX, fp8_modules
from .weights import check_tensors, fp8_modules_of, load_draft_weights


def _placed(name: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A weight on the device in the activation dtype; FP8 codes as they are and their scales
    in FP32 (beam::linear_fp8_channel's operands)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.to(device)
    if name.endswith(SCALE_SUFFIX):
        return t.to(device, torch.float32)
    return t.to(device, dtype)


class DraftOutput(NamedTuple):
    tokens: torch.Tensor       # [R, N] int64: the walk's drafts d_1..d_N
    cand_ids: torch.Tensor     # [R, N, k] int64: top-k candidate ids per position
    cand_scores: torch.Tensor  # [R, N, k] fp32: the realized row S[s, prev_{s-1}, :]


class DFlash2Drafter:
    def __init__(self, dcfg: DraftConfig, weights: dict[str, torch.Tensor],
                 embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                 device: torch.device | str, dtype: torch.dtype):
        fp8 = fp8_modules_of(weights)
        bad = sorted(set(fp8) - set(fp8_modules(dcfg)))
        if bad:
            raise DraftError(f"drafter weights: tensor {bad[0]}.weight is FP8, but the drafter "
                             "keeps it unquantized (the precision tables of draft/quant.py)")
        check_tensors(dcfg, {n: tuple(t.shape) for n, t in weights.items()}, "drafter weights",
                      fp8)
        want = (dcfg.vocab_size, dcfg.hidden_size)
        for name, t in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(t.shape) != want:
                raise DraftError(f"the target's {name} is {list(t.shape)}, the drafter needs "
                                 f"{list(want)}")
        self.cfg, self.dtype, self.device = dcfg, dtype, torch.device(device)
        self.fp8_modules = fp8
        self.w = {n: _placed(n, t, self.device, dtype) for n, t in weights.items()}
        if fp8:
            import plugins  # noqa: F401  (registers torch.ops.beam.linear_fp8_channel)
        self.embed = embed_tokens.to(self.device, dtype)
        self.lm_head = lm_head.to(self.device, dtype)
        self._constants()

    def _constants(self) -> None:
        c, dev = self.cfg, self.device
        self.inv_freq = L.rope_inv_freq(c.head_dim, c.rope_theta, dev)
        self.block_offsets = torch.arange(c.block_size, device=dev)
        # keys [P0 - w + 1, P0 + N]: every key some row of the block can see
        self.key_offsets = torch.arange(-c.sliding_window + 1, c.block_size, device=dev)
        self.mask_ids = torch.full((1, c.num_draft_tokens), c.mask_token_id, device=dev)

    @classmethod
    def from_dir(cls, path: str | Path, target_cfg, embed_tokens: torch.Tensor,
                 lm_head: torch.Tensor, device, dtype: torch.dtype) -> "DFlash2Drafter":
        dcfg = DraftConfig.from_dir(path)
        try:
            dcfg.check_target(target_cfg)
        except DraftError as exc:
            raise DraftError(f"{path}: {exc}") from None
        return cls(dcfg, load_draft_weights(path, dcfg), embed_tokens, lm_head, device, dtype)

    # ------------------------------------------------------------------ context path (§3)
    def context_kv(self, hidden: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, n*H] (target states at target_layer_ids, concatenated in that order),
        positions [T] int64 -> (k, v) [L, T, nkv, d] for DraftKV.write."""
        want = len(self.cfg.target_layer_ids) * self.cfg.hidden_size
        if hidden.shape[-1] != want:
            raise DraftError(f"context_kv: hidden has {hidden.shape[-1]} features, the drafter "
                             f"takes {want} ({len(self.cfg.target_layer_ids)} target layers "
                             f"x {self.cfg.hidden_size})")
        c = L.project_context(self.w, hidden.to(self.dtype), self.cfg)
        ks, vs = zip(*(L.layer_kv(self.w, i, c, positions, self.inv_freq, self.cfg)
                       for i in range(self.cfg.num_hidden_layers)))
        return torch.stack(ks), torch.stack(vs)

    # ------------------------------------------------------------------ the block (§4, §5)
    def block_hidden(self, kv: DraftKV, ids: torch.Tensor, start: torch.Tensor,
                     block_table: torch.Tensor) -> torch.Tensor:
        """Final normed states [R, B, H] of the blocks ids [R, B] at start + 0..B-1, after
        writing their K/V into `kv` (any ids: `draft` passes [anchor, mask...])."""
        c = self.cfg
        r, b = ids.shape
        pos = start[:, None] + self.block_offsets[None, :b]
        block_slots = DraftKV.slots_of(block_table, pos, kv.block_size).reshape(-1)
        key_pos = start[:, None] + self.key_offsets[None, :c.sliding_window - 1 + b]
        key_slots = DraftKV.slots_of(block_table, key_pos, kv.block_size)
        visible = L.window_visible(pos, key_pos, c.sliding_window)

        def keys(i: int, k: torch.Tensor, v: torch.Tensor):
            kv.write_layer(i, block_slots, k.reshape(r * b, *k.shape[2:]),
                           v.reshape(r * b, *v.shape[2:]))
            k_all, v_all = kv.read_layer(i, key_slots)
            return k_all, v_all, visible

        return L.block_forward(self.w, self.embed[ids], pos, keys, self.inv_freq, c)

    # ------------------------------------------------------------------ head and walk (§6)
    def propose(self, h: torch.Tensor, anchors: torch.Tensor, uniforms: torch.Tensor | None,
                temperature: torch.Tensor) -> DraftOutput:
        """h [R, N, H] (the mask rows) -> the walk's drafts, candidates and realized rows."""
        ids, unary = L.candidates(h, self.lm_head, self.cfg)
        scores = L.lattice(self.w, h, ids, unary, anchors)
        tokens, rows = L.walk(scores, ids, uniforms, temperature)
        return DraftOutput(tokens, ids, rows)

    def draft(self, kv: DraftKV, anchors: torch.Tensor, start: torch.Tensor,
              block_table: torch.Tensor, uniforms: torch.Tensor | None,
              temperature: torch.Tensor) -> DraftOutput:
        """anchors [R] int64 (the last emitted token), start [R] int64 (P0, its position),
        block_table [R, M] int32 (the target's; blocks exist up to P0 + N), uniforms [R, N]
        FP32 or None (None: greedy walk), temperature [R] FP32 (0: greedy row).

        Capturable (see the module docstring); padded rows of a graph batch must point their
        block table at a scratch block, since the block's K/V are written for every row."""
        r = anchors.shape[0]
        ids = torch.cat([anchors[:, None].long(), self.mask_ids.expand(r, -1)], dim=1)
        h = self.block_hidden(kv, ids, start.long(), block_table)
        return self.propose(h[:, 1:], anchors.long(), uniforms, temperature)
