"""beam::add_rmsnorm_fp8 — beam::add_rmsnorm plus the FP8 codes of its x for the next W8A8 GEMM.

    h', x = beam::add_rmsnorm(h, y, w_post, w_pre, a, b, eps)          (bit for bit)
    q     = fp8_e4m3(clamp(x / x_scale, +-448))                         of the rounded x

Shapes / dtypes: h, y [T, H] (fp32, bf16 or fp16, one dtype; y also as partials with
y_weights, see beam::add_rmsnorm), w_post, w_pre [H]; x_scale fp32
[] (the static `input_scale` of the Linear that reads x); a, b, eps python floats
-> (h' [T, H], x [T, H] in h's dtype, q [T, H] float8_e4m3fn).
Contract: functional, returns three new tensors. q is exactly what beam::linear_fp8 would make
of x (`quant_formats.quantize_fp8_activation`, IEEE division, saturating), so
`linear_fp8(q, ..., out_dtype=x.dtype)` equals `linear_fp8(x, ...)` without the quantizer's
launch; x is still written for the consumers that read BF16 (the router).
One launch of beam::add_rmsnorm's kernel; CUDA-graph safe.
"""

from __future__ import annotations

from typing import Optional

import torch

from beam_trtllm.quant_formats import quantize_fp8_activation

from ._common import FP8_DTYPE, check_tensor
from .add_rmsnorm import add_rmsnorm_rows, check_add_rmsnorm, ref_add_rmsnorm
from .registry import beam_op, dispatch, register

OP = "add_rmsnorm_fp8"


@register(OP, "reference")
def ref_add_rmsnorm_fp8(h, y, w_post, w_pre, x_scale, a: float, b: float, eps: float, *,
                        y_weights=None, y_scale: float = 1.0):
    h_new, x = ref_add_rmsnorm(h, y, w_post, w_pre, a, b, eps, y_weights=y_weights,
                               y_scale=y_scale)
    return h_new, x, quantize_fp8_activation(x, x_scale)


@register(OP, "triton")
def _launch_add_rmsnorm_fp8(h, y, w_post, w_pre, x_scale, a: float, b: float, eps: float, *,
                            y_weights=None, y_scale: float = 1.0):
    return add_rmsnorm_rows(h, y, w_post, w_pre, a, b, eps, x_scale, y_weights, y_scale)


def _check(h, y, w_post, w_pre, x_scale, y_weights=None, y_scale: float = 1.0) -> None:
    check_add_rmsnorm(h, y, w_post, w_pre, OP, y_weights, y_scale)
    check_tensor(OP, "x_scale", x_scale, ndim=0, dtypes=(torch.float32,), device=h.device)


@beam_op("add_rmsnorm_fp8", mutates_args=())
def add_rmsnorm_fp8(h: torch.Tensor, y: torch.Tensor, w_post: torch.Tensor, w_pre: torch.Tensor,
                    x_scale: torch.Tensor, a: float, b: float, eps: float,
                    y_weights: Optional[torch.Tensor] = None, y_scale: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(h, y, w_post, w_pre, x_scale, y_weights, y_scale)
    return dispatch(OP, h.device, h, y, w_post, w_pre, x_scale, a, b, eps, y_weights=y_weights,
                    y_scale=y_scale)


@add_rmsnorm_fp8.register_fake
def _(h, y, w_post, w_pre, x_scale, a, b, eps, y_weights=None, y_scale=1.0):
    _check(h, y, w_post, w_pre, x_scale, y_weights, y_scale)
    return (torch.empty_like(h), torch.empty_like(h),
            torch.empty(h.shape, dtype=FP8_DTYPE, device=h.device))
