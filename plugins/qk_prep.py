"""beam::qk_prep — everything between the packed QKV(+gate) projection and the attention.

From one row of the packed projection `qkvg[t] = [q (Hq·D) | k (Hkv·D) | v (Hkv·D) | g (Hq)]`
of the token at position p (or, given x and g_weight, `qkv[t]` without g, and the gate logits
computed here: g = x[t] · g_weight^T, summed in FP32 and rounded to x's dtype, which is what
the reference's g_proj gives; the shipped recipes keep g_proj in BF16 while q/k/v are FP8, so
this saves the gate's own GEMM, cuBLAS' split-K reduce and a concat):

    q_h = RMSNorm(q_h; q_norm_w),  k_h = RMSNorm(k_h; k_norm_w)       per head, rounded to dtype
    full layer (NoPE):   q_h = q_h * (1 + p / ssmax_base) ** ssmax_exponent
    sliding layer:       q_h, k_h = RoPE(q_h, p), RoPE(k_h, p)        rotate-half, rope_theta
    gate = sigmoid(g) in FP32
    k_cache / v_cache row at slot_mapping[t] = store(k), store(v)     (as beam::cache_write)

Shapes / dtypes: qkvg [T, Hq·D + 2·Hkv·D + Hq] (fp32, bf16, fp16), or [T, Hq·D + 2·Hkv·D]
with x [T, H] and g_weight [Hq, H] (both in qkvg's dtype); or qkvg as a split GEMM's FP32
partial sums [S, T, width] (beam::linear_fp8's split_k output) with out_dtype: the projection
is their sum in order rounded to out_dtype, as the unsplit GEMM's output would be (x and
g_weight then in out_dtype); positions [T] int32/int64,
q_norm_weight, k_norm_weight [D], k_cache, v_cache [N, bs, Hkv, D] (see cache_write),
slot_mapping [T] int64 (-1 = do not write), k_scale, v_scale fp32 [] (FP8 caches only)
-> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] in qkvg's dtype (out_dtype for partials),
gate [T, Hq] fp32.
Hkv and D come from the cache and the norm weight; Hq from qkvg's width (or g_weight).
Contract: returns four new tensors and mutates k_cache / v_cache (only the slots >= 0).
One launch: per token, one program per 16 query heads and one for k, v and the cache rows;
the gate GEMM's tiles are further programs of the same grid.
Matches `reference.BeamAttention.project` (rms_norm, apply_rope, ssmax_scale). RoPE angles and
the SSMax scale are computed in float64 like the reference (`_rope.py`), so they stay exact at 1M
positions (the angle is reduced to [-pi, pi] in float64 before an FP32 cos/sin). CUDA-graph safe.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from beam_trtllm.reference import apply_rope, rms_norm, ssmax_scale

from . import _interp_dot  # noqa: F401  (interpreter BF16 dot fix, for the gate tiles)
from ._attention_tiles import dot_precision
from ._common import (FLOAT_DTYPES, cast_rne, check, check_cache_pair, check_tensor, next_pow2,
                      rows_times_weights_after_wait, sum_partials, summed_partials)
from ._pdl import chain_mode, launch_early, let_next_launch, wait_for_inputs
from ._rope import rope_inv_freq, rotation, rotation_constants
from .cache_write import check_slots, ref_cache_write, store_cache_rows
from .registry import dispatch, register

OP = "qk_prep"


def split_qkvg(qkvg: torch.Tensor, num_kv_heads: int, head_dim: int,
               packed_gate: bool = True) -> tuple[int, int]:
    """(Hq, width) of a packed projection; raises if the width is not Hq·D + 2·Hkv·D + Hq
    (or Hq·D + 2·Hkv·D without the packed gate)."""
    width = qkvg.shape[-1]
    rest = width - 2 * num_kv_heads * head_dim
    per_head = head_dim + (1 if packed_gate else 0)
    hq = rest // per_head
    check(rest > 0 and rest % per_head == 0 and hq % num_kv_heads == 0, OP,
          f"qkvg width {width} is not Hq*D + 2*Hkv*D{' + Hq' if packed_gate else ''} for "
          f"D={head_dim}, Hkv={num_kv_heads} and Hq a multiple of Hkv")
    return hq, width


@register(OP, "reference")
def ref_qk_prep(qkvg, positions, q_norm_weight, k_norm_weight, k_cache, v_cache, slot_mapping,
                k_scale, v_scale, is_full: bool, eps: float, rope_theta: float,
                ssmax_base: float, ssmax_exponent: float, x=None, g_weight=None, out_dtype=None):
    qkvg = sum_partials(qkvg, out_dtype)  # a split GEMM's partials: their rounded sum
    t, (hkv, d) = qkvg.shape[0], k_cache.shape[2:]
    hq, _ = split_qkvg(qkvg, hkv, d, packed_gate=g_weight is None)
    if g_weight is None:
        q, k, v, g = qkvg.split([hq * d, hkv * d, hkv * d, hq], dim=1)
    else:  # the reference's g_proj: a Linear in the model dtype
        (q, k, v), g = qkvg.split([hq * d, hkv * d, hkv * d], dim=1), F.linear(x, g_weight)
    q = rms_norm(q.reshape(t, hq, d), q_norm_weight, eps)
    k = rms_norm(k.reshape(t, hkv, d), k_norm_weight, eps)
    v = v.reshape(t, hkv, d).clone(memory_format=torch.contiguous_format)
    gate = torch.sigmoid(g.float())
    if is_full:  # NoPE + SSMax on the queries only
        scale = ssmax_scale(positions, ssmax_base, ssmax_exponent)
        q = (q.float() * scale[:, None, None]).to(q.dtype)
    else:  # apply_rope takes [B, T, heads, D] and positions [B, T]
        q = apply_rope(q[None], positions[None], rope_theta)[0]
        k = apply_rope(k[None], positions[None], rope_theta)[0]
    ref_cache_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k, v, gate


@triton.jit
def _rms_halves(x1, x2, w1, w2, eps, D: tl.constexpr, dtype: tl.constexpr):
    """Per-row RMSNorm of a head held as its two halves [rows, D/2]; rounded to dtype."""
    ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D
    inv = (1.0 / tl.sqrt_rn(ms + eps))[:, None]
    y1 = cast_rne(x1 * inv * w1, dtype).to(tl.float32)
    return y1, cast_rne(x2 * inv * w2, dtype).to(tl.float32)


@triton.jit
def _prep_q(row, q_ptr, qw_ptr, t, part, d, cos, sin, eps, stride_s, HQ: tl.constexpr,
            D: tl.constexpr, QH: tl.constexpr, PARTIALS: tl.constexpr):
    """Query heads [part * QH, part * QH + QH) of token t: RMSNorm, then RoPE or SSMax."""
    D2: tl.constexpr = D // 2
    dtype = q_ptr.dtype.element_ty
    qw1 = tl.load(qw_ptr + d, mask=d < D2, other=0.0).to(tl.float32)
    qw2 = tl.load(qw_ptr + D2 + d, mask=d < D2, other=0.0).to(tl.float32)
    hq = part * QH + tl.arange(0, QH)[:, None]
    mq = (hq < HQ) & (d < D2)
    q1 = summed_partials(row + hq * D + d, mq, stride_s, PARTIALS, dtype)
    q2 = summed_partials(row + hq * D + D2 + d, mq, stride_s, PARTIALS, dtype)
    q1, q2 = _rms_halves(q1, q2, qw1, qw2, eps, D, dtype)
    out_q = q_ptr + t * HQ * D + hq * D + d
    tl.store(out_q, cast_rne(q1 * cos - q2 * sin, dtype), mask=mq)
    tl.store(out_q + D2, cast_rne(q2 * cos + q1 * sin, dtype), mask=mq)


@triton.jit
def _prep_kv(row, k_ptr, v_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, t, d, cos, sin,
             block_size, stride_blk, stride_row, stride_head, eps, stride_s,
             IS_FULL: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
             BLOCK_HKV: tl.constexpr, BLOCK_D2: tl.constexpr, PARTIALS: tl.constexpr):
    """Token t's KV heads: k normed (and RoPE'd on sliding layers), v copied, both stored into
    the cache slot of the token."""
    D2: tl.constexpr = D // 2
    dtype = k_ptr.dtype.element_ty
    hk = tl.arange(0, BLOCK_HKV)[:, None]
    mk = (hk < HKV) & (d < D2)
    k1 = summed_partials(row + HQ * D + hk * D + d, mk, stride_s, PARTIALS, dtype)
    k2 = summed_partials(row + HQ * D + hk * D + D2 + d, mk, stride_s, PARTIALS, dtype)
    kw1 = tl.load(kw_ptr + d, mask=d < D2, other=0.0).to(tl.float32)
    kw2 = tl.load(kw_ptr + D2 + d, mask=d < D2, other=0.0).to(tl.float32)
    k1, k2 = _rms_halves(k1, k2, kw1, kw2, eps, D, dtype)
    if not IS_FULL:  # NoPE layers leave k as normed
        k1, k2 = k1 * cos - k2 * sin, k2 * cos + k1 * sin
        k1 = cast_rne(k1, dtype).to(tl.float32)
        k2 = cast_rne(k2, dtype).to(tl.float32)
    out_k = k_ptr + t * HKV * D + hk * D + d
    tl.store(out_k, k1.to(dtype), mask=mk)  # k1, k2 already hold dtype values
    tl.store(out_k + D2, k2.to(dtype), mask=mk)
    dv = tl.arange(0, 2 * BLOCK_D2)[None, :]  # v: copied through
    mv = (hk < HKV) & (dv < D)
    v = summed_partials(row + HQ * D + HKV * D + hk * D + dv, mv, stride_s, PARTIALS, dtype)
    tl.store(v_ptr + t * HKV * D + hk * D + dv, v.to(dtype), mask=mv)
    # cache rows: the rounded k as returned, v as is
    slot = tl.load(slot_ptr + t)
    kscale = tl.load(ks_ptr)
    heads = hk * stride_head
    store_cache_rows(kc_ptr, slot, block_size, stride_blk, stride_row, heads, d, k1, kscale,
                     mk)
    store_cache_rows(kc_ptr, slot, block_size, stride_blk, stride_row, heads, d + D2, k2,
                     kscale, mk)
    store_cache_rows(vc_ptr, slot, block_size, stride_blk, stride_row, heads, dv,
                     v.to(tl.float32), tl.load(vs_ptr), mv)


@triton.jit
def _gate_from_x(x_ptr, wg_ptr, g_ptr, tile, T, H, stride_x, HQ: tl.constexpr,
                 GATE_T: tl.constexpr, GATE_G: tl.constexpr, GATE_K: tl.constexpr,
                 GATE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, GATE_PRELOAD: tl.constexpr,
                 PDL: tl.constexpr):
    """gate = sigmoid(g) for GATE_T tokens x GATE_G heads, g = x · g_weight^T summed in FP32
    and rounded to x's dtype (the reference's BF16 g_proj output), sigmoid in FP32. Where H
    is one GATE_K step (batch-1 decode: GATE_PRELOAD), the weight rows are read before the
    wait."""
    n_heads = (HQ + GATE_G - 1) // GATE_G
    t = (tile // n_heads) * GATE_T + tl.arange(0, GATE_T)
    e = (tile % n_heads) * GATE_G + tl.arange(0, GATE_G)
    g = rows_times_weights_after_wait(x_ptr, stride_x, wg_ptr, H, t, e, 0, H, T, HQ, GATE_T,
                                      GATE_G, GATE_K, GATE_DOT, DOT_PREC, GATE_PRELOAD, PDL)
    g = cast_rne(g, x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(g_ptr + t[:, None].to(tl.int64) * HQ + e[None, :], 1.0 / (1.0 + tl.exp(-g)),
             mask=(t[:, None] < T) & (e[None, :] < HQ))


@triton.jit
def _qk_prep_kernel(qkvg_ptr, pos_ptr, inv_freq_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr,
                    ks_ptr, vs_ptr, x_ptr, wg_ptr, q_ptr, k_ptr, v_ptr, g_ptr, T, H, stride_t,
                    stride_s, stride_x, block_size, stride_blk, stride_row, stride_head, eps,
                    two_pi_hi, two_pi_lo, inv_two_pi_hi, inv_two_pi_lo, inv_base_hi, inv_base_lo,
                    exp_hi, exp_lo, PARTIALS: tl.constexpr, IS_FULL: tl.constexpr,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                    QH: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                    BLOCK_D2: tl.constexpr, GATE_X: tl.constexpr, GATE_T: tl.constexpr,
                    GATE_G: tl.constexpr, GATE_K: tl.constexpr, GATE_DOT: tl.constexpr,
                    GATE_PRELOAD: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    # Programs [0, T * PARTS): token pid // PARTS, part pid % PARTS (a block of QH query heads,
    # or the last part: k, v, the cache rows and a packed gate). GATE_X: the programs after
    # those compute the gate from x tile by tile (tokens x heads).
    PARTS: tl.constexpr = (HQ + QH - 1) // QH + 1
    # PDL (the decode chain, _pdl.py): launched during the q/k/v GEMM, it lets the attention
    # launch (PDL 2, the default: once its wait has returned, so that the attention's split
    # does not sit on the SMs beside the GEMM) and waits for the GEMM's output; the angles
    # (from the step's positions, host copies) and the gate's weight rows before that.
    let_next_launch(PDL)
    pid = tl.program_id(0)
    if pid < T * PARTS:
        t = (pid // PARTS).to(tl.int64)
        part = pid % PARTS
        row = qkvg_ptr + t * stride_t
        d = tl.arange(0, BLOCK_D2)[None, :]
        # (each branch computes the angles itself: cos/sin live across the branch made ptxas
        # spill around libdevice's slow path of sinf/cosf)
        if part < PARTS - 1:
            cos, sin = rotation(pos_ptr, inv_freq_ptr, t, d, IS_FULL, D, two_pi_hi, two_pi_lo,
                                 inv_two_pi_hi, inv_two_pi_lo, inv_base_hi, inv_base_lo,
                                 exp_hi, exp_lo)
            wait_for_inputs(PDL)
            _prep_q(row, q_ptr, qw_ptr, t, part, d, cos, sin, eps, stride_s, HQ, D, QH,
                    PARTIALS)
        else:
            cos, sin = rotation(pos_ptr, inv_freq_ptr, t, d, IS_FULL, D, two_pi_hi, two_pi_lo,
                                 inv_two_pi_hi, inv_two_pi_lo, inv_base_hi, inv_base_lo,
                                 exp_hi, exp_lo)
            wait_for_inputs(PDL)
            _prep_kv(row, k_ptr, v_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, t, d,
                     cos, sin, block_size, stride_blk, stride_row, stride_head, eps, stride_s,
                     IS_FULL, HQ, HKV, D, BLOCK_HKV, BLOCK_D2, PARTIALS)
            if not GATE_X:  # packed gate logits: FP32 sigmoid
                hg = tl.arange(0, BLOCK_HQ)
                g = summed_partials(row + HQ * D + 2 * HKV * D + hg, hg < HQ, stride_s, PARTIALS,
                                q_ptr.dtype.element_ty)
                tl.store(g_ptr + t * HQ + hg, 1.0 / (1.0 + tl.exp(-g)), mask=hg < HQ)
    elif GATE_X:
        _gate_from_x(x_ptr, wg_ptr, g_ptr, pid - T * PARTS, T, H, stride_x, HQ, GATE_T, GATE_G,
                     GATE_K, GATE_DOT, DOT_PREC, GATE_PRELOAD, PDL)


# The gate GEMM x [T, H] · g_weight^T [H, Hq] (Hq = 48 for Beam). Up to `fma_tokens` tokens:
# FP32 FMAs, one head a program over all of H in one load (up to `fma_elems` elements of x a
# program), so a batch-1 step reads the 0.5 MB weight over Hq programs with no serial K loop
# (two heads and five 1024-wide steps made qk_prep 5.8 us on the H200, 2026-11-29; the gate
# programs now add nothing measurable to a batch-1 qk_prep, bench/decode_chain_probe.py). More:
# tensor-core tiles of up to `tile_tokens` tokens, 16 heads wide up to `narrow_tokens` tokens
# (more programs), the whole (padded) head dim beyond (the weight is then read once per token
# tile). Not tuned on a GPU yet.
GATE_CONFIG = dict(fma_tokens=4, fma_elems=8192, narrow_tokens=256, tile_tokens=64)


def gate_launch_params(t: int, hq: int, h: int) -> dict:
    c = GATE_CONFIG
    if t <= c["fma_tokens"]:
        gate_k = max(256, min(next_pow2(h), c["fma_elems"] // next_pow2(t)))
        return dict(GATE_T=next_pow2(t), GATE_G=1, GATE_K=gate_k, GATE_DOT=False,
                    GATE_PRELOAD=h <= gate_k)
    gate_g = 16 if t <= c["narrow_tokens"] else max(16, min(64, next_pow2(hq)))
    return dict(GATE_T=min(c["tile_tokens"], max(16, next_pow2(t))), GATE_G=gate_g, GATE_K=64,
                GATE_DOT=True, GATE_PRELOAD=h <= 64)


@register(OP, "triton")
def _launch_qk_prep(qkvg, positions, q_norm_weight, k_norm_weight, k_cache, v_cache, slot_mapping,
                    k_scale, v_scale, is_full: bool, eps: float, rope_theta: float,
                    ssmax_base: float, ssmax_exponent: float, x=None, g_weight=None,
                    out_dtype=None):
    partials = qkvg.shape[0] if qkvg.dim() == 3 else 0
    rows = qkvg[0] if partials else qkvg  # [T, width]: the first partial, or the projection
    t, (hkv, d) = rows.shape[0], k_cache.shape[2:]
    hq, _ = split_qkvg(qkvg, hkv, d, packed_gate=g_weight is None)
    dtype = out_dtype if partials else qkvg.dtype
    q = rows.new_empty(t, hq, d, dtype=dtype)
    k, v = rows.new_empty(t, hkv, d, dtype=dtype), rows.new_empty(t, hkv, d, dtype=dtype)
    gate = qkvg.new_empty(t, hq, dtype=torch.float32)
    if t == 0:
        return q, k, v, gate
    qh = min(16, next_pow2(hq))
    grid = t * (triton.cdiv(hq, qh) + 1)
    gate_x = g_weight is not None
    if gate_x:
        gp = gate_launch_params(t, hq, x.shape[1])
        grid += triton.cdiv(t, gp["GATE_T"]) * triton.cdiv(hq, gp["GATE_G"])
    else:  # no gate programs; x and g_weight are never read
        gp = dict(GATE_T=1, GATE_G=1, GATE_K=1, GATE_DOT=False, GATE_PRELOAD=False)
        x = g_weight = rows
    inv_freq = positions if is_full else rope_inv_freq(rope_theta, d, qkvg.device)  # (unread)
    pdl = chain_mode(qkvg.device, "qk_prep")
    _qk_prep_kernel[(grid,)](
        qkvg, positions, inv_freq, q_norm_weight, k_norm_weight, k_cache, v_cache, slot_mapping,
        k_scale, v_scale, x, g_weight, q, k, v, gate, t, x.shape[1], rows.stride(0),
        qkvg.stride(0) if partials else 0, x.stride(0), k_cache.shape[1], k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), eps, *rotation_constants(ssmax_base, ssmax_exponent),
        PARTIALS=partials, IS_FULL=is_full, HQ=hq, HKV=hkv, D=d, QH=qh, BLOCK_HQ=next_pow2(hq),
        BLOCK_HKV=next_pow2(hkv), BLOCK_D2=next_pow2(d // 2), GATE_X=gate_x,
        DOT_PREC=dot_precision(dtype), PDL=pdl, num_warps=4, **gp,
        **launch_early(qkvg.device, "qk_prep"))
    return q, k, v, gate


def _check(qkvg, positions, q_norm_weight, k_norm_weight, k_cache, v_cache, slot_mapping,
           k_scale, v_scale, x=None, g_weight=None, out_dtype=None) -> tuple[int, torch.dtype]:
    """-> (Hq, the outputs' dtype)."""
    if qkvg.dim() == 3:  # a split GEMM's FP32 partial sums
        check_tensor(OP, "qkvg partials", qkvg, dtypes=(torch.float32,))
        check(out_dtype in FLOAT_DTYPES, OP,
              f"qkvg as partials {tuple(qkvg.shape)} needs out_dtype (one of bf16, fp16, fp32), "
              f"got {out_dtype}")
        dtype = out_dtype
    else:
        check_tensor(OP, "qkvg", qkvg, ndim=2, dtypes=FLOAT_DTYPES)
        check(out_dtype in (None, qkvg.dtype), OP,
              f"out_dtype {out_dtype} differs from qkvg's {qkvg.dtype} (only partials convert)")
        dtype = qkvg.dtype
    check(qkvg.stride(-1) == 1, OP, "qkvg rows must be contiguous")
    dev, t = qkvg.device, qkvg.shape[-2]
    check_tensor(OP, "positions", positions, ndim=1, dtypes=(torch.int32, torch.int64), device=dev)
    check(positions.shape[0] == t, OP, f"positions has {positions.shape[0]} entries for {t} tokens")
    check_tensor(OP, "k_cache", k_cache, ndim=4)
    hkv, d = k_cache.shape[2:]
    check(d % 2 == 0, OP, f"head_dim {d} must be even (rotate-half RoPE)")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        check_tensor(OP, name, w, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
        check(w.shape[0] == d and w.stride(0) == 1, OP, f"{name} must be contiguous [{d}]")
    check((x is None) == (g_weight is None), OP, "x and g_weight come together (gate from x)")
    hq, _ = split_qkvg(qkvg, hkv, d, packed_gate=g_weight is None)
    if g_weight is not None:
        check_tensor(OP, "x", x, ndim=2, dtypes=(dtype,), device=dev)
        check(x.shape[0] == t and x.stride(1) == 1, OP,
              f"x must be [{t}, H] with contiguous rows, got {tuple(x.shape)}")
        check_tensor(OP, "g_weight", g_weight, ndim=2, dtypes=(dtype,), device=dev)
        check(tuple(g_weight.shape) == (hq, x.shape[1]) and g_weight.is_contiguous(), OP,
              f"g_weight must be contiguous [Hq={hq}, H={x.shape[1]}], got "
              f"{tuple(g_weight.shape)}")
    check_cache_pair(OP, k_cache, v_cache, k_scale, v_scale, dev)
    check_slots(OP, slot_mapping, t, dev)
    return hq, dtype


@torch.library.custom_op("beam::qk_prep", mutates_args=("k_cache", "v_cache"))
def qk_prep(qkvg: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor,
            k_norm_weight: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
            is_full: bool, eps: float, rope_theta: float, ssmax_base: float,
            ssmax_exponent: float, x: Optional[torch.Tensor] = None,
            g_weight: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(qkvg, positions, q_norm_weight, k_norm_weight, k_cache, v_cache, slot_mapping,
           k_scale, v_scale, x, g_weight, out_dtype)
    return dispatch(OP, qkvg.device, qkvg, positions, q_norm_weight, k_norm_weight, k_cache,
                    v_cache, slot_mapping, k_scale, v_scale, is_full, eps, rope_theta,
                    ssmax_base, ssmax_exponent, x, g_weight, out_dtype)


@qk_prep.register_fake
def _(qkvg, positions, q_norm_weight, k_norm_weight, k_cache, v_cache, slot_mapping, k_scale,
      v_scale, is_full, eps, rope_theta, ssmax_base, ssmax_exponent, x=None, g_weight=None,
      out_dtype=None):
    hq, dtype = _check(qkvg, positions, q_norm_weight, k_norm_weight, k_cache, v_cache,
                       slot_mapping, k_scale, v_scale, x, g_weight, out_dtype)
    t, (hkv, d) = qkvg.shape[-2], k_cache.shape[2:]
    return (qkvg.new_empty(t, hq, d, dtype=dtype), qkvg.new_empty(t, hkv, d, dtype=dtype),
            qkvg.new_empty(t, hkv, d, dtype=dtype), qkvg.new_empty(t, hq, dtype=torch.float32))
