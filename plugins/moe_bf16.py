"""beam::moe_bf16 — the routed experts of a Beam MoE layer on unquantized weights.

    out[t] = rnd(scale * sum_j topk_weights[t, j] * down_e(swiglu(gate_e(x[t]), up_e(x[t])))),
    e = topk_ids[t, j],  swiglu(g, u) = rnd(silu(g) * u) in FP32

Inputs (repacked expert layout of docs/DESIGN.md §2):
    x             [T, H]      bf16 / fp16 / fp32
    topk_ids      [T, k]      int32 (or int64), distinct experts per token, each in [0, E)
    topk_weights  [T, k]      fp32 (normalised by the router)
    w13           [E, 2I, H]  x.dtype: rows [0, I) are gate_proj, rows [I, 2I) are up_proj
    w2            [E, H, I]   x.dtype: down_proj
    scale         float       Beam's routed_scaling_factor, on the FP32 sum (default 1)
Output: a new [T, H] tensor in x.dtype, or with per_slot each (token, slot)'s unweighted expert
output [T, k, H] for a consumer that weights, sums and scales them (beam::add_rmsnorm). There is no `out=`: the op allocates its result (inside
a CUDA graph it comes from the graph's pool) and never writes its inputs.

Numerics (transformers' BeamMoE, the combine as the spec pins it): GEMMs accumulate in FP32;
gate and up are rounded to x.dtype, silu and the product taken in FP32 and h rounded once; the
expert output y is rounded to x.dtype, then weighted and summed over j in FP32, times scale,
and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._gemm import dot_precision, gemm_loop, round_to, silu_mul, tile_of, unswap
from ._moe_common import (
    DIRECT_MAX_PAIRS, GemmConfig, Routing, block_tile, check_expert_weights, check_ids_in_range,
    check_routing, configs_for, empty_output, fake_moe, finish, past_last_row, plan_routing,
    ref_moe, routing_ptrs,
)
from .registry import beam_op, dispatch, register

OP = "moe_bf16"


@register(OP, "reference")
def ref_moe_bf16(x, topk_ids, topk_weights, w13, w2, *, per_slot: bool = False,
                 scale: float = 1.0):
    check_routing(OP, x, topk_ids, topk_weights)
    e, _ = check_expert_weights(OP, x, w13, w2, (x.dtype,))
    check_ids_in_range(OP, topk_ids, e)
    return ref_moe(x, topk_ids, topk_weights, lambda i: (w13[i], w2[i]), per_slot=per_slot,
                   scale=scale)


@beam_op("moe_bf16", mutates_args=())
def moe_bf16(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: torch.Tensor, w2: torch.Tensor, *, per_slot: bool = False, scale: float = 1.0,
) -> torch.Tensor:
    return dispatch(OP, x.device, x, topk_ids, topk_weights, w13, w2, per_slot=per_slot,
                    scale=scale)


moe_bf16.register_fake(fake_moe)


# ---------------------------------------------------------------------------- triton
@triton.jit
def _moe_bf16_kernel(a_ptr, w_ptr, out_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr,
                     numel, top_k, num_m, N, K, stride_am, stride_we, stride_wn, stride_om,
                     GATED: tl.constexpr, DIRECT: tl.constexpr, SWAP: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # GATED: h[row] = silu(a @ gate^T) * (a @ up^T), a = x[slot // k], gate/up rows n and N + n.
    # else:  y[slot] = h[row] @ down^T.
    pid_m, pid_n = tile_of(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if past_last_row(pid_m, num_rows_ptr, DIRECT, BLOCK_M):
        return
    expert, slots, valid, rows, a_rows, offs_n, n_mask = block_tile(
        pid_m, pid_n, ids_ptr, sorted_ptr, block_expert_ptr, numel, top_k, N, GATED, DIRECT,
        BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc, acc_up = gemm_loop(a_ptrs, valid, w_ptrs, n_mask, K, N * stride_wn, GATED, SWAP,
                            PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    if GATED:
        out = silu_mul(unswap(acc, SWAP), unswap(acc_up, SWAP), dtype)
        out_rows = rows
    else:
        out = round_to(unswap(acc, SWAP), dtype)
        out_rows = slots
    out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=valid[:, None] & n_mask[None, :])


def _gemm(a, w, out, routing: Routing, numel, top_k, n, k, gated, cfg: GemmConfig):
    grid = (routing.m_blocks * triton.cdiv(n, cfg.block_n),)
    _moe_bf16_kernel[grid](
        a, w, out, *routing_ptrs(routing), numel, top_k, routing.m_blocks, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        GATED=gated, DIRECT=routing.direct, SWAP=cfg.swap, PRECISION=dot_precision(a.dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


@register(OP, "triton")
def moe_bf16_triton(x, topk_ids, topk_weights, w13, w2, direct=None, config13=None, config2=None,
                    *, per_slot: bool = False, scale: float = 1.0):
    """Launcher. `direct` / `config*` override the launch choices (tests and bench/ only)."""
    t, h, top_k = check_routing(OP, x, topk_ids, topk_weights)
    e, inner = check_expert_weights(OP, x, w13, w2, (x.dtype,))
    numel = t * top_k
    if numel == 0:
        return empty_output(x, topk_ids, x.dtype, per_slot)
    direct = numel <= DIRECT_MAX_PAIRS if direct is None else direct
    # FP32 experts: half the K depth, so a pipelined tile takes the shared memory of a BF16 one
    block_k = 128 if x.element_size() <= 2 else 64
    c13, c2 = configs_for(numel if not direct else 1, e, config13, config2, block_k)
    routing = plan_routing(topk_ids, e, c13.block_m, direct)
    x = x.contiguous()
    hbuf = torch.empty((routing.rows, inner), dtype=x.dtype, device=x.device)
    _gemm(x, w13, hbuf, routing, numel, top_k, inner, h, True, c13)
    y = torch.empty((numel, h), dtype=x.dtype, device=x.device)
    _gemm(hbuf, w2, y, routing, numel, top_k, h, inner, False, c2)
    return finish(y, topk_weights, t, per_slot, scale)
