"""beam::moe_fp8_block — routed experts with FP8 128x128-block weights and dynamic per-token
per-128-channel FP8 activations (DeepSeek-V3 style).

    out[t] = sum_j w[t, j] * down_e(qd(silu(gate_e(qd(x[t]))) * up_e(qd(x[t]))))
    qd(a): per token and per group of 128 channels, s = max(amax, 1e-10) / 448,
           a ~= fp8_e4m3(clamp(a / s, +-448)) * s      (quant_formats.quantize_fp8_per_token_block)
    W[n, c] = fp8 weight[n, c] * scale[n, c // 128]

Inputs (repacked expert layout of docs/DESIGN.md §2):
    x [T, H] bf16 / fp16 / fp32; topk_ids [T, k] int32/int64; topk_weights [T, k] fp32
    w13        [E, 2I, H]           float8_e4m3fn   rows [0, I) gate_proj, [I, 2I) up_proj
    w13_scale  [E, 2I, ceil(H/128)] fp32  the 128x128 block scale repeated over its block's
                                          rows (so I need not be a multiple of 128)
    w2         [E, H, I]            float8_e4m3fn
    w2_scale   [E, H, ceil(I/128)]  fp32
Output: a new [T, H] tensor in x.dtype (no `out=`; inputs are never written).

Numerics: each 128-deep slice of a dot accumulates in FP32 and is scaled by
x_scale[row, group] * w_scale[n, group]; gate, up, silu and h round to x.dtype before h is
quantized; y rounds to x.dtype; the combine is FP32.
"""

from __future__ import annotations

import torch

from beam_trtllm.quant_formats import FP8_BLOCK, fake_quant_fp8_per_token_block

from ._moe_common import (
    check_expert_weights, check_ids_in_range, check_routing, check_tensor, fake_moe, ref_moe,
)
from .registry import dispatch, register

OP = "moe_fp8_block"
FP8 = (torch.float8_e4m3fn,)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dequantize_fp8_row_blocks(weight, scale, dtype):
    """weight fp8 [N, K], scale fp32 [N, ceil(K/128)] (one scale per row per 128 columns)."""
    k = weight.shape[-1]
    return (weight.float() * scale.repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]).to(dtype)


def check_moe_fp8_block(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale):
    check_routing(OP, x, topk_ids, topk_weights)
    e, inner = check_expert_weights(OP, x, w13, w2, FP8)
    h = x.shape[1]
    check_tensor(OP, "w13_scale", w13_scale, (e, 2 * inner, cdiv(h, FP8_BLOCK)), (torch.float32,))
    check_tensor(OP, "w2_scale", w2_scale, (e, h, cdiv(inner, FP8_BLOCK)), (torch.float32,))
    return e, inner


@register(OP, "reference")
def ref_moe_fp8_block(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale):
    e, _ = check_moe_fp8_block(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    check_ids_in_range(OP, topk_ids, e)

    def expert(i):
        return (dequantize_fp8_row_blocks(w13[i], w13_scale[i], x.dtype),
                dequantize_fp8_row_blocks(w2[i], w2_scale[i], x.dtype))

    quant = fake_quant_fp8_per_token_block
    return ref_moe(x, topk_ids, topk_weights, expert, quant, quant)


@torch.library.custom_op("beam::moe_fp8_block", mutates_args=())
def moe_fp8_block(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
) -> torch.Tensor:
    return dispatch(OP, x.device, x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)


moe_fp8_block.register_fake(fake_moe)
