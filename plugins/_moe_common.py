"""What the four `beam::moe_*` ops share: input checks, the reference MoE math, token sorting by
expert (moe_align), the weighted combine and the launch configuration.

Data flow of every MoE kernel (T tokens, k experts each, E experts, H hidden, I expert width):

    moe_align(topk_ids)  -> sorted_slots [max_rows]   flat slot t*k+j of each row, padded per
                            expert to a multiple of BLOCK_M with the sentinel T*k;
                            block_expert [max_rows / BLOCK_M]  expert of each row block (-1: idle);
                            num_rows [1]  rows in use (a device scalar: no host sync)
    gemm13  rows r:      h[r] = silu(x[slot // k] @ gate_e^T) * (x[slot // k] @ up_e^T)   [max_rows, I]
    gemm2   rows r:      y[slot] = h[r] @ down_e^T                                    [T*k, H]
    combine:             out[t] = sum_j float(y[t*k+j]) * topk_weights[t, j]          [T, H]

`max_rows` depends only on (T*k, E, BLOCK_M), never on the routing, so the buffers and grids
are the same for every step of a given batch size: CUDA-graph safe. An expert with no tokens
owns no block. For a few token-expert pairs (decode), the kernels skip the sort and give each
pair its own row block ("direct" mode): no align launch, and each pair reads its expert once.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ._checks import ACT_DTYPES, _expect, check_tensor
from .registry import PluginError

DIRECT_MAX_PAIRS = 64  # at most this many (token, expert) pairs: no sort, one pair per block


# ---------------------------------------------------------------------------- input checks
def check_routing(op: str, x, topk_ids, topk_weights) -> tuple[int, int, int]:
    check_tensor(op, "x", x, (None, None), ACT_DTYPES)
    t, h = x.shape
    check_tensor(op, "topk_ids", topk_ids, (t, None), (torch.int32, torch.int64))
    check_tensor(op, "topk_weights", topk_weights, (t, topk_ids.shape[1]), (torch.float32,))
    for name, other in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        _expect(other.device == x.device, op, f"{name} is on {other.device}, x on {x.device}")
    return t, h, topk_ids.shape[1]


def check_expert_weights(op, x, w13, w2, dtypes, pack: int = 1) -> tuple[int, int]:
    """w13 [E, 2I, H/pack], w2 [E, H, I/pack] (pack = 2 for two FP4 codes a byte) -> (E, I)."""
    h = x.shape[1]
    check_tensor(op, "w13", w13, (None, None, h // pack), dtypes)
    e, two_i = w13.shape[:2]
    _expect(two_i % 2 == 0, op, f"w13 has {two_i} rows; expected 2*I (gate rows, then up rows)")
    check_tensor(op, "w2", w2, (e, h, two_i // 2 // pack), dtypes)
    for name, w in (("w13", w13), ("w2", w2)):
        _expect(w.device == x.device, op, f"{name} is on {w.device}, x on {x.device}")
        _expect(w.is_contiguous(), op, f"{name} must be contiguous")
    return e, two_i // 2


def check_ids_in_range(op: str, topk_ids: torch.Tensor, num_experts: int) -> None:
    """Reference path only: a device check would need a host sync (the router guarantees it)."""
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise PluginError(f"beam::{op}: topk_ids has ids outside [0, {num_experts})")


# ---------------------------------------------------------------------------- reference math
def ref_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    quant13: Callable[[torch.Tensor], torch.Tensor] = lambda a: a,
    quant2: Callable[[torch.Tensor], torch.Tensor] = lambda a: a,
) -> torch.Tensor:
    """reference.py's BeamMoE.forward given the routing: `expert(e)` returns that expert's
    (w13 [2I, H], w2 [H, I]) dequantized to x.dtype; quant13 / quant2 are what the kernel's
    activation quantizer does to the GEMM inputs (identity for BF16 and W4A16)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13, w2 = expert(e)
        inner = w13.shape[0] // 2
        xe = quant13(x[token])
        h = F.silu(F.linear(xe, w13[:inner])) * F.linear(xe, w13[inner:])
        y = F.linear(quant2(h), w2)
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None])
    return out.to(x.dtype)


def fake_moe(x: torch.Tensor, *args) -> torch.Tensor:
    return torch.empty_like(x)
