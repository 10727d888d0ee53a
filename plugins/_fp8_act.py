"""FP8 activation quantizers used by the fp8 moe/linear ops before their GEMMs.

- per tensor (static scale s): q = fp8_e4m3(clamp(x / s, +-448))     (W8A8, ModelOpt input_scale;
  `fp8_codes` is the Triton rule, shared with the norms and attention that emit FP8 directly)
- per token per 128 channels (dynamic): s = max(amax, 1e-10) / 448, q = fp8_e4m3(x / s)
- per tensor, or per token per 128 channels, into an MoE's sorted rows: token t's codes go to
  the k rows the token sort gave its slots, so the prefill GEMMs read whole row blocks (by the
  TMA)
All divide with IEEE rounding (plugins._common.div_rn_by) and round with
plugins._common.to_e4m3, so the codes equal those of beam_trtllm.quant_formats on the GPU and
in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from beam_trtllm.quant_formats import FP8_BLOCK

from ._common import div_rn_by, to_e4m3

FP8 = torch.float8_e4m3fn
ACT_EPS = 1e-10  # keeps an all-zero group's scale finite (quant_formats uses the same)


@triton.jit
def fp8_codes(x, scale):
    """FP32 x -> the static per-tensor quantizer's codes fp8(clamp(x / scale, +-448)) (float8
    e4m3fn). Every producer of FP8 activations (this file's kernels, the norms, the attention
    epilogues) quantizes through here."""
    return to_e4m3(div_rn_by(x, scale))


@triton.jit
def load_fp8_scale(s_ptr, QUANT: tl.constexpr):
    """A kernel's static FP8 scale (1.0 unless QUANT), to be loaded before the kernel's first
    store: after a store the load cannot move ahead of it (the pointers may alias), and its
    latency then sits at the end of a batch-1 kernel."""
    if QUANT:
        return tl.load(s_ptr)
    return 1.0


@triton.jit
def _quant_per_tensor_kernel(x_ptr, s_ptr, q_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = fp8_codes(x, tl.load(s_ptr))
    tl.store(q_ptr + offs, q, mask=mask)


@triton.jit
def _quant_sorted_rows_kernel(x_ptr, s_ptr, slot_rows_ptr, q_ptr, T, K, stride_x,
                              TOP_K: tl.constexpr, CODES: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_K: tl.constexpr):
    # Each token's tile is read once and its codes stored into the token's TOP_K sorted rows.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (tokens < T)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask,
                other=0.0)
    if not CODES:  # else x holds the codes already
        x = fp8_codes(x.to(tl.float32), tl.load(s_ptr))
    for j in tl.static_range(TOP_K):
        rows = tl.load(slot_rows_ptr + tokens * TOP_K + j, mask=tokens < T, other=0)
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], x, mask=mask)


def quant_fp8_sorted_rows(x: torch.Tensor, scale: torch.Tensor, slot_rows: torch.Tensor,
                          rows: int) -> torch.Tensor:
    """x [T, K] (floating, or FP8 codes already), slot_rows [T * k] (the sorted row of each
    flat slot t*k+j) -> FP8 codes [rows, K]: row slot_rows[t*k+j] holds x[t] quantized with the
    static `scale`. Rows no slot maps to (an MoE's padding rows) are left unwritten: a row of a
    GEMM's tile only reaches that row's outputs, and padding rows' outputs are never stored."""
    t, k = x.shape
    top_k = slot_rows.shape[0] // max(t, 1)
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    block_t, block_k = 4, min(1024, triton.next_power_of_2(k))
    if t and k:
        grid = (triton.cdiv(t, block_t), triton.cdiv(k, block_k))
        _quant_sorted_rows_kernel[grid](x, scale, slot_rows, q, t, k, x.stride(0), TOP_K=top_k,
                                        CODES=x.dtype == FP8, BLOCK_T=block_t, BLOCK_K=block_k,
                                        num_warps=4)
    return q


@triton.jit
def quant_block_tile(x, eps):
    """x [R, 128] FP32 -> (FP8 codes [R, 128], scale [R]) for one 128-channel group."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.div_rn(tl.maximum(amax, eps), 448.0)
    return to_e4m3(div_rn_by(x, scale[:, None])), scale


@triton.jit
def _quant_per_token_block_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_q, stride_st,
                                  stride_sg, eps, BLOCK_T: tl.constexpr, GROUP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < T) & (cols[None, :] < K)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    q, scale = quant_block_tile(x.to(tl.float32), eps)
    tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows64 * stride_st + group * stride_sg, scale, mask=rows < T)


def quant_fp8_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (contiguous) -> fp8 codes of the same shape."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    n = x.numel()
    if n:
        block = 2048
        _quant_per_tensor_kernel[(triton.cdiv(n, block),)](x, scale, q, n, BLOCK=block, num_warps=4)
    return q


def quant_fp8_per_token_block(x: torch.Tensor, group_major: bool = False):
    """x [T, K] -> (codes fp8 [T, K], scales fp32 [T, ceil(K/128)], or with `group_major`
    [ceil(K/128), T]: a GEMM step then reads its rows' scales of one group contiguously)."""
    x = x.contiguous()
    t, k = x.shape
    kb = triton.cdiv(k, FP8_BLOCK)
    q = torch.empty((t, k), dtype=FP8, device=x.device)
    s = torch.empty((kb, t) if group_major else (t, kb), dtype=torch.float32, device=x.device)
    if t:
        block_t = 4
        grid = (triton.cdiv(t, block_t), kb)
        stride_st, stride_sg = (1, t) if group_major else (kb, 1)
        _quant_per_token_block_kernel[grid](x, q, s, t, k, x.stride(0), q.stride(0), stride_st,
                                            stride_sg, ACT_EPS, BLOCK_T=block_t, GROUP=FP8_BLOCK,
                                            num_warps=4)
    return q, s


@triton.jit
def _quant_block_sorted_rows_kernel(x_ptr, slot_rows_ptr, q_ptr, s_ptr, T, K, rows, stride_x,
                                    eps, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                                    GROUP: tl.constexpr):
    # One token tile and 128-channel group: quantized once, stored into the tokens' TOP_K rows.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    ok = tokens < T
    mask = ok[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask,
                other=0.0)
    q, scale = quant_block_tile(x.to(tl.float32), eps)
    for j in tl.static_range(TOP_K):
        r = tl.load(slot_rows_ptr + tokens * TOP_K + j, mask=ok, other=0).to(tl.int64)
        tl.store(q_ptr + r[:, None] * K + cols[None, :], q, mask=mask)
        tl.store(s_ptr + group * rows + r, scale, mask=ok)


def quant_fp8_block_sorted_rows(x: torch.Tensor, slot_rows: torch.Tensor, rows: int):
    """`quant_fp8_per_token_block` into an MoE's sorted rows (as `quant_fp8_sorted_rows`):
    x [T, K], slot_rows [T * k] -> (codes fp8 [rows, K], scales fp32 [ceil(K/128), rows]; the
    scales group-major, so a GEMM step reads its rows' scales of one group contiguously).
    Padding rows are left unwritten (their outputs are never stored)."""
    x = x.contiguous()
    t, k = x.shape
    top_k = slot_rows.shape[0] // max(t, 1)
    kb = triton.cdiv(k, FP8_BLOCK)
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    s = torch.empty((kb, rows), dtype=torch.float32, device=x.device)
    if t and k:
        block_t = 4
        _quant_block_sorted_rows_kernel[(triton.cdiv(t, block_t), kb)](
            x, slot_rows, q, s, t, k, rows, x.stride(0), ACT_EPS, TOP_K=top_k, BLOCK_T=block_t,
            GROUP=FP8_BLOCK, num_warps=4)
    return q, s
