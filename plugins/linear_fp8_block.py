"""beam::linear_fp8_block — a Linear layer with FP8 128x128-block weights and dynamic per-token
per-128-channel FP8 activations (DeepSeek-V3 style), in the checkpoint layout of §1.

    y = qd(x) @ W^T,  W[n, c] = weight[n, c] * weight_scale[n // 128, c // 128]
    qd(x): per token and group of 128 channels s = max(amax, 1e-10) / 448, x ~= fp8(x / s) * s

Inputs: x [..., K] bf16 / fp16 / fp32; weight [N, K] float8_e4m3fn; weight_scale fp32
[ceil(N/128), ceil(K/128)]. Output: a new [..., N] tensor in x.dtype (no `out=`; inputs are
never written). Each 128-deep slice of the dot accumulates in FP32 and is scaled by
x_scale * w_scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from beam_trtllm.quant_formats import FP8_BLOCK, dequantize_fp8, fake_quant_fp8_per_token_block

from ._checks import check_device, check_linear_x, check_tensor
from .registry import dispatch, register

OP = "linear_fp8_block"
FP8 = (torch.float8_e4m3fn,)


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
    xq = fake_quant_fp8_per_token_block(x)
    return F.linear(xq, dequantize_fp8(weight, weight_scale, x.dtype))


@torch.library.custom_op("beam::linear_fp8_block", mutates_args=())
def linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    return dispatch(OP, x.device, x, weight, weight_scale)


@linear_fp8_block.register_fake
def _(x, weight, weight_scale):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
