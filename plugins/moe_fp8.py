"""beam::moe_fp8 — routed experts with FP8 per-tensor weights and static FP8 activations (W8A8).

    out[t] = sum_j w[t, j] * down_e(q2(silu(gate_e(q13(x[t]))) * up_e(q13(x[t]))))
    q_s(a) = fp8_e4m3(clamp(a / s, +-448)) * s     (static per-tensor activation quantizer)
    gate_e / up_e / down_e use W = fp8 weight * its per-tensor scale

Inputs (repacked expert layout of docs/DESIGN.md §2):
    x [T, H] bf16 / fp16 / fp32; topk_ids [T, k] int32/int64; topk_weights [T, k] fp32
    w13        [E, 2I, H] float8_e4m3fn   rows [0, I) gate_proj, [I, 2I) up_proj
    w13_scale  [E, 2I]    fp32            each matrix's weight_scale repeated over its rows
    w2         [E, H, I]  float8_e4m3fn; w2_scale [E, H] fp32
    a13_scale  []         fp32            the layer's shared gate/up input_scale
    a2_scale   []         fp32            the layer's shared down_proj input_scale
Output: a new [T, H] tensor in x.dtype (no `out=`; inputs are never written).

Numerics: FP8 x FP8 products accumulate exactly in FP32 on the tensor cores and are scaled by
a_scale * w_scale; gate, up, silu and h round to x.dtype (as the reference's modules do) before
h is quantized with a2_scale; y rounds to x.dtype; the combine is FP32.
"""

from __future__ import annotations

import torch

from beam_trtllm.quant_formats import dequantize_fp8, fake_quant_fp8_activation

from ._moe_common import (
    check_expert_weights, check_ids_in_range, check_routing, check_tensor, fake_moe, ref_moe,
)
from .registry import dispatch, register

OP = "moe_fp8"
FP8 = (torch.float8_e4m3fn,)


def check_moe_fp8(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, a13_scale, a2_scale):
    check_routing(OP, x, topk_ids, topk_weights)
    e, inner = check_expert_weights(OP, x, w13, w2, FP8)
    check_tensor(OP, "w13_scale", w13_scale, (e, 2 * inner), (torch.float32,))
    check_tensor(OP, "w2_scale", w2_scale, (e, x.shape[1]), (torch.float32,))
    check_tensor(OP, "a13_scale", a13_scale, (), (torch.float32,))
    check_tensor(OP, "a2_scale", a2_scale, (), (torch.float32,))
    return e, inner


@register(OP, "reference")
def ref_moe_fp8(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, a13_scale, a2_scale):
    e, _ = check_moe_fp8(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, a13_scale, a2_scale)
    check_ids_in_range(OP, topk_ids, e)

    def expert(i):
        return (dequantize_fp8(w13[i], w13_scale[i], x.dtype), dequantize_fp8(w2[i], w2_scale[i], x.dtype))

    return ref_moe(
        x, topk_ids, topk_weights, expert,
        lambda a: fake_quant_fp8_activation(a, a13_scale),
        lambda a: fake_quant_fp8_activation(a, a2_scale),
    )


@torch.library.custom_op("beam::moe_fp8", mutates_args=())
def moe_fp8(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    a13_scale: torch.Tensor, a2_scale: torch.Tensor,
) -> torch.Tensor:
    return dispatch(OP, x.device, x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale,
                    a13_scale, a2_scale)


moe_fp8.register_fake(fake_moe)
