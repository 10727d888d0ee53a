"""beam::rmsnorm_fp8 — beam::rmsnorm plus the FP8 codes of its output for the next W8A8 GEMM.

    y[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * w      FP32 math, rounded to x's dtype
    q[t, :] = fp8_e4m3(clamp(y[t, :] / x_scale, +-448))      of the rounded y (IEEE division)

Shapes / dtypes: x [T, H] (fp32, bf16 or fp16), w [H], x_scale fp32 [] (the static
`input_scale` of the Linear that reads y) -> (y [T, H] in x's dtype, q [T, H] float8_e4m3fn).
Contract: functional, returns two new tensors. y is exactly beam::rmsnorm's; q is exactly what
beam::linear_fp8 would make of y (`quant_formats.quantize_fp8_activation`), so
`linear_fp8(q, ..., out_dtype=y.dtype)` equals `linear_fp8(y, ...)` and the separate
quantizer launch is gone. The engine uses it for layer 0's input norm (y feeds the BF16 gate;
q the q/k/v GEMM). One launch of beam::rmsnorm's kernel; CUDA-graph safe.
"""

from __future__ import annotations

import torch

from beam_trtllm.quant_formats import quantize_fp8_activation

from ._common import FP8_DTYPE, check_tensor
from .registry import beam_op, dispatch, register
from .rmsnorm import check_rmsnorm, ref_rmsnorm, rmsnorm_rows

OP = "rmsnorm_fp8"


@register(OP, "reference")
def ref_rmsnorm_fp8(x, weight, x_scale, eps: float):
    y = ref_rmsnorm(x, weight, eps)
    return y, quantize_fp8_activation(y, x_scale)


@register(OP, "triton")
def _launch_rmsnorm_fp8(x, weight, x_scale, eps: float):
    return rmsnorm_rows(x, weight, eps, x_scale)


def _check(x, weight, x_scale) -> None:
    check_rmsnorm(x, weight, OP)
    check_tensor(OP, "x_scale", x_scale, ndim=0, dtypes=(torch.float32,), device=x.device)


@beam_op("rmsnorm_fp8", mutates_args=())
def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, weight, x_scale)
    return dispatch(OP, x.device, x, weight, x_scale, eps)


@rmsnorm_fp8.register_fake
def _(x, weight, x_scale, eps):
    _check(x, weight, x_scale)
    return torch.empty_like(x), torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
