"""Random problems for the attention-side beam:: ops, and a small driver that runs one Beam
attention layer through the ops the way DESIGN.md §3 says the engine does.

Cache rows that an op must never read (positions below hist_start, ring slots older than the
window, unused blocks) are filled with NaN: one stray read shows up as NaN in the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from plugins._common import FP8_DTYPE, to_cache

# Kernel tests run on the GPU when there is one, else on the CPU in Triton's interpreter.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_cpu(args):
    """The arguments of a reference op moved to the CPU, the oracle: on the GPU, torch's own
    float -> FP8 conversion of an activation at the top of its range differed from the CPU's
    (a reference run on CUDA was 0.06 off the exact product, H200, 2026-11-29, commit 4c4de9d:
    docs/benchmarks-history.md "Few-token linear GEMMs")."""
    return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)

# (model dtype, KV-cache dtype) pairs the kernels are tested with.
DTYPE_CASES = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(torch.bfloat16, FP8_DTYPE, id="bf16-fp8kv"),
]


@dataclass(frozen=True)
class Seq:
    """One sequence of a step: `cached` positions already in the cache (= q_start), `new`
    query tokens this step, keys below `hist` never readable."""

    cached: int
    new: int
    hist: int = 0


def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def attention_case(seqs: list[Seq], hq: int, hkv: int, d: int, window: int, block_size: int,
                   dtype, kv_dtype, seed: int = 0, device: str = "cpu") -> dict:
    """Arguments of beam::attention for `seqs`: a paged cache (window == 0) with shuffled
    block tables, or one ring row per sequence (window > 0, bs = window)."""
    gen = torch.Generator().manual_seed(seed)
    b, t = len(seqs), sum(s.new for s in seqs)
    bs = window or block_size
    if window:
        cache_index = torch.randperm(b + 2, generator=gen)[:b, None]
        n_rows = b + 2
    else:
        m = max(math.ceil((s.cached + s.new) / bs) for s in seqs) + 1  # one spare column
        n_rows = b * m + 3
        cache_index = torch.randperm(n_rows, generator=gen)[: b * m].view(b, m)
    fp8 = kv_dtype == FP8_DTYPE
    k_scale = torch.tensor(5.0 / 448 if fp8 else 1.0)
    v_scale = torch.tensor(4.0 / 448 if fp8 else 1.0)
    k_cache = torch.full((n_rows, bs, hkv, d), float("nan")).to(kv_dtype)
    v_cache = k_cache.clone()
    for i, s in enumerate(seqs):
        first = max(s.hist, s.cached - window + 1) if window else s.hist
        j = torch.arange(first, s.cached)
        rows, slots = cache_index[i, (j // bs) % cache_index.shape[1]], j % bs
        k_cache[rows, slots] = to_cache(_randn(gen, len(j), hkv, d), kv_dtype, k_scale)
        v_cache[rows, slots] = to_cache(_randn(gen, len(j), hkv, d), kv_dtype, v_scale)
    lens = torch.tensor([s.new for s in seqs])
    args = dict(
        q=_randn(gen, t, hq, d, scale=2.0).to(dtype),  # normed queries, scores of std ~2
        k_new=_randn(gen, t, hkv, d).to(dtype),
        v_new=_randn(gen, t, hkv, d).to(dtype),
        # the output gate per element, as qk_prep returns it: rnd(sigmoid(logit + bias))
        gate=torch.sigmoid(_randn(gen, t, hq, d, scale=2.0).to(dtype)),
        k_cache=k_cache, v_cache=v_cache,
        cu_seqlens_q=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).int(),
        q_start=torch.tensor([s.cached for s in seqs], dtype=torch.int32),
        hist_start=torch.tensor([s.hist for s in seqs], dtype=torch.int32),
        cache_index=cache_index.int().contiguous(), window=window,
        k_scale=k_scale, v_scale=v_scale,
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


class OpsAttentionLayer:
    """One Beam attention layer (transformers' BeamAttention's weights) run through
    beam::qk_prep / attention / cache_write for a batch of sequences, with the KV layout of
    DESIGN.md §3."""

    def __init__(self, cfg, attn, n_seqs: int, max_len: int, block_size: int, kv_dtype,
                 device: str = "cpu", seed: int = 0):
        self.cfg, self.attn, self.device = cfg, attn, device
        self.is_full = cfg.is_full(attn.layer_idx)
        gen = torch.Generator().manual_seed(seed)
        self.window = 0 if self.is_full else cfg.sliding_window
        self.bs = self.window or block_size
        if self.window:
            self.index = torch.randperm(n_seqs + 1, generator=gen)[:n_seqs, None]
            n_rows = n_seqs + 1
        else:
            m = math.ceil(max_len / self.bs)
            n_rows = n_seqs * m + 2
            self.index = torch.randperm(n_rows, generator=gen)[: n_seqs * m].view(n_seqs, m)
        shape = (n_rows, self.bs, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = torch.full(shape, float("nan")).to(kv_dtype).to(device)
        self.v_cache = self.k_cache.clone()
        fp8 = kv_dtype == FP8_DTYPE
        self.k_scale = torch.tensor(6.0 / 448 if fp8 else 1.0, device=device)
        self.v_scale = torch.tensor(3.0 / 448 if fp8 else 1.0, device=device)
        self.hist = torch.zeros(n_seqs, dtype=torch.int32)
        w = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.gate_proj.weight]
        self.w_qkvg = torch.cat(w).to(device)  # the engine's packed q/k/v/gate projection
        self.w_o = attn.o_proj.weight.to(device)

    def slots(self, b: int, positions: torch.Tensor, write: bool) -> torch.Tensor:
        if not write:
            return torch.full_like(positions, -1)
        row = self.index[b, (positions // self.bs) % self.index.shape[1]]
        return row * self.bs + positions % self.bs

    def step(self, xs: list[torch.Tensor], starts: list[int]) -> list[torch.Tensor]:
        """xs[b]: [n_b, H] inputs of sequence b at positions starts[b]...; returns [n_b, H]."""
        cfg, dev = self.cfg, self.device
        pos = [torch.arange(s, s + x.shape[0]) for s, x in zip(starts, xs)]
        # Sliding layers write the ring in qk_prep only for one-token steps (DESIGN.md §3).
        direct = [not self.window or x.shape[0] == 1 for x in xs]
        slot_mapping = torch.cat([self.slots(b, p, w) for b, (p, w) in enumerate(zip(pos, direct))])
        x = torch.cat(xs).to(dev)
        q, k, v, gate = torch.ops.beam.qk_prep(
            x @ self.w_qkvg.t(), torch.cat(pos).to(dev), self.attn.q_norm.weight.to(dev),
            self.attn.k_norm.weight.to(dev), self.attn.gate_bias.to(dev), self.k_cache,
            self.v_cache, slot_mapping.to(dev), self.k_scale, self.v_scale, self.is_full,
            cfg.rms_norm_eps, cfg.rope_theta)
        lens = torch.tensor([0] + [x.shape[0] for x in xs]).cumsum(0)
        out = torch.ops.beam.attention(
            q, k, v, gate, self.k_cache, self.v_cache, lens.int().to(dev),
            torch.tensor(starts, dtype=torch.int32, device=dev), self.hist.to(dev),
            self.index.int().to(dev), self.window, self.k_scale, self.v_scale)
        if self.window and not all(direct):  # store each chunk's last `window` keys
            keep = [self.slots(b, p, not w) for b, (p, w) in enumerate(zip(pos, direct))]
            keep = torch.cat([torch.where(p >= p[-1] - self.window + 1, s, -1)
                              for p, s in zip(pos, keep)])
            torch.ops.beam.cache_write(k, v, self.k_cache, self.v_cache, keep.to(dev),
                                       self.k_scale, self.v_scale)
        y = (out @ self.w_o.t()).cpu()
        return list(y.split(lens.diff().tolist()))
