"""beam::linear_fp8 — a Linear layer with FP8 per-tensor (or per-row) weights and a static FP8
per-tensor activation scale (W8A8), in the checkpoint layout of docs/DESIGN.md §1.

    y = q(x) @ W^T,   q(x) = fp8_e4m3(clamp(x / input_scale, +-448)) * input_scale,
    W = weight * weight_scale (a scalar, or one scale per output row)

Inputs: x [..., K] bf16 / fp16 / fp32; weight [N, K] float8_e4m3fn; weight_scale fp32 [] or [N];
input_scale fp32 []. Output: a new [..., N] tensor in x.dtype (no `out=`; inputs are never
written). On CUDA the GEMM is torch._scaled_mm (FP8 tensor cores, FP32 accumulation) where its
shape rules hold (K and N multiples of 16), the Triton kernel below otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from beam_trtllm.quant_formats import dequantize_fp8, fake_quant_fp8_activation

from ._checks import _expect, check_device, check_linear_x, check_tensor
from ._fp8_act import quant_fp8_per_tensor
from ._moe_common import acc_zeros, mma_fp8, round_to, tile_of, unswap
from ._tiles import linear_config
from .registry import dispatch, register

OP = "linear_fp8"
FP8 = (torch.float8_e4m3fn,)


def check_linear_fp8(x, weight, weight_scale, input_scale):
    check_tensor(OP, "weight", weight, (None, None), FP8)
    n, k = weight.shape
    check_linear_x(OP, x, k)
    _expect(weight_scale.dim() == 0 or tuple(weight_scale.shape) == (n,), OP,
            f"weight_scale has shape {list(weight_scale.shape)}, expected [] or [{n}]")
    check_tensor(OP, "weight_scale", weight_scale, tuple(weight_scale.shape), (torch.float32,))
    check_tensor(OP, "input_scale", input_scale, (), (torch.float32,))
    check_device(OP, x, weight=weight, weight_scale=weight_scale, input_scale=input_scale)


@register(OP, "reference")
def ref_linear_fp8(x, weight, weight_scale, input_scale):
    check_linear_fp8(x, weight, weight_scale, input_scale)
    xq = fake_quant_fp8_activation(x.float(), input_scale)  # FP32 math on exact decoded values
    return F.linear(xq, dequantize_fp8(weight, weight_scale)).to(x.dtype)


@torch.library.custom_op("beam::linear_fp8", mutates_args=())
def linear_fp8(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor
) -> torch.Tensor:
    return dispatch(OP, x.device, x, weight, weight_scale, input_scale)


@linear_fp8.register_fake
def _(x, weight, weight_scale, input_scale):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# ---------------------------------------------------------------------------- triton
@triton.jit
def _linear_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_wn,
                       stride_ws, stride_ym, SWAP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # FP8 x FP8 products, promoted to FP32 every BLOCK_K (Hopper's FP8 MMA accumulates with
    # reduced precision), then * input_scale * weight_scale[n] (stride_ws = 0 broadcasts a
    # per-tensor weight scale).
    pid_m, pid_n = tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = mma_fp8(acc, a, w, SWAP, BLOCK_K)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    w_scale = tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    out = round_to(unswap(acc, SWAP) * tl.load(xs_ptr) * w_scale[None, :], dtype)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


def _scaled_mm_ok(x, n, k, weight_scale) -> bool:
    """torch._scaled_mm's rules: CUDA, K and N multiples of 16; a per-row weight scale needs
    row-wise scaling, which returns BF16 only."""
    if not (x.is_cuda and hasattr(torch, "_scaled_mm") and k % 16 == 0 and n % 16 == 0):
        return False
    return weight_scale.dim() == 0 or x.dtype == torch.bfloat16


@register(OP, "triton")
def linear_fp8_triton(x, weight, weight_scale, input_scale, use_scaled_mm=None, config=None):
    """Launcher: quantize x with the static scale, then torch._scaled_mm (CUDA, where its shape
    rules hold) or the Triton GEMM. `use_scaled_mm` / `config` override (tests, bench/)."""
    check_linear_fp8(x, weight, weight_scale, input_scale)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    xq = quant_fp8_per_tensor(x2, input_scale)
    use = _scaled_mm_ok(x, n, k, weight_scale) if use_scaled_mm is None else use_scaled_mm
    if use and m:
        if weight_scale.dim() == 0:
            y = torch._scaled_mm(xq, weight.t(), scale_a=input_scale, scale_b=weight_scale,
                                 out_dtype=x.dtype)
        else:  # row-wise: scale_a [M, 1], scale_b [1, N]
            y = torch._scaled_mm(xq, weight.t(), scale_a=input_scale.expand(m, 1).contiguous(),
                                 scale_b=weight_scale.view(1, n), out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], n)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        cfg = config or linear_config(m, 1)
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        stride_ws = 0 if weight_scale.dim() == 0 else 1
        _linear_fp8_kernel[grid](
            xq, input_scale, weight, weight_scale, y, m, n, k, xq.stride(0), weight.stride(0),
            stride_ws, y.stride(0), SWAP=cfg.swap, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return y.reshape(*x.shape[:-1], n)
