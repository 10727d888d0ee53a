"""Tile helpers of the Triton GEMMs (the moe_* and linear_* kernels): grouped launch order,
the reference's roundings, the tensor-core products with the weights on either MMA side
(`SWAP`: few tokens), and the K loops of the FP8 W8A8 GEMMs (per-thread copies, or the TMA)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _interp_dot  # noqa: F401  (interpreter BF16 dot fix)
from ._common import bf16_grid

# FP8 MMA partial sums are added into the FP32 accumulator at least every this many products
# (DeepSeek-V3 report 3.3.2 and cuBLAS promote every 128 as well).
PROMOTE_EVERY = tl.constexpr(128)


def dot_precision(dtype: torch.dtype) -> str:
    """FP32 activations get IEEE FP32 dots (the reference is FP32), others the native MMA."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def tile_of(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped launch order: GROUP_M row blocks (one expert's) share each weight tile in L2."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """FP32 x rounded to what `dtype` holds (nearest-even), kept in FP32: the reference rounds
    every module output to the activation dtype."""
    if dtype == tl.bfloat16:
        x = bf16_grid(x)
    elif dtype == tl.float16:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up with Beam's roundings: gate and up (the GEMM outputs) rounded to dtype,
    silu and the product in FP32, rounded once (transformers' `act(gate.float()) * up.float()`)."""
    gate = round_to(gate, dtype)
    up = round_to(up, dtype)
    return round_to(gate / (1.0 + tl.exp(-gate)) * up, dtype)


@triton.jit
def acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def _operands(a, w, SWAP: tl.constexpr):
    """(lhs, rhs) of `mma`'s dot: a @ w^T, or with SWAP w @ a^T."""
    if SWAP:
        lhs, rhs = w, tl.trans(a)
    else:
        lhs, rhs = a, tl.trans(w)
    return lhs, rhs


@triton.jit
def mma(acc, a, w, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ w^T (a [BM, BK] tokens, w [BN, BK] weights; acc [BM, BN]), or with SWAP
    acc + w @ a^T (acc [BN, BM]): the weights fill the MMA's 64-row M side, so a block of a
    few tokens (decode) still runs on full tensor-core tiles fed from shared memory."""
    lhs, rhs = _operands(a, w, SWAP)
    return tl.dot(lhs, rhs, acc, input_precision=PRECISION)


@triton.jit
def mma_fp8(acc, a, w, SWAP: tl.constexpr, BLOCK_K: tl.constexpr):
    """`mma` for FP8 operands; the tensor-core partial sums are promoted to the FP32
    accumulator every min(BLOCK_K, PROMOTE_EVERY) products (Hopper's FP8 MMA accumulates with
    reduced precision, and Triton's default would never promote), so a wider K tile does not
    make the sum less precise."""
    PROMOTE: tl.constexpr = PROMOTE_EVERY if BLOCK_K > PROMOTE_EVERY else BLOCK_K
    lhs, rhs = _operands(a, w, SWAP)
    return tl.dot(lhs, rhs, acc, max_num_imprecise_acc=PROMOTE)


@triton.jit
def _mma_any(acc, a, w, SWAP: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """`mma_fp8` for PRECISION "fp8", else `mma` with that dot precision."""
    if PRECISION == "fp8":
        acc = mma_fp8(acc, a, w, SWAP, BLOCK_K)
    else:
        acc = mma(acc, a, w, SWAP, PRECISION)
    return acc


@triton.jit
def gemm_loop(a_ptrs, a_rows_ok, w_ptrs, n_mask, K, up_offset, GATED: tl.constexpr,
              SWAP: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K loop of the GEMMs whose weights need no decoding (moe_bf16; moe_fp8 and linear_fp8
    with PRECISION "fp8", W8A8 codes): activations [BLOCK_M, BLOCK_K] (rows `a_rows_ok`) times
    weights [BLOCK_N, BLOCK_K] (rows `n_mask`), both contiguous in K; with GATED also the
    weight rows `up_offset` elements further (an expert's up_proj) into a second accumulator.
    Few tokens: SWAP puts the weights on the MMA's M side (see `mma`). -> (acc, acc_up),
    unscaled FP32 sums, [BN, BM] with SWAP else [BM, BN]."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    acc_up = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=a_rows_ok[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc = _mma_any(acc, a, tl.load(w_ptrs, mask=w_mask, other=0.0), SWAP, PRECISION, BLOCK_K)
        if GATED:
            w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
            acc_up = _mma_any(acc_up, a, w_up, SWAP, PRECISION, BLOCK_K)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, acc_up


@triton.jit
def tma_gemm_loop(a_desc, a_row0, w_desc, w_row0, up_rows, K, GATED: tl.constexpr,
                  SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """`gemm_loop` (FP8 W8A8) with both operands loaded by the Hopper TMA from 2-D tensor
    descriptors: activation rows [a_row0, +BLOCK_M) of a_desc (rows already in the tile's
    order), weight rows [w_row0, +BLOCK_N) of w_desc and with GATED also those `up_rows`
    further. No per-thread copies or CTA barriers for the stages (the prefill GEMMs lost 44% of
    their issue slots at those barriers, ncu); past a tensor's last row or column the TMA
    reads zeros, so a K tail needs no mask. -> (acc, acc_up) as `gemm_loop`."""
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    acc_up = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([a_row0, k0])
        acc = mma_fp8(acc, a, w_desc.load([w_row0, k0]), SWAP, BLOCK_K)
        if GATED:
            acc_up = mma_fp8(acc_up, a, w_desc.load([w_row0 + up_rows, k0]), SWAP, BLOCK_K)
    return acc, acc_up


@triton.jit
def fp8_block_gemm_loop(a_ptrs, as_ptrs, a_rows_ok, w_ptrs, ws_ptrs, n_mask, K, up_offset,
                        up_s_offset, GATED: tl.constexpr, SWAP: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K loop of the 128x128 block-scaled FP8 GEMMs (linear_fp8_block, moe_fp8_block):
    BLOCK_K = 128, so each step is one scale group and its FP32 partial product is scaled by
    a_scale[row, g] * w_scale[n, g] (as_ptrs / ws_ptrs point at group 0 of each row / output
    channel and advance one group a step). GATED: also the weight rows `up_offset` elements
    (scales `up_s_offset`) further into a second accumulator. -> (acc, acc_up) as
    `gemm_loop`. The scale vectors are strided (one per row): no asynchronous copies for
    them, so they are loaded one step ahead by hand instead of stalling every step on a load."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    acc_up = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    a_s = tl.load(as_ptrs, mask=a_rows_ok, other=0.0)
    w_s = tl.load(ws_ptrs, mask=n_mask, other=0.0)
    w_su = tl.load(ws_ptrs + up_s_offset, mask=n_mask & GATED, other=0.0)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        more = k0 + BLOCK_K < K
        as_ptrs += 1
        ws_ptrs += 1
        a_s_next = tl.load(as_ptrs, mask=a_rows_ok & more, other=0.0)
        w_s_next = tl.load(ws_ptrs, mask=n_mask & more, other=0.0)
        w_su_next = tl.load(ws_ptrs + up_s_offset, mask=n_mask & more & GATED, other=0.0)
        a = tl.load(a_ptrs, mask=a_rows_ok[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        part = mma_fp8(acc_zeros(BLOCK_M, BLOCK_N, SWAP), a, w, SWAP, BLOCK_K)
        acc += part * outer(a_s, w_s, SWAP)
        if GATED:
            w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
            part_up = mma_fp8(acc_zeros(BLOCK_M, BLOCK_N, SWAP), a, w_up, SWAP, BLOCK_K)
            acc_up += part_up * outer(a_s, w_su, SWAP)
        a_s, w_s, w_su = a_s_next, w_s_next, w_su_next
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, acc_up


@triton.jit
def tma_block_gemm_loop(a_desc, a_row0, as_ptrs, as_step, a_rows_ok, w_desc, w_row0, ws_ptr,
                        up_rows, up_s_offset, K, GATED: tl.constexpr, SWAP: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`fp8_block_gemm_loop` with both operands loaded by the TMA (as `tma_gemm_loop`) and one
    weight scale per step: the tile's BLOCK_N <= 128 weight rows lie in one 128x128 scale
    block (ws_ptr: that block's scale of group 0, the next group's 1 further; the up rows'
    `up_s_offset` further). as_ptrs: the tile rows' activation scales of group 0, contiguous
    (scales stored [groups, rows]), the next group's `as_step` further."""
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    acc_up = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    a_s = tl.load(as_ptrs, mask=a_rows_ok, other=0.0)
    w_s = tl.load(ws_ptr)
    w_su = tl.load(ws_ptr + up_s_offset) if GATED else 0.0
    for k0 in range(0, K, BLOCK_K):
        more = k0 + BLOCK_K < K
        as_ptrs += as_step
        ws_ptr += 1
        a_s_next = tl.load(as_ptrs, mask=a_rows_ok & more, other=0.0)
        w_s_next = tl.load(ws_ptr, mask=more, other=0.0)
        a = a_desc.load([a_row0, k0])
        part = mma_fp8(acc_zeros(BLOCK_M, BLOCK_N, SWAP), a, w_desc.load([w_row0, k0]), SWAP,
                       BLOCK_K)
        acc += part * row_scales(a_s * w_s, SWAP)
        if GATED:
            w_su_next = tl.load(ws_ptr + up_s_offset, mask=more, other=0.0)
            part_up = mma_fp8(acc_zeros(BLOCK_M, BLOCK_N, SWAP), a,
                              w_desc.load([w_row0 + up_rows, k0]), SWAP, BLOCK_K)
            acc_up += part_up * row_scales(a_s * w_su, SWAP)
            w_su = w_su_next
        a_s, w_s = a_s_next, w_s_next
    return acc, acc_up


@triton.jit
def row_scales(scale, SWAP: tl.constexpr):
    """A per-row scale [BM] broadcast over the accumulator's channels."""
    if SWAP:
        out = scale[None, :]
    else:
        out = scale[:, None]
    return out


@triton.jit
def outer(row_scale, col_scale, SWAP: tl.constexpr):
    """row_scale [BM] x col_scale [BN] in the accumulator's orientation."""
    if SWAP:
        out = col_scale[:, None] * row_scale[None, :]
    else:
        out = row_scale[:, None] * col_scale[None, :]
    return out


@triton.jit
def unswap(acc, SWAP: tl.constexpr):
    """The accumulator as [BM, BN] (tokens x channels) for the epilogue."""
    if SWAP:
        acc = tl.trans(acc)
    return acc
