"""beam::qk_prep — everything between the packed q/k/v/gate projection and the attention.

From one row of the packed projection `qkvg[t] = [q (Hq·D) | k (Hkv·D) | v (Hkv·D) | g (Hq·D)]`
(vLLM's qkv_gate_proj: the four projections read the same x) of the token at position p:

    q_h = RMSNorm(q_h; q_norm_w),  k_h = RMSNorm(k_h; k_norm_w)       per head, rounded to dtype
    full layer (NoPE):   q_h = rnd(q_h * s(p)),  s(p) = exp(0.1 * log1p((p + 1) / 2048))  FP32
    sliding layer:       q_h, k_h = RoPE(q_h, p), RoPE(k_h, p)        rotate-half, FP32 angles
    gate_h = rnd(sigmoid(rnd(g_h + gate_bias[h])))                    per element, [Hq, D]
    k_cache / v_cache row at slot_mapping[t] = store(k), store(v)     (as beam::cache_write)

The roundings are transformers' BeamAttention's (shared/BEAM_SPEC.md "Attention"); the
attention multiplies its output by `gate` (beam::attention).

Shapes / dtypes: qkvg [T, 2·Hq·D + 2·Hkv·D] (fp32, bf16, fp16), or a split GEMM's FP32 partial
sums [S, T, width] (beam::linear_fp8's split_k output) with out_dtype: the projection is their
sum in order rounded to out_dtype, as the unsplit GEMM's output would be; positions [T]
int32/int64; q_norm_weight, k_norm_weight [D]; gate_bias [Hq] (any float dtype, used in the
output dtype, as the model holds it); k_cache, v_cache [N, bs, Hkv, D] (see cache_write);
slot_mapping [T] int64 (-1 = do not write); k_scale, v_scale fp32 [] (FP8 caches only)
-> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], gate [T, Hq, D], all in qkvg's dtype
(out_dtype for partials). Hkv and D come from the cache and the norm weight; Hq from the width.
Contract: returns four new tensors and mutates k_cache / v_cache (only the slots >= 0).
One launch: per token, one program per QH query heads (their q and gate) and one for k, v and
the cache rows. RoPE angles and the SSMax scale in FP32 as transformers computes them
(`_rope.py`). CUDA-graph safe.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, cast_rne, check, check_cache_pair, check_tensor, next_pow2,
                      sum_partials, summed_partials)
from ._pdl import chain_mode, launch_early, let_next_launch, wait_for_inputs
from ._reference import apply_rope, output_gate, rms_norm, ssmax_scale
from ._rope import rope_inv_freq, rotation
from .cache_write import check_slots, ref_cache_write, store_cache_rows
from .registry import beam_op, dispatch, register

OP = "qk_prep"


def split_qkvg(qkvg: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """Hq of a packed projection; raises if the width is not 2·Hq·D + 2·Hkv·D."""
    width = qkvg.shape[-1]
    rest = width - 2 * num_kv_heads * head_dim
    hq = rest // (2 * head_dim)
    check(rest > 0 and rest % (2 * head_dim) == 0 and hq % num_kv_heads == 0, OP,
          f"qkvg width {width} is not 2*Hq*D + 2*Hkv*D (q, k, v, gate) for D={head_dim}, "
          f"Hkv={num_kv_heads} and Hq a multiple of Hkv")
    return hq


@register(OP, "reference")
def ref_qk_prep(qkvg, positions, q_norm_weight, k_norm_weight, gate_bias, k_cache, v_cache,
                slot_mapping, k_scale, v_scale, is_full: bool, eps: float, rope_theta: float,
                out_dtype=None):
    qkvg = sum_partials(qkvg, out_dtype)  # a split GEMM's partials: their rounded sum
    t, (hkv, d) = qkvg.shape[0], k_cache.shape[2:]
    hq = split_qkvg(qkvg, hkv, d)
    q, k, v, g = qkvg.split([hq * d, hkv * d, hkv * d, hq * d], dim=1)
    q = rms_norm(q.reshape(t, hq, d), q_norm_weight, eps)
    k = rms_norm(k.reshape(t, hkv, d), k_norm_weight, eps)
    v = v.reshape(t, hkv, d).clone(memory_format=torch.contiguous_format)
    gate = output_gate(g.reshape(t, hq, d), gate_bias)
    if is_full:  # NoPE + SSMax on the queries only
        q = (q.float() * ssmax_scale(positions)[:, None, None]).to(q.dtype)
    else:
        q = apply_rope(q, positions, rope_theta)
        k = apply_rope(k, positions, rope_theta)
    ref_cache_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k, v, gate


@triton.jit
def _rms_halves(x1, x2, w1, w2, eps, D: tl.constexpr, dtype: tl.constexpr):
    """Per-row RMSNorm of a head held as its two halves [rows, D/2]; rounded to dtype."""
    ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D
    inv = (1.0 / tl.sqrt_rn(ms + eps))[:, None]
    y1 = cast_rne(w1 * (x1 * inv), dtype).to(tl.float32)
    return y1, cast_rne(w2 * (x2 * inv), dtype).to(tl.float32)


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
def _prep_gate(row, g_ptr, gb_ptr, t, part, stride_s, HQ: tl.constexpr, HKV: tl.constexpr,
               D: tl.constexpr, QH: tl.constexpr, BLOCK_D: tl.constexpr, PARTIALS: tl.constexpr):
    """The output gate of query heads [part * QH, part * QH + QH) of token t, per element:
    rnd(sigmoid(rnd(g + gate_bias[h])))."""
    dtype = g_ptr.dtype.element_ty
    hq = part * QH + tl.arange(0, QH)[:, None]
    dg = tl.arange(0, BLOCK_D)[None, :]
    mg = (hq < HQ) & (dg < D)
    g = summed_partials(row + (HQ + 2 * HKV) * D + hq * D + dg, mg, stride_s, PARTIALS, dtype)
    bias = cast_rne(tl.load(gb_ptr + hq, mask=hq < HQ, other=0.0).to(tl.float32), dtype)
    g = cast_rne(g + bias.to(tl.float32), dtype).to(tl.float32)
    tl.store(g_ptr + t * HQ * D + hq * D + dg, cast_rne(1.0 / (1.0 + tl.exp(-g)), dtype), mask=mg)


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
def _qk_prep_kernel(qkvg_ptr, pos_ptr, inv_freq_ptr, qw_ptr, kw_ptr, gb_ptr, kc_ptr, vc_ptr,
                    slot_ptr, ks_ptr, vs_ptr, q_ptr, k_ptr, v_ptr, g_ptr, stride_t, stride_s,
                    block_size, stride_blk, stride_row, stride_head, eps,
                    PARTIALS: tl.constexpr, IS_FULL: tl.constexpr, HQ: tl.constexpr,
                    HKV: tl.constexpr, D: tl.constexpr, QH: tl.constexpr,
                    BLOCK_HKV: tl.constexpr, BLOCK_D2: tl.constexpr, PDL: tl.constexpr):
    # Programs: token pid // PARTS, part pid % PARTS (a block of QH query heads and their
    # gates, or the last part: k, v and the cache rows).
    PARTS: tl.constexpr = (HQ + QH - 1) // QH + 1
    # PDL (the decode chain, _pdl.py): launched during the q/k/v/gate GEMM, it lets the
    # attention launch (PDL 2, the default: once its wait has returned, so that the attention's
    # split does not sit on the SMs beside the GEMM) and waits for the GEMM's output; the
    # angles (from the step's positions, host copies) before that.
    let_next_launch(PDL)
    pid = tl.program_id(0)
    t = (pid // PARTS).to(tl.int64)
    part = pid % PARTS
    row = qkvg_ptr + t * stride_t
    d = tl.arange(0, BLOCK_D2)[None, :]
    # (each branch computes the angles itself: cos/sin live across the branch made ptxas
    # spill around libdevice's slow path of sinf/cosf)
    if part < PARTS - 1:
        cos, sin = rotation(pos_ptr, inv_freq_ptr, t, d, IS_FULL, D)
        wait_for_inputs(PDL)
        _prep_q(row, q_ptr, qw_ptr, t, part, d, cos, sin, eps, stride_s, HQ, D, QH, PARTIALS)
        _prep_gate(row, g_ptr, gb_ptr, t, part, stride_s, HQ, HKV, D, QH, 2 * BLOCK_D2,
                   PARTIALS)
    else:
        cos, sin = rotation(pos_ptr, inv_freq_ptr, t, d, IS_FULL, D)
        wait_for_inputs(PDL)
        _prep_kv(row, k_ptr, v_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, t, d,
                 cos, sin, block_size, stride_blk, stride_row, stride_head, eps, stride_s,
                 IS_FULL, HQ, HKV, D, BLOCK_HKV, BLOCK_D2, PARTIALS)


# Query heads a program takes: few tokens (decode) spread a token's heads and their gates over
# more programs, many tokens (prefill) take 16 a program (fewer, fuller programs).
QK_PREP_CONFIG = dict(heads=16, heads_few_tokens=8, few_tokens=64)


def heads_per_program(t: int, hq: int) -> int:
    c = QK_PREP_CONFIG
    return min(c["heads_few_tokens"] if t <= c["few_tokens"] else c["heads"], next_pow2(hq))


@register(OP, "triton")
def _launch_qk_prep(qkvg, positions, q_norm_weight, k_norm_weight, gate_bias, k_cache, v_cache,
                    slot_mapping, k_scale, v_scale, is_full: bool, eps: float, rope_theta: float,
                    out_dtype=None):
    partials = qkvg.shape[0] if qkvg.dim() == 3 else 0
    rows = qkvg[0] if partials else qkvg  # [T, width]: the first partial, or the projection
    t, (hkv, d) = rows.shape[0], k_cache.shape[2:]
    hq = split_qkvg(qkvg, hkv, d)
    dtype = out_dtype if partials else qkvg.dtype
    q = rows.new_empty(t, hq, d, dtype=dtype)
    k, v = rows.new_empty(t, hkv, d, dtype=dtype), rows.new_empty(t, hkv, d, dtype=dtype)
    gate = rows.new_empty(t, hq, d, dtype=dtype)
    if t == 0:
        return q, k, v, gate
    qh = heads_per_program(t, hq)
    inv_freq = positions if is_full else rope_inv_freq(rope_theta, d, qkvg.device)  # (unread)
    pdl = chain_mode(qkvg.device, "qk_prep")
    _qk_prep_kernel[(t * (triton.cdiv(hq, qh) + 1),)](
        qkvg, positions, inv_freq, q_norm_weight, k_norm_weight, gate_bias, k_cache, v_cache,
        slot_mapping, k_scale, v_scale, q, k, v, gate, rows.stride(0),
        qkvg.stride(0) if partials else 0, k_cache.shape[1], k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), eps, PARTIALS=partials, IS_FULL=is_full, HQ=hq,
        HKV=hkv, D=d, QH=qh, BLOCK_HKV=next_pow2(hkv), BLOCK_D2=next_pow2(d // 2), PDL=pdl,
        num_warps=4, **launch_early(qkvg.device, "qk_prep"))
    return q, k, v, gate


def _check(qkvg, positions, q_norm_weight, k_norm_weight, gate_bias, k_cache, v_cache,
           slot_mapping, k_scale, v_scale, out_dtype=None) -> tuple[int, torch.dtype]:
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
    hq = split_qkvg(qkvg, hkv, d)
    check_tensor(OP, "gate_bias", gate_bias, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
    check(gate_bias.shape[0] == hq and gate_bias.stride(0) == 1, OP,
          f"gate_bias must be contiguous [Hq={hq}], got {tuple(gate_bias.shape)}")
    check_cache_pair(OP, k_cache, v_cache, k_scale, v_scale, dev)
    check_slots(OP, slot_mapping, t, dev)
    return hq, dtype


@beam_op("qk_prep", mutates_args=("k_cache", "v_cache"))
def qk_prep(qkvg: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor,
            k_norm_weight: torch.Tensor, gate_bias: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor,
            v_scale: torch.Tensor, is_full: bool, eps: float, rope_theta: float,
            out_dtype: Optional[torch.dtype] = None,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (qkvg, positions, q_norm_weight, k_norm_weight, gate_bias, k_cache, v_cache,
            slot_mapping, k_scale, v_scale)
    _check(*args, out_dtype)
    return dispatch(OP, qkvg.device, *args, is_full, eps, rope_theta, out_dtype)


@qk_prep.register_fake
def _(qkvg, positions, q_norm_weight, k_norm_weight, gate_bias, k_cache, v_cache, slot_mapping,
      k_scale, v_scale, is_full, eps, rope_theta, out_dtype=None):
    hq, dtype = _check(qkvg, positions, q_norm_weight, k_norm_weight, gate_bias, k_cache,
                       v_cache, slot_mapping, k_scale, v_scale, out_dtype)
    t, (hkv, d) = qkvg.shape[-2], k_cache.shape[2:]
    return (qkvg.new_empty(t, hq, d, dtype=dtype), qkvg.new_empty(t, hkv, d, dtype=dtype),
            qkvg.new_empty(t, hkv, d, dtype=dtype), qkvg.new_empty(t, hq, d, dtype=dtype))
