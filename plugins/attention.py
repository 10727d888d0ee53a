"""beam::attention — GQA attention of one step (decode and chunked prefill, ragged, one call)
over a paged (full layer) or ring (sliding layer) KV cache, with the output gate applied.

Sequence b owns query tokens cu_seqlens_q[b] : cu_seqlens_q[b+1] at positions
p = q_start[b] + i. Its keys are positions j in [hist_start[b], p]:
    j <  q_start[b]:  the cache, block cache_index[b, (j // bs) % M], row j % bs
                      (bs = k_cache.shape[1])
    j >= q_start[b]:  this step's k_new / v_new, token cu_seqlens_q[b] + (j - q_start[b])
Full layer: cache_index is the block table (paged). Sliding layer: one ring row per sequence
(M = 1, bs = sliding_window), so position j sits in slot j % window.

    score(p, j) = q_p · k_j / sqrt(D)
    visible iff hist_start <= j <= p and (window == 0 or p - j < window)
    o_p,h = softmax_j(score) · V,   query head h reads KV head h // (Hq / Hkv)
    out[t, h·D:(h+1)·D] = rnd(o_t,h * gate[t, h])         the output gate, per element

With an FP8 cache, this step's own keys and values enter as the cache stores them (the FP8
codes of clamp(x / scale, ±448), times the scale): a query sees its chunk's keys exactly as a
later step reads them back, so no result depends on whether a prefix was cached.

Shapes / dtypes: q [T, Hq, D], k_new / v_new [T, Hkv, D], gate [T, Hq, D] (= beam::qk_prep's
rnd(sigmoid(rnd(g + gate_bias)))) (fp32, bf16, fp16; one dtype); k_cache / v_cache [N, bs, Hkv, D] (q's dtype or float8_e4m3fn, where the
value is entry * k_scale / v_scale); cu_seqlens_q [B+1], q_start [B], hist_start [B],
cache_index [B, M] int32; window int (0 = full); k_scale, v_scale fp32 []; out_scale fp32 []
or None -> out [T, Hq·D] in q's dtype, or with out_scale the float8_e4m3fn codes
fp8(clamp(out / out_scale, ±448)) of that rounded output: the o_proj's static input_scale, so
its W8A8 GEMM (beam::linear_fp8 on FP8 input) needs no quantizer launch of its own.
Contract: functional, returns a new tensor; reads the caches only. Every sequence has at
least one query token (so T == B means a pure decode step: the split-KV kernel runs; any
other T takes the tiled prefill kernel). hist_start <= q_start. On sliding layers the cache
must hold the `window - 1` positions before q_start (DESIGN.md §3). FP32 softmax
(transformers' BeamAttention, with FP32 scores and P·V). CUDA-graph safe: the grid depends on shapes only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from beam_trtllm.quant_formats import quantize_fp8_activation

from ._attention_decode import launch_decode
from ._attention_prefill import launch_prefill
from ._common import (FLOAT_DTYPES, FP8_DTYPE, check, check_cache_pair, check_tensor, from_cache,
                      is_fp8, to_cache)
from ._reference import attention_mask
from .registry import beam_op, dispatch, register

OP = "attention"


def attend(q, k, v, visible, gate) -> torch.Tensor:
    """FP32 attention of one sequence as the reference layer computes it.
    q [n, Hq, D], k / v [m, Hkv, D], visible [n, m] bool, gate [n, Hq, D] -> [n, Hq, D] FP32."""
    rep = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf) * gate.float()


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """FP32 values of this step's K or V as the cache will return them (FP8: round trip)."""
    return from_cache(to_cache(x, cache_dtype, scale), scale) if is_fp8(cache_dtype) else x.float()


@register(OP, "reference")
def ref_attention(q, k_new, v_new, gate, k_cache, v_cache, cu_seqlens_q, q_start, hist_start,
                  cache_index, window: int, k_scale, v_scale, out_scale=None) -> torch.Tensor:
    t, hq, d = q.shape
    block_size, m = k_cache.shape[1], cache_index.shape[1]
    out = q.new_empty(t, hq * d)
    bounds = cu_seqlens_q.tolist()
    for b in range(len(bounds) - 1):
        lo, hi = bounds[b], bounds[b + 1]
        check(hi > lo, OP, f"sequence {b} has no query tokens (cu_seqlens_q {bounds})")
        start, first = int(q_start[b]), int(hist_start[b])
        if window:  # older ring slots may already hold newer keys; no query here sees them
            first = max(first, start - window + 1)
        cached = torch.arange(first, start, device=q.device)
        blocks = cache_index[b, (cached // block_size) % m].long()
        k_old = from_cache(k_cache[blocks, cached % block_size], k_scale)
        v_old = from_cache(v_cache[blocks, cached % block_size], v_scale)
        q_pos = torch.arange(start, start + hi - lo, device=q.device)
        k_pos = torch.cat([cached, q_pos])
        visible = attention_mask(q_pos[None], k_pos[None], window or None)[0]
        k_all = torch.cat([k_old, as_cached(k_new[lo:hi], k_cache.dtype, k_scale)])
        v_all = torch.cat([v_old, as_cached(v_new[lo:hi], v_cache.dtype, v_scale)])
        o = attend(q[lo:hi], k_all, v_all, visible, gate[lo:hi])
        out[lo:hi] = o.to(q.dtype).flatten(1)
    return out if out_scale is None else quantize_fp8_activation(out, out_scale)


@register(OP, "triton")
def _launch_attention(q, k_new, v_new, gate, k_cache, v_cache, cu_seqlens_q, q_start, hist_start,
                      cache_index, window: int, k_scale, v_scale, out_scale=None) -> torch.Tensor:
    if q.shape[0] == cu_seqlens_q.shape[0] - 1:  # T == B: one query per sequence, decode
        return launch_decode(q, k_new, v_new, gate, k_cache, v_cache, q_start, hist_start,
                             cache_index, window, k_scale, v_scale, out_scale)
    return launch_prefill(q, k_new, v_new, gate, k_cache, v_cache, cu_seqlens_q, q_start,
                          hist_start, cache_index, window, k_scale, v_scale, out_scale)


def _check(q, k_new, v_new, gate, k_cache, v_cache, cu_seqlens_q, q_start, hist_start,
           cache_index, window: int, k_scale, v_scale, out_scale=None) -> None:
    check_tensor(OP, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    dev, (t, hq, d) = q.device, q.shape
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        check_tensor(OP, name, x, ndim=3, dtypes=(q.dtype,), device=dev)
        check(x.shape[0] == t and x.shape[2] == d, OP,
              f"{name} {tuple(x.shape)} must be [T={t}, Hkv, D={d}]")
        check(x.stride(2) == 1, OP, f"{name} must be contiguous in head_dim")
    check(q.is_contiguous(), OP, "q must be contiguous")
    check(v_new.shape == k_new.shape, OP, "k_new and v_new shapes differ")
    hkv = k_new.shape[1]
    check(hq % hkv == 0, OP, f"{hq} query heads are not a multiple of {hkv} KV heads")
    check_tensor(OP, "gate", gate, ndim=3, dtypes=(q.dtype,), device=dev)
    check(tuple(gate.shape) == (t, hq, d) and gate.is_contiguous(), OP,
          f"gate must be contiguous [{t}, {hq}, {d}], got {tuple(gate.shape)}")
    check_cache_pair(OP, k_cache, v_cache, k_scale, v_scale, dev)
    check(tuple(k_cache.shape[2:]) == (hkv, d), OP,
          f"k_cache rows {tuple(k_cache.shape[2:])} must be [Hkv, D] = ({hkv}, {d})")
    check(is_fp8(k_cache.dtype) or k_cache.dtype == q.dtype, OP,
          f"k_cache dtype {k_cache.dtype} must be q's ({q.dtype}) or float8_e4m3fn")
    check_tensor(OP, "cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), device=dev)
    b = cu_seqlens_q.shape[0] - 1
    check(b >= 1 and t >= b, OP, f"cu_seqlens_q has {b + 1} entries for {t} tokens")
    for name, x in (("q_start", q_start), ("hist_start", hist_start)):
        check_tensor(OP, name, x, ndim=1, dtypes=(torch.int32,), device=dev)
        check(x.shape[0] == b, OP, f"{name} has {x.shape[0]} entries for {b} sequences")
    check_tensor(OP, "cache_index", cache_index, ndim=2, dtypes=(torch.int32,), device=dev)
    check(cache_index.shape[0] == b and cache_index.is_contiguous(), OP,
          f"cache_index must be contiguous [B={b}, M], got {tuple(cache_index.shape)}")
    check(window >= 0, OP, f"window must be >= 0 (0 = full attention), got {window}")
    if out_scale is not None:
        check_tensor(OP, "out_scale", out_scale, ndim=0, dtypes=(torch.float32,), device=dev)


@beam_op("attention", mutates_args=())
def attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, gate: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
              q_start: torch.Tensor, hist_start: torch.Tensor, cache_index: torch.Tensor,
              window: int, k_scale: torch.Tensor, v_scale: torch.Tensor,
              out_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    args = (q, k_new, v_new, gate, k_cache, v_cache, cu_seqlens_q, q_start, hist_start,
            cache_index, window, k_scale, v_scale, out_scale)
    _check(*args)
    return dispatch(OP, q.device, *args)


@attention.register_fake
def _(q, k_new, v_new, gate, k_cache, v_cache, cu_seqlens_q, q_start, hist_start, cache_index,
      window, k_scale, v_scale, out_scale=None):
    _check(q, k_new, v_new, gate, k_cache, v_cache, cu_seqlens_q, q_start, hist_start,
           cache_index, window, k_scale, v_scale, out_scale)
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2],
                       dtype=q.dtype if out_scale is None else FP8_DTYPE)
