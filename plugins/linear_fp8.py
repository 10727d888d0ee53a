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

from beam_trtllm.quant_formats import dequantize_fp8, fake_quant_fp8_activation

from ._checks import _expect, check_device, check_linear_x, check_tensor
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
    xq = fake_quant_fp8_activation(x, input_scale)
    return F.linear(xq, dequantize_fp8(weight, weight_scale, x.dtype))


@torch.library.custom_op("beam::linear_fp8", mutates_args=())
def linear_fp8(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor
) -> torch.Tensor:
    return dispatch(OP, x.device, x, weight, weight_scale, input_scale)


@linear_fp8.register_fake
def _(x, weight, weight_scale, input_scale):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
