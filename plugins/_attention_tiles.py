"""Triton pieces shared by the decode and prefill attention kernels: where a cached key lives,
how an FP8 cache's codes become MMA operands, and one step of the online softmax. Scores are
kept in the log2 domain (exp2), scaled by log2(e) / sqrt(D) (and k_scale for FP8 caches) once
per tile."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import INTERPRETED, cast_rne, div_rn_by, to_e4m3
from ._decode_config import FP8_FORMS, FP8_SETTINGS
from ._fp8_act import fp8_codes

LOG2E = 1.4426950408889634


@triton.jit
def cache_tile_offsets(index_row_ptr, j, valid, M, block_size, stride_blk, stride_row,
                       BLOCK_SIZE: tl.constexpr = 0):
    """Element offsets of cache positions j [BLOCK_N] of one sequence: block
    cache_index[b, (j // bs) % M], row j % bs (paged table or ring row, DESIGN.md §3).
    BLOCK_SIZE: bs when it is a power of two (`pow2_block_size`), else 0: the divisions by
    bs become shifts and masks (positions are >= 0), where a runtime divisor costs a dozen
    instructions a position (sm_90 SASS of the BF16 cache's decode loop at batch 1: 989 ->
    748 a 128-key tile)."""
    if BLOCK_SIZE > 0:
        ju = j.to(tl.uint32)
        blk = tl.load(index_row_ptr + (ju // BLOCK_SIZE).to(tl.int32) % M, mask=valid, other=0)
        row = (ju % BLOCK_SIZE).to(tl.int64)
    else:
        blk = tl.load(index_row_ptr + (j // block_size) % M, mask=valid, other=0)
        row = (j % block_size).to(tl.int64)
    return blk.to(tl.int64) * stride_blk + row * stride_row


def pow2_block_size(block_size: int) -> int:
    """cache_tile_offsets' BLOCK_SIZE for a cache of this block size."""
    return block_size if block_size & (block_size - 1) == 0 else 0


# How an FP8 cache's codes become tensor-core operands, K's and V's each (the launchers'
# "fp8_operands" setting picks the pair, FP8_FORMS; FP32 models always take CAST):
# CAST: Triton's cast to the model's dtype. To BF16 on sm_90 that is e4m3x2 -> f16x2, then
#   each f16 -> bf16 on its own (F2F) and a repack, with V's codes read from shared memory a
#   byte at a time for the MMA's key-pair registers: the 128K batch-1 decode ran at 35% of
#   copy (H200, 2026-12-01), 2009 SASS instructions a 128-key tile against BF16's 989.
# CVT: FP16 by the native cvt.rn.f16x2.e4m3x2 (one a code pair).
# BITS: FP16 by integer ops (`fp16_from_e4m3`): the code's value times 2^-8; the kernels put
#   the 2^8 into the K scale (scores) and the V scale (the output).
# Either FP16 form takes q and P as FP16 too. V's codes are converted where they are loaded,
# 16 to a thread in a row (by an asm marked impure, which Triton does not move into the MMA's
# operand layout), then the FP16 tile goes through shared memory into the MMA (ldmatrix.trans);
# K's are converted in the operand layout itself (whole code pairs in a register). (An earlier
# shift form measured 14% slower than the cast on the H200 at 128K, 2026-11-29: as plain
# Triton ops the shifts are moved into the operand layout, V's too, and run an element at a
# time, 2834 sm_90 instructions a tile.)
# FP16 vs BF16 operands: q (BF16) is exact in FP16 for 2^-14 <= |q| <= 65504 (clamped to
# +-65504; below 2^-14 an element moves by at most 2^-25). P is exp2(s - max + 15), in
# (0, 2^15], with the running sum and output in the same units (they cancel in o = acc / l):
# rounded to FP16 it keeps 11 bits (BF16: 8) for every p >= 2^-29, and a smaller p moves by
# at most 2^-40. So the FP16 forms round P more finely than CAST does; their results differ
# from CAST's by BF16's rounding of P (2^-9 relative a term), within the kernel tests'
# "attention" tolerance. K and V products themselves are exact in every form.
FP8_CAST, FP8_CVT, FP8_BITS = tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
P_LOG2_FP16 = tl.constexpr(15.0)  # P in (0, 2^15]: clear of FP16's subnormals, below 65504
FP16_MAX = tl.constexpr(65504.0)
# 4 codes (one register, code i in byte i) -> the FP16s of codes 0, 1 in $0 (code 0 in the
# low half) and of codes 2, 3 in $1.
_E4M3X4_CVT = tl.constexpr("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\n"
                           "cvt.rn.f16x2.e4m3x2 $0, lo;\ncvt.rn.f16x2.e4m3x2 $1, hi;\n}")
# fp16_from_e4m3 a code pair at a time: PRMT sign-extends codes 0, 1 (2, 3) into the two half
# words, the shift by 7 puts the sign in bit 15 and exponent and mantissa in bits 13..7, and
# the mask clears bit 14 (another copy of the sign) and the low half word's sign bits that the
# shift carried into the high one's bits 6..0.
_E4M3X4_BITS = tl.constexpr("{\n.reg .b32 t0, t1;\n"
                            "prmt.b32 t0, $2, 0, 0x9180;\nprmt.b32 t1, $2, 0, 0xB3A2;\n"
                            "shl.b32 t0, t0, 7;\nshl.b32 t1, t1, 7;\n"
                            "and.b32 $0, t0, 0xBF80BF80;\nand.b32 $1, t1, 0xBF80BF80;\n}")


def fp8_forms(setting: int, act_dtype, kv_dtype) -> tuple[int, int]:
    """(K's, V's) operand form of a launch: FP8_FORMS[setting] for an FP8 cache under a 16-bit
    model, else CAST (16-bit caches have nothing to convert; FP32 models keep FP32 operands)."""
    import torch

    if setting not in FP8_FORMS:
        raise ValueError(f"fp8_operands must be one of {FP8_SETTINGS}, got {setting!r}")
    if kv_dtype != torch.float8_e4m3fn or act_dtype == torch.float32:
        return FP8_CAST.value, FP8_CAST.value
    return FP8_FORMS[setting]


@triton.jit
def fp16_from_e4m3(x):
    """float8_e4m3fn codes -> FP16 holding the code's value times 2^-8, exactly: the sign to
    bit 15, the 4 exponent and 3 mantissa bits up by 7 (FP16's exponent bias 15 is E4M3's 7
    plus 8; E4M3's subnormals land on FP16's). A NaN code (0x7F / 0xFF, which the cache's
    saturating store rule never writes) reads as +-480 * 2^-8."""
    b = x.to(tl.uint8, bitcast=True).to(tl.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def as_operands(x, dtype: tl.constexpr, FORM: tl.constexpr, PIN: tl.constexpr = False):
    """Cache entries x (codes for an FP8 cache) as tensor-core operands of form FORM (above).
    PIN: convert in x's own layout (V's tiles), not in the MMA's operand layout. (Compiled
    only: Triton's interpreter runs no inline assembly; there the same values by Triton ops.)"""
    if FORM == FP8_CAST:
        y = x.to(dtype)
    elif INTERPRETED:
        if FORM == FP8_BITS:
            y = fp16_from_e4m3(x)
        else:
            y = x.to(tl.float16)
    elif FORM == FP8_CVT and not PIN:
        y = x.to(tl.float16)  # (Triton's own conversion: the same cvt)
    else:
        y = tl.inline_asm_elementwise(_E4M3X4_BITS if FORM == FP8_BITS else _E4M3X4_CVT,
                                      "=r,=r,r", [x.to(tl.uint8, bitcast=True)],
                                      dtype=tl.float16, is_pure=not PIN, pack=4)
    return y


@triton.jit
def query_operands(q, FORM: tl.constexpr):
    """The query tile as the other operand of the cached keys' products (K's FORM): FP16 for
    the FP16 forms (clamped to FP16's range), as it is for CAST."""
    if FORM != FP8_CAST:  # (NaN stays NaN, as the cast keeps it)
        q = tl.maximum(q.to(tl.float32), -FP16_MAX, propagate_nan=tl.PropagateNan.ALL)
        q = tl.minimum(q, FP16_MAX, propagate_nan=tl.PropagateNan.ALL).to(tl.float16)
    return q


@triton.jit
def fp8_scale(scale_ptr, FORM: tl.constexpr):
    """The factor an FP8 cache's operands of form FORM take back (entry = operand * it)."""
    scale = tl.load(scale_ptr)
    if FORM == FP8_BITS:
        scale = scale * 256.0
    return scale


@triton.jit
def load_cached_tile(cache_ptr, offs, head_off, d, valid, D: tl.constexpr, dtype: tl.constexpr,
                     FORM: tl.constexpr = FP8_CAST, PIN: tl.constexpr = False):
    """[BLOCK_N, BLOCK_D] cache rows as tensor-core operands of form FORM (FP8 -> any of them
    is exact; PIN: see as_operands)."""
    mask = valid[:, None] & (d[None, :] < D)
    x = tl.load(cache_ptr + offs[:, None] + head_off + d[None, :], mask=mask, other=0.0)
    return as_operands(x, dtype, FORM, PIN)


@triton.jit
def as_cached_fp8(x, scale_ptr, dtype: tl.constexpr, FORM: tl.constexpr = FP8_CAST):
    """Rows of this step's own K or V as an FP8 cache stores them: the FP8 codes of
    clamp(x / scale, ±448) (beam::cache_write's rule), as tensor-core operands of form FORM
    (by Triton ops: the same values as the tiles' assembly), which the caller scales like a
    cached tile's."""
    codes = to_e4m3(div_rn_by(x.to(tl.float32), tl.load(scale_ptr)))
    if FORM == FP8_BITS:  # fp16_from_e4m3's value (exact: a power of two of an FP16)
        rows = codes.to(tl.float16) * 0.00390625
    elif FORM == FP8_CVT:
        rows = codes.to(tl.float16)
    else:
        rows = codes.to(dtype)
    return rows


@triton.jit
def softmax_step(scores, m_i, l_i, acc, v, DOT_PREC: tl.constexpr,
                 V_FORM: tl.constexpr = FP8_CAST):
    """Fold one tile of log2-domain scores [M, N] (masked entries -inf) and values [N, D] into
    the running max m_i, sum l_i and unnormalised output acc; P·V takes P in v's dtype. With
    V in an FP16 form P, l_i and acc are 2^15 times the plain ones (`P_LOG2_FP16`)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    if V_FORM != FP8_CAST:
        m_safe = m_safe - P_LOG2_FP16
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


def dot_precision(dtype) -> str:
    """FP32 models get IEEE FP32 dots (the reference's precision); 16-bit inputs ignore it."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def store_output(out_ptr, offs, o, mask, out_scale_ptr, ACT: tl.constexpr,
                 OUT_FP8: tl.constexpr):
    """The attention output o (FP32) rounded to the activation dtype ACT, as the reference
    does; with OUT_FP8 stored instead as the FP8 codes of that rounded value with the static
    scale at out_scale_ptr (the o_proj's input_scale: its W8A8 GEMM reads them directly)."""
    o = cast_rne(o, ACT)
    if OUT_FP8:
        o = fp8_codes(o.to(tl.float32), tl.load(out_scale_ptr))
    tl.store(out_ptr + offs, o, mask=mask)
