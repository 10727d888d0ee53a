"""beam::moe_bf16 — the routed experts of a Beam MoE layer on unquantized weights.

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = topk_ids[t, j]

Inputs (repacked expert layout of docs/DESIGN.md §2):
    x             [T, H]      bf16 / fp16 / fp32
    topk_ids      [T, k]      int32 (or int64), distinct experts per token, each in [0, E)
    topk_weights  [T, k]      fp32 (already normalised and scaled by the router)
    w13           [E, 2I, H]  x.dtype: rows [0, I) are gate_proj, rows [I, 2I) are up_proj
    w2            [E, H, I]   x.dtype: down_proj
Output: a new [T, H] tensor in x.dtype. There is no `out=`: the op allocates its result (inside
a CUDA graph it comes from the graph's pool) and never writes its inputs.

Numerics (match reference.py's BeamMoE): GEMMs accumulate in FP32; gate, up, silu(gate) and h
are rounded to x.dtype as the reference's module outputs are; the expert output y is rounded to
x.dtype, then weighted and summed over j in FP32 and rounded once.
"""

from __future__ import annotations

import torch

from ._moe_common import check_expert_weights, check_ids_in_range, check_routing, fake_moe, ref_moe
from .registry import dispatch, register

OP = "moe_bf16"


@register(OP, "reference")
def ref_moe_bf16(x, topk_ids, topk_weights, w13, w2):
    check_routing(OP, x, topk_ids, topk_weights)
    e, _ = check_expert_weights(OP, x, w13, w2, (x.dtype,))
    check_ids_in_range(OP, topk_ids, e)
    return ref_moe(x, topk_ids, topk_weights, lambda i: (w13[i], w2[i]))


@torch.library.custom_op("beam::moe_bf16", mutates_args=())
def moe_bf16(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: torch.Tensor, w2: torch.Tensor,
) -> torch.Tensor:
    return dispatch(OP, x.device, x, topk_ids, topk_weights, w13, w2)


moe_bf16.register_fake(fake_moe)
