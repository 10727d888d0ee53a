"""beam::linear_fp8_block — a Linear layer with FP8 128x128-block weights and dynamic per-token
per-128-channel FP8 activations (DeepSeek-V3 style), in the checkpoint layout of §1.

    y = qd(x) @ W^T,  W[n, c] = weight[n, c] * weight_scale[n // 128, c // 128]
    qd(x): per token and group of 128 channels s = max(amax, 1e-10) / 448, x ~= fp8(x / s) * s

Inputs: x [..., K] bf16 / fp16 / fp32; weight [N, K] float8_e4m3fn; weight_scale fp32
[ceil(N/128), ceil(K/128)]. Output: a new [..., N] tensor in x.dtype (no `out=`; inputs are
never written). Each 128-deep slice of the dot accumulates in FP32 and is scaled by
x_scale * w_scale.

Prefill (more than 64 tokens) on sm_90+: both operands loaded by the TMA, the activation scales
group-major and one weight scale a step (a 128-row tile is one scale block): the same products
in the same order as the per-thread kernel, so the same bits.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from beam_trtllm.quant_formats import FP8_BLOCK, dequantize_fp8, fake_quant_fp8_per_token_block

from ._checks import check_device, check_linear_x, check_tensor
from ._fp8_act import quant_fp8_per_token_block
from ._gemm import fp8_block_gemm_loop, round_to, tile_of, tma_block_gemm_loop, unswap
from ._moe_common import GemmConfig, TMA_MAX_BOX, has_tma, tma_addressable
from ._tiles import linear_config
from .registry import PluginError, beam_op, dispatch, register

OP = "linear_fp8_block"
FP8 = (torch.float8_e4m3fn,)
PREFILL_TMA = GemmConfig(128, 128, FP8_BLOCK, 8, 3)  # the W8A8 prefill GEMMs' shape


def check_linear_fp8_block(x, weight, weight_scale):
    check_tensor(OP, "weight", weight, (None, None), FP8)
    n, k = weight.shape
    check_linear_x(OP, x, k)
    blocks = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    check_tensor(OP, "weight_scale", weight_scale, blocks, (torch.float32,))
    check_device(OP, x, weight=weight, weight_scale=weight_scale)


@register(OP, "reference")
def ref_linear_fp8_block(x, weight, weight_scale):
    check_linear_fp8_block(x, weight, weight_scale)
    xq = fake_quant_fp8_per_token_block(x.float())  # FP32 math on exact decoded values
    return F.linear(xq, dequantize_fp8(weight, weight_scale)).to(x.dtype)


@beam_op("linear_fp8_block", mutates_args=())
def linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    return dispatch(OP, x.device, x, weight, weight_scale)


@linear_fp8_block.register_fake
def _(x, weight, weight_scale):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# ---------------------------------------------------------------------------- triton
@triton.jit
def _linear_fp8_block_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_xsm,
                             stride_wn, stride_wsn, stride_ym, SWAP: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr):
    # BLOCK_K = 128: each K step is one scale group, scaled by x_scale[m, g] * w_scale[n // 128, g].
    pid_m, pid_n = tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    xs_ptrs = xs_ptr + offs_m.to(tl.int64) * stride_xsm
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    ws_ptrs = ws_ptr + (offs_n // BLOCK_K) * stride_wsn
    acc, _ = fp8_block_gemm_loop(x_ptrs, xs_ptrs, m_mask, w_ptrs, ws_ptrs, n_mask, K, 0, 0,
                                 False, SWAP, BLOCK_M, BLOCK_N, BLOCK_K)
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    out = round_to(unswap(acc, SWAP), dtype)
    tl.store(y_ptrs, out.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _linear_fp8_block_tma_kernel(x_desc, xs_ptr, w_desc, ws_ptr, y_ptr, M, N, K, stride_wsn,
                                 stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # xs_ptr: group-major activation scales [ceil(K/128), M]; BLOCK_N divides 128.
    pid_m, pid_n = tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc, _ = tma_block_gemm_loop(x_desc, m0, xs_ptr + offs_m, M, m_mask, w_desc, n0,
                                 ws_ptr + (n0 // BLOCK_K) * stride_wsn, 0, 0, K, False, False,
                                 BLOCK_M, BLOCK_N, BLOCK_K)
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, round_to(acc, dtype).to(dtype), mask=m_mask[:, None] & n_mask[None, :])


def takes_tma(x2d: torch.Tensor, weight: torch.Tensor, cfg: GemmConfig) -> bool:
    """Prefill sizes, a device with a TMA, tiles of one scale block one TMA copy fills, and a
    weight the TMA can address."""
    return (x2d.shape[0] > 64 and has_tma(x2d.device) and not cfg.swap
            and cfg.block_k == FP8_BLOCK and FP8_BLOCK % cfg.block_n == 0
            and cfg.block_m <= TMA_MAX_BOX and tma_addressable(weight))


def _tma_launch(x2d, weight, weight_scale, y, cfg: GemmConfig):
    m, k = x2d.shape
    n = weight.shape[0]
    xq, xs = quant_fp8_per_token_block(x2d, group_major=True)
    x_desc = TensorDescriptor(xq, [m, k], [k, 1], [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor(weight, [n, k], [k, 1], [cfg.block_n, cfg.block_k])
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _linear_fp8_block_tma_kernel[grid](
        x_desc, xs, w_desc, weight_scale, y, m, n, k, weight_scale.stride(0), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@register(OP, "triton")
def linear_fp8_block_triton(x, weight, weight_scale, config=None, tma=None):
    """Launcher: per-token-per-128 quantization of x, then the block-scaled GEMM. `config` /
    `tma` override the launch choices (tests and bench/ only)."""
    check_linear_fp8_block(x, weight, weight_scale)
    n, k = weight.shape
    x2d = x.reshape(-1, k)
    m = x2d.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and tma is not False and takes_tma(x2d, weight, config or PREFILL_TMA):
        _tma_launch(x2d, weight, weight_scale, y, config or PREFILL_TMA)
        return y.reshape(*x.shape[:-1], n)
    if tma:
        raise PluginError(f"beam::{OP}: tma=True needs more than 64 tokens, a device with a "
                          f"TMA, a TMA-addressable weight and 128-deep tiles of 128 or fewer "
                          f"(dividing 128) weight rows, not swapped")
    xq, xs = quant_fp8_per_token_block(x2d)
    if m:
        cfg = dataclasses.replace(config or linear_config(m, 1), block_k=FP8_BLOCK)
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        _linear_fp8_block_kernel[grid](
            xq, xs, weight, weight_scale, y, m, n, k, xq.stride(0), xs.stride(0),
            weight.stride(0), weight_scale.stride(0), y.stride(0), SWAP=cfg.swap, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return y.reshape(*x.shape[:-1], n)
