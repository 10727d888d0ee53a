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

from beam_trtllm.quant_formats import NVFP4_BLOCK, dequantize_nvfp4

from ._checks import _expect, check_device, check_linear_x, check_tensor
from .registry import dispatch, register

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
    return F.linear(x, dequantize_nvfp4(weight, weight_scale, weight_scale_2, x.dtype))


@torch.library.custom_op("beam::linear_nvfp4", mutates_args=())
def linear_nvfp4(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    return dispatch(OP, x.device, x, weight, weight_scale, weight_scale_2)


@linear_nvfp4.register_fake
def _(x, weight, weight_scale, weight_scale_2):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
