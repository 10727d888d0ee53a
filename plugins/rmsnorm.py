"""beam::rmsnorm — RMSNorm of each row, FP32 math, cast back.

    y[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * w        (no `1 + w`)

Shapes / dtypes: x [T, H] (fp32, bf16 or fp16), w [H] (any float dtype) -> y [T, H] in x's dtype.
Contract: functional, returns a new tensor (no out=, nothing is written in place). Matches
`beam_trtllm.reference.rms_norm` (the model's input_layernorm of layer 0 and the final norm;
every other norm is fused into beam::add_rmsnorm). CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from beam_trtllm.reference import rms_norm

from ._common import FLOAT_DTYPES, cast_rne, check, check_tensor, next_pow2
from .registry import dispatch, register

OP = "rmsnorm"


@register(OP, "reference")
def ref_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, H, eps, BLOCK_H: tl.constexpr):
    # One program per row; the whole row stays in registers (H <= 16K), so x is read once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / H + eps)
    y = x * inv_rms * w
    tl.store(y_ptr + row * stride_y + cols, cast_rne(y, y_ptr.dtype.element_ty), mask=mask)


def row_launch_params(h: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) for one-row-per-program kernels: ~16 elements per thread."""
    block = next_pow2(h)
    return block, max(1, min(16, block // 512))


@register(OP, "triton")
def _launch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    t, h = x.shape
    y = torch.empty_like(x)
    if t == 0:
        return y
    block, warps = row_launch_params(h)
    _rmsnorm_kernel[(t,)](x, weight, y, x.stride(0), y.stride(0), h, eps,
                          BLOCK_H=block, num_warps=warps)
    return y


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor(OP, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(OP, "weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check(weight.shape[0] == x.shape[1], OP,
          f"weight has {weight.shape[0]} entries but x rows have {x.shape[1]}")
    check(x.stride(1) == 1 and weight.stride(0) == 1, OP, "x rows and weight must be contiguous")


@torch.library.custom_op("beam::rmsnorm", mutates_args=())
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight)
    return dispatch(OP, x.device, x, weight, eps)


@rmsnorm.register_fake
def _(x, weight, eps):
    _check(x, weight)
    return torch.empty_like(x)
