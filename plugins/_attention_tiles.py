"""Triton pieces shared by the decode and prefill attention kernels: where a cached key lives,
and one step of the online softmax. Scores are kept in the log2 domain (exp2), scaled by
log2(e) / sqrt(D) (and k_scale for FP8 caches) once per tile."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import cast_rne, div_rn_by, to_e4m3
from ._fp8_act import fp8_codes

LOG2E = 1.4426950408889634


@triton.jit
def cache_tile_offsets(index_row_ptr, j, valid, M, block_size, stride_blk, stride_row):
    """Element offsets of cache positions j [BLOCK_N] of one sequence: block
    cache_index[b, (j // bs) % M], row j % bs (paged table or ring row, DESIGN.md §3)."""
    blk = tl.load(index_row_ptr + (j // block_size) % M, mask=valid, other=0)
    return blk.to(tl.int64) * stride_blk + (j % block_size).to(tl.int64) * stride_row


@triton.jit
def load_cached_tile(cache_ptr, offs, head_off, d, valid, D: tl.constexpr, dtype: tl.constexpr):
    """[BLOCK_N, BLOCK_D] cache rows as `dtype` tensor-core operands (FP8 -> BF16 is exact).
    (Shifting the e4m3 bits into FP16 operands instead measured 14% slower on the H200 at
    128K context, so Triton's conversion stays.)"""
    mask = valid[:, None] & (d[None, :] < D)
    x = tl.load(cache_ptr + offs[:, None] + head_off + d[None, :], mask=mask, other=0.0)
    return x.to(dtype)


@triton.jit
def as_cached_fp8(x, scale_ptr, dtype: tl.constexpr):
    """Rows of this step's own K or V as an FP8 cache stores them: the FP8 codes of
    clamp(x / scale, ±448) (beam::cache_write's rule), as `dtype` tensor-core operands, which
    the caller scales like a cached tile's."""
    return to_e4m3(div_rn_by(x.to(tl.float32), tl.load(scale_ptr))).to(dtype)


@triton.jit
def softmax_step(scores, m_i, l_i, acc, v, DOT_PREC: tl.constexpr):
    """Fold one tile of log2-domain scores [M, N] (masked entries -inf) and values [N, D] into
    the running max m_i, sum l_i and unnormalised output acc."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
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
