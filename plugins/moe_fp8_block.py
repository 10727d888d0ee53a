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

Prefill on sm_90+ (H and I multiples of 16, I of 128): the activations are quantized into the
token sort's rows, both GEMMs load them and the weights by the TMA, run tail blocks (as
moe_fp8) and read one weight scale per 128x128 block a step; the same products in the same
order as the per-thread kernel (the same bits in the interpreter; on a GPU the tile shape can
change the FP8 MMA's own partial sums, within the kernel tests' tolerance).

Numerics: each 128-deep slice of a dot accumulates in FP32 and is scaled by
x_scale[row, group] * w_scale[n, group]; gate, up, silu and h round to x.dtype before h is
quantized; y rounds to x.dtype; the combine is FP32.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from beam_trtllm.quant_formats import FP8_BLOCK, fake_quant_fp8_per_token_block

from ._fp8_act import (
    ACT_EPS, quant_block_tile, quant_fp8_block_sorted_rows, quant_fp8_per_token_block,
)
from ._checks import check_device
from ._gemm import fp8_block_gemm_loop, round_to, silu_mul, tile_of, tma_block_gemm_loop, unswap
from ._moe_common import (
    DIRECT_MAX_PAIRS, TL_DTYPES, GemmConfig, Routing, block_tile, check_expert_weights,
    check_ids_in_range, check_routing, check_tensor, configs_for, default_config, empty_output,
    fake_moe, finish, past_last_row, plan_routing, ref_moe, routing_ptrs, tail_ptrs,
    tma_descriptors, tma_fits,
)
from .registry import beam_op, dispatch, PluginError, register

OP = "moe_fp8_block"
FP8 = (torch.float8_e4m3fn,)
# TMA prefill launch shapes (gate/up, down). H200, 16K tokens, 2026-12-03 (bench/kernels_moe.py
# --sweep fp8_block:16384): gate/up with the weights on the MMA's M side (moe_fp8's shape)
# 33.0 ms, tokens there 16.2 ms; 64-row blocks 17.9-18.1; down at 4 warps 16.1, 8 warps 16.6.
# Register pressure (sm_90 builds, ptxas, on the CPU): each step's FP32 partial product beside
# the accumulator(s): gate/up 255 registers + 156 bytes of spills (swapped: 780), down at 4
# warps 144 bytes, at 8 warps 158 registers and none (yet the slower of the two).
PREFILL_TMA = (GemmConfig(128, 128, 128, 8, 3, tail_m=64),
               GemmConfig(128, 128, 128, 4, 3, tail_m=64))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dequantize_fp8_row_blocks(weight, scale):
    """weight fp8 [N, K], scale fp32 [N, ceil(K/128)] (one scale per row per 128 columns)
    -> FP32 [N, K]."""
    k = weight.shape[-1]
    return weight.float() * scale.repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]


def check_moe_fp8_block(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale):
    check_routing(OP, x, topk_ids, topk_weights)
    e, inner = check_expert_weights(OP, x, w13, w2, FP8)
    h = x.shape[1]
    check_tensor(OP, "w13_scale", w13_scale, (e, 2 * inner, cdiv(h, FP8_BLOCK)), (torch.float32,))
    check_tensor(OP, "w2_scale", w2_scale, (e, h, cdiv(inner, FP8_BLOCK)), (torch.float32,))
    check_device(OP, x, w13_scale=w13_scale, w2_scale=w2_scale)
    return e, inner


@register(OP, "reference")
def ref_moe_fp8_block(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, *,
                      per_slot: bool = False,
                      scale: float = 1.0):
    e, _ = check_moe_fp8_block(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    check_ids_in_range(OP, topk_ids, e)

    def expert(i):
        return (dequantize_fp8_row_blocks(w13[i], w13_scale[i]),
                dequantize_fp8_row_blocks(w2[i], w2_scale[i]))

    quant = fake_quant_fp8_per_token_block
    return ref_moe(x, topk_ids, topk_weights, expert, quant, quant, per_slot=per_slot,
                   scale=scale)


@beam_op("moe_fp8_block", mutates_args=())
def moe_fp8_block(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    *, per_slot: bool = False, scale: float = 1.0,
) -> torch.Tensor:
    return dispatch(OP, x.device, x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale,
                    per_slot=per_slot, scale=scale)


moe_fp8_block.register_fake(fake_moe)


# ---------------------------------------------------------------------------- triton
@triton.jit
def _moe_fp8_block_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, out_s_ptr,
                          ids_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr,
                          numel, top_k, num_m, N, K, stride_am, stride_asm, stride_we, stride_wn,
                          stride_se, stride_sn, stride_om, stride_osm, eps,
                          ACT: tl.constexpr, GATED: tl.constexpr, DIRECT: tl.constexpr,
                          SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # BLOCK_K = 128: each K step is one scale group; its FP32 partial dot is scaled by
    # a_scale[row, g] * w_scale[n, g]. GATED: BLOCK_N = 128, so the tile holds whole 128-channel
    # groups of h and quantizes them per row in the epilogue (codes + scales for the down GEMM).
    pid_m, pid_n = tile_of(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if past_last_row(pid_m, num_rows_ptr, DIRECT, BLOCK_M):
        return
    expert, slots, valid, rows, a_rows, offs_n, n_mask = block_tile(
        pid_m, pid_n, ids_ptr, sorted_ptr, block_expert_ptr, numel, top_k, N, GATED, DIRECT,
        BLOCK_M, BLOCK_N)
    a_rows = a_rows.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    as_ptrs = as_ptr + a_rows * stride_asm
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    ws_ptrs = ws_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn
    acc, acc_up = fp8_block_gemm_loop(a_ptrs, as_ptrs, valid, w_ptrs, ws_ptrs, n_mask, K,
                                      N * stride_wn, N * stride_sn, GATED, SWAP, BLOCK_M,
                                      BLOCK_N, BLOCK_K)
    _store_tile(acc, acc_up, out_ptr, out_s_ptr + rows.to(tl.int64) * stride_osm + pid_n, rows,
                slots, valid, offs_n, n_mask, stride_om, eps, ACT, GATED, SWAP)


@triton.jit
def _store_tile(acc, acc_up, out_ptr, out_s_ptrs, rows, slots, valid, offs_n, n_mask, stride_om,
                eps, ACT: tl.constexpr, GATED: tl.constexpr, SWAP: tl.constexpr):
    """The epilogue of both launches. GATED: h's FP8 codes into its rows and their one scale
    each into out_s_ptrs (the tile is one 128-channel group). Else y[slot] in out's dtype."""
    out_mask = valid[:, None] & n_mask[None, :]
    if GATED:
        h = silu_mul(unswap(acc, SWAP), unswap(acc_up, SWAP), ACT)  # masked columns are 0
        codes, scale = quant_block_tile(h, eps)
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, codes, mask=out_mask)
        tl.store(out_s_ptrs, scale, mask=valid)
    else:
        out_ptrs = out_ptr + slots.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        out = round_to(unswap(acc, SWAP), ACT)
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def _gemm(a, a_s, w, ws, out, out_s, routing: Routing, numel, top_k, n, k, gated, act,
          cfg: GemmConfig):
    if cfg.block_k != FP8_BLOCK or (gated and cfg.block_n != FP8_BLOCK):
        raise PluginError(f"beam::{OP}: block_k (and block_n of gate/up) must be {FP8_BLOCK}")
    grid = (routing.m_blocks * triton.cdiv(n, cfg.block_n),)
    _moe_fp8_block_kernel[grid](
        a, a_s, w, ws, out, out_s, *routing_ptrs(routing), numel, top_k, routing.m_blocks, n, k,
        a.stride(0), a_s.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1),
        out.stride(0), out_s.stride(0), ACT_EPS, ACT=TL_DTYPES[act], GATED=gated,
        DIRECT=routing.direct, SWAP=cfg.swap, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


@triton.jit
def _moe_fp8_block_tma_kernel(a_desc, a_tail_desc, as_ptr, w_desc, ws_ptr, out_ptr, out_s_ptr,
                              ids_ptr, sorted_ptr, block_expert_ptr, block_start_ptr,
                              block_rows_ptr, numel, top_k, num_m, N, K, rows_total, w_rows,
                              stride_se, stride_sn, stride_om, eps, ACT: tl.constexpr,
                              GATED: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, TAIL_M: tl.constexpr):
    # Activation rows in sorted order (codes [rows, K], scales [groups, rows]); weights as
    # [E * w_rows, K]. A tail block runs on a TAIL_M-row tile (weights on the M side as the
    # full blocks': with SWAP the prefill took twice as long, H200 2026-12-03).
    pid_m, pid_n = tile_of(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if tl.load(block_expert_ptr + pid_m) < 0:  # idle block
        return
    row0 = tl.load(block_start_ptr + pid_m)
    if tl.load(block_rows_ptr + pid_m) == TAIL_M:
        tail = block_tile(pid_m, pid_n, ids_ptr, sorted_ptr, block_expert_ptr, numel, top_k, N,
                          GATED, False, TAIL_M, BLOCK_N, block_start_ptr, True)
        _tma_tile(tail, a_tail_desc, row0, as_ptr, w_desc, ws_ptr, out_ptr, out_s_ptr, N, K,
                  rows_total, w_rows, stride_se, stride_sn, stride_om, eps, ACT, GATED, SWAP,
                  TAIL_M, BLOCK_N, BLOCK_K)
    else:
        full = block_tile(pid_m, pid_n, ids_ptr, sorted_ptr, block_expert_ptr, numel, top_k, N,
                          GATED, False, BLOCK_M, BLOCK_N, block_start_ptr, True)
        _tma_tile(full, a_desc, row0, as_ptr, w_desc, ws_ptr, out_ptr, out_s_ptr, N, K,
                  rows_total, w_rows, stride_se, stride_sn, stride_om, eps, ACT, GATED, SWAP,
                  BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _tma_tile(tile, a_desc, row0, as_ptr, w_desc, ws_ptr, out_ptr, out_s_ptr, N, K, rows_total,
              w_rows, stride_se, stride_sn, stride_om, eps, ACT: tl.constexpr,
              GATED: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program's tile of the TMA launch: the K loop, the epilogue and the store."""
    expert, slots, valid, rows, _, offs_n, n_mask = tile
    n0 = tl.min(offs_n)
    as_ptrs = as_ptr + row0 + tl.arange(0, BLOCK_M)
    ws_ptr = ws_ptr + expert * stride_se + n0 * stride_sn
    w_row0 = (expert * w_rows).to(tl.int32) + n0
    acc, acc_up = tma_block_gemm_loop(a_desc, row0, as_ptrs, rows_total, valid, w_desc, w_row0,
                                      ws_ptr, N, N * stride_sn, K, GATED, SWAP, BLOCK_M, BLOCK_N,
                                      BLOCK_K)
    _store_tile(acc, acc_up, out_ptr, out_s_ptr + n0 // BLOCK_N * rows_total + rows, rows, slots,
                valid, offs_n, n_mask, stride_om, eps, ACT, GATED, SWAP)


def _tma_gemm(a, a_s, w, ws, out, out_s, routing: Routing, numel, top_k, n, k, gated, act,
              cfg: GemmConfig):
    if cfg.block_k != FP8_BLOCK or FP8_BLOCK % cfg.block_n or (gated and cfg.block_n != FP8_BLOCK):
        raise PluginError(f"beam::{OP}: TMA tiles take block_k {FP8_BLOCK} and a block_n "
                          f"dividing it ({FP8_BLOCK} for gate/up), not {cfg}")
    grid = (routing.m_blocks * triton.cdiv(n, cfg.block_n),)
    a_desc, a_tail_desc, w_desc = tma_descriptors(a, w, routing, cfg, True)
    _moe_fp8_block_tma_kernel[grid](
        a_desc, a_tail_desc, a_s, w_desc, ws, out, out_s, *routing_ptrs(routing)[:3],
        *tail_ptrs(routing), numel, top_k, routing.m_blocks, n, k, routing.rows, w.shape[1],
        ws.stride(0), ws.stride(1), out.stride(0), ACT_EPS, ACT=TL_DTYPES[act], GATED=gated,
        SWAP=cfg.swap, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, TAIL_M=routing.tail_m, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _tma_possible(x, w13, w2, inner, configs) -> bool:
    """Whether the TMA prefill runs: I a multiple of 128 (whole scale blocks per tile), tail
    blocks, and `tma_fits`."""
    return (inner % FP8_BLOCK == 0 and all(c.tail_m for c in configs)
            and tma_fits(x, configs, w13, w2))


def _tma_experts(x, w13, w13_scale, w2, w2_scale, routing: Routing, numel, top_k, inner, c13,
                 c2):
    """Both GEMMs of the TMA prefill -> y [numel, H] (slot order)."""
    h = x.shape[1]
    xq, xs = quant_fp8_block_sorted_rows(x, routing.slot_rows, routing.rows)
    hq = torch.empty((routing.rows, inner), dtype=FP8[0], device=x.device)
    hs = torch.empty((cdiv(inner, FP8_BLOCK), routing.rows), dtype=torch.float32,
                     device=x.device)
    _tma_gemm(xq, xs, w13, w13_scale, hq, hs, routing, numel, top_k, inner, h, True, x.dtype,
              c13)
    y = torch.empty((numel, h), dtype=x.dtype, device=x.device)
    _tma_gemm(hq, hs, w2, w2_scale, y, hs, routing, numel, top_k, h, inner, False, x.dtype, c2)
    return y


def block_configs(numel, e, config13, config2):
    c13, c2 = configs_for(numel, e, config13, config2)
    if config13 is None:  # gate/up tiles must cover whole 128-channel groups of h
        c13 = dataclasses.replace(c13, block_n=FP8_BLOCK)
        if c13.block_m > 64:  # two 128-wide FP32 accumulators: 64-row blocks keep them in registers
            c13 = dataclasses.replace(c13, block_m=64, num_warps=8)
            c2 = dataclasses.replace(c2, block_m=64, block_n=64, num_warps=4, num_stages=4)
    return c13, c2


@register(OP, "triton")
def moe_fp8_block_triton(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, direct=None,
                         config13=None, config2=None, tma=None, *, per_slot: bool = False,
                         scale: float = 1.0):
    """Launcher. `direct` / `config*` / `tma` override the launch choices (tests and bench/
    only; `tma` needs the sorted layout, tail blocks and I a multiple of 128)."""
    e, inner = check_moe_fp8_block(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    t, h = x.shape
    top_k = topk_ids.shape[1]
    numel = t * top_k
    if numel == 0:
        return empty_output(x, topk_ids, x.dtype, per_slot)
    direct = numel <= DIRECT_MAX_PAIRS if direct is None else direct
    prefill = not direct and (bool(config13.tail_m) if config13 is not None
                              else default_config(numel, e, True).block_m == 128)
    if (prefill if tma is None else tma) and not direct:
        c13, c2 = configs_for(numel, e, config13 or PREFILL_TMA[0], config2 or PREFILL_TMA[1],
                              tails=True)
        if _tma_possible(x, w13, w2, inner, (c13, c2)):
            routing = plan_routing(topk_ids, e, c13.block_m, False, c13.tail_m)
            y = _tma_experts(x, w13, w13_scale, w2, w2_scale, routing, numel, top_k, inner,
                             c13, c2)
            return finish(y, topk_weights, t, per_slot, scale)
    if tma:  # asked for, and not possible
        raise PluginError(f"beam::{OP}: tma=True needs sorted rows (not direct), a device with "
                          f"a TMA, I % {FP8_BLOCK} == 0, tail blocks and TMA-addressable weights")
    c13, c2 = block_configs(numel if not direct else 1, e, config13, config2)
    routing = plan_routing(topk_ids, e, c13.block_m, direct)
    xq, xs = quant_fp8_per_token_block(x)
    hq = torch.empty((routing.rows, inner), dtype=FP8[0], device=x.device)
    hs = torch.empty((routing.rows, cdiv(inner, FP8_BLOCK)), dtype=torch.float32, device=x.device)
    _gemm(xq, xs, w13, w13_scale, hq, hs, routing, numel, top_k, inner, h, True, x.dtype, c13)
    y = torch.empty((numel, h), dtype=x.dtype, device=x.device)
    _gemm(hq, hs, w2, w2_scale, y, hs, routing, numel, top_k, h, inner, False, x.dtype, c2)
    return finish(y, topk_weights, t, per_slot, scale)
