"""beam::linear_nvfp4 — a Linear layer with NVFP4 weights on Hopper: W4A16, a dequantizing GEMM
(weights unpacked and scaled in the kernel; activations stay in x.dtype), checkpoint layout §1.

    y = x @ W^T,  W[n, c] = E2M1[code(n, c)] * float(weight_scale[n, c // 16]) * weight_scale_2
    code(n, 2i) = weight[n, i] & 0xF (even element in the LOW nibble), code(n, 2i+1) = weight >> 4

Inputs: x [..., K] bf16 / fp16 / fp32 (K a multiple of 16); weight uint8 [N, K/2]; weight_scale
float8_e4m3fn [N, K/16]; weight_scale_2 fp32 []. Output: a new [..., N] tensor in x.dtype (no
`out=`; inputs are never written). FP32 accumulation; weight_scale_2 applied at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from beam_trtllm.quant_formats import NVFP4_BLOCK, dequantize_nvfp4

from ._checks import _expect, check_device, check_linear_x, check_tensor
from ._gemm import dot_precision, round_to, tile_of, unswap
from .moe_nvfp4 import use_asm
from ._tiles import linear_config, nvfp4_k_loop, nvfp4_side
from .registry import beam_op, dispatch, register
from .tuning import tuned_linear

OP = "linear_nvfp4"


def check_linear_nvfp4(x, weight, weight_scale, weight_scale_2):
    check_tensor(OP, "weight", weight, (None, None), (torch.uint8,))
    n, k = weight.shape[0], weight.shape[1] * 2
    check_linear_x(OP, x, k)
    _expect(k % NVFP4_BLOCK == 0, OP, f"input size {k} is not a multiple of {NVFP4_BLOCK}")
    check_tensor(OP, "weight_scale", weight_scale, (n, k // NVFP4_BLOCK), (torch.float8_e4m3fn,))
    check_tensor(OP, "weight_scale_2", weight_scale_2, (), (torch.float32,))
    check_device(OP, x, weight=weight, weight_scale=weight_scale, weight_scale_2=weight_scale_2)


@register(OP, "reference")
def ref_linear_nvfp4(x, weight, weight_scale, weight_scale_2):
    check_linear_nvfp4(x, weight, weight_scale, weight_scale_2)
    w = dequantize_nvfp4(weight, weight_scale, weight_scale_2)  # FP32 math on exact decoded values
    return F.linear(x.float(), w).to(x.dtype)


@beam_op("linear_nvfp4", mutates_args=())
def linear_nvfp4(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    return dispatch(OP, x.device, x, weight, weight_scale, weight_scale_2)


@linear_nvfp4.register_fake
def _(x, weight, weight_scale, weight_scale_2):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# ---------------------------------------------------------------------------- triton
@triton.jit
def _linear_nvfp4_kernel(x_ptr, w_ptr, ws_ptr, ws2_ptr, y_ptr, M, N, K, stride_xm, stride_wn,
                         stride_sn, stride_ym, SWAP: tl.constexpr, ASM: tl.constexpr,
                         SIDE: tl.constexpr,
                         EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # w_ptr: the packed weight read as int32 words (8 codes each), stride_wn in words.
    pid_m, pid_n = tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // 8)
    offs_ks = tl.arange(0, BLOCK_K // 16)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_kw[None, :]
    s_ptrs = ws_ptr + offs_n.to(tl.int64)[:, None] * stride_sn + offs_ks[None, :]
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    acc = nvfp4_k_loop(x_ptrs, w_ptrs, s_ptrs, m_mask, n_mask, 0, 0, K, False, EVEN_K, SWAP, ASM,
                       SIDE, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)[0]
    out = round_to(unswap(acc, SWAP) * (tl.load(ws2_ptr) * 256.0), dtype)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


@register(OP, "triton")
def linear_nvfp4_triton(x, weight, weight_scale, weight_scale_2, config=None):
    """Launcher. `config` overrides the launch shape (bench/ only)."""
    check_linear_nvfp4(x, weight, weight_scale, weight_scale_2)
    n, k = weight.shape[0], weight.shape[1] * 2
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        cfg = config or tuned_linear(OP, m, n, k, x.dtype) or linear_config(m, 0.5)
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        words = weight.view(torch.int32)
        _linear_nvfp4_kernel[grid](
            x2, words, weight_scale, weight_scale_2, y, m, n, k, x2.stride(0), words.stride(0),
            weight_scale.stride(0), y.stride(0), SWAP=cfg.swap, ASM=use_asm(x.dtype),
            SIDE=nvfp4_side(cfg.swap, cfg.block_m), EVEN_K=k % cfg.block_k == 0,
            PRECISION=dot_precision(x.dtype), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return y.reshape(*x.shape[:-1], n)
