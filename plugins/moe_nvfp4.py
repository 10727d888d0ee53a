"""beam::moe_nvfp4 — routed experts with NVFP4 weights on Hopper: W4A16 (no FP4 tensor cores,
so the kernel unpacks and scales the weights on the fly; activations stay in x.dtype).

    out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
    W[n, c] = E2M1[code(n, c)] * float(weight_scale[n, c // 16]) * weight_scale_2
    code(n, 2i) = packed[n, i] & 0xF (even element in the LOW nibble), code(n, 2i+1) = packed >> 4

Inputs (repacked expert layout of docs/DESIGN.md §2; tensors as ModelOpt exports them):
    x [T, H] bf16 / fp16 / fp32; topk_ids [T, k] int32/int64; topk_weights [T, k] fp32
    w13          [E, 2I, H/2]  uint8          rows [0, I) gate_proj, [I, 2I) up_proj
    w13_scale    [E, 2I, H/16] float8_e4m3fn
    w13_scale_2  [E]           fp32           gate and up share it (ModelOpt's fused-input rule)
    w2           [E, H, I/2]   uint8; w2_scale [E, H, I/16] float8_e4m3fn; w2_scale_2 [E] fp32
H and I must be multiples of 16. Output: a new [T, H] tensor in x.dtype (no `out=`; inputs are
never written).

Numerics: E2M1 * E4M3 is exact in bf16, so the kernel's weight tiles are exact; the GEMMs
accumulate in FP32 and multiply by weight_scale_2 at the end; gate, up, silu, h and y round to
x.dtype as the reference's modules do; the combine is FP32.
"""

from __future__ import annotations

import torch

from beam_trtllm.quant_formats import NVFP4_BLOCK, dequantize_nvfp4

from ._checks import _expect
from ._moe_common import (
    check_expert_weights, check_ids_in_range, check_routing, check_tensor, fake_moe,
    ref_moe,
)
from .registry import dispatch, register

OP = "moe_nvfp4"
FP8 = (torch.float8_e4m3fn,)


def check_moe_nvfp4(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2):
    check_routing(OP, x, topk_ids, topk_weights)
    h = x.shape[1]
    _expect(h % NVFP4_BLOCK == 0, OP, f"hidden size {h} is not a multiple of {NVFP4_BLOCK}")
    e, inner = check_expert_weights(OP, x, w13, w2, (torch.uint8,), pack=2)
    _expect(inner % NVFP4_BLOCK == 0, OP, f"expert width I={inner} is not a multiple of 16")
    check_tensor(OP, "w13_scale", w13_scale, (e, 2 * inner, h // NVFP4_BLOCK), FP8)
    check_tensor(OP, "w13_scale_2", w13_scale_2, (e,), (torch.float32,))
    check_tensor(OP, "w2_scale", w2_scale, (e, h, inner // NVFP4_BLOCK), FP8)
    check_tensor(OP, "w2_scale_2", w2_scale_2, (e,), (torch.float32,))
    return e, inner


@register(OP, "reference")
def ref_moe_nvfp4(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2):
    e, _ = check_moe_nvfp4(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale,
                           w2_scale_2)
    check_ids_in_range(OP, topk_ids, e)

    def expert(i):
        return (dequantize_nvfp4(w13[i], w13_scale[i], w13_scale_2[i], x.dtype),
                dequantize_nvfp4(w2[i], w2_scale[i], w2_scale_2[i], x.dtype))

    return ref_moe(x, topk_ids, topk_weights, expert)


@torch.library.custom_op("beam::moe_nvfp4", mutates_args=())
def moe_nvfp4(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: torch.Tensor, w13_scale: torch.Tensor, w13_scale_2: torch.Tensor,
    w2: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2: torch.Tensor,
) -> torch.Tensor:
    return dispatch(OP, x.device, x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2,
                    w2, w2_scale, w2_scale_2)


moe_nvfp4.register_fake(fake_moe)
