"""beam::moe_fp8 — routed experts with FP8 per-tensor weights and static FP8 activations (W8A8).

    out[t] = sum_j w[t, j] * down_e(q2(silu(gate_e(q13(x[t]))) * up_e(q13(x[t]))))
    q_s(a) = fp8_e4m3(clamp(a / s, +-448)) * s     (static per-tensor activation quantizer)
    gate_e / up_e / down_e use W = fp8 weight * its per-tensor scale

Inputs (repacked expert layout of docs/DESIGN.md §2):
    x [T, H] bf16 / fp16 / fp32, or float8_e4m3fn holding the codes fp8(clamp(x / a13_scale,
             +-448)) already (what beam::add_rmsnorm_fp8 writes: the quantizer's launch is saved)
    topk_ids [T, k] int32/int64; topk_weights [T, k] fp32
    w13        [E, 2I, H] float8_e4m3fn   rows [0, I) gate_proj, [I, 2I) up_proj
    w13_scale  [E, 2I]    fp32            each matrix's weight_scale repeated over its rows
    w2         [E, H, I]  float8_e4m3fn; w2_scale [E, H] fp32
    a13_scale  []         fp32            the layer's shared gate/up input_scale
    a2_scale   []         fp32            the layer's shared down_proj input_scale
    out_dtype  None for a floating x (the activations' dtype is x's), required for FP8 codes
Output: a new [T, H] tensor in that dtype (no `out=`; inputs are never written).

Numerics: FP8 x FP8 products are summed on the tensor cores, promoted to the FP32 accumulator
every BLOCK_K (Hopper's FP8 MMA accumulates with reduced precision; Triton's default would
never promote: max_num_imprecise_acc), and the FP32 sum is scaled by a_scale * w_scale; gate, up, silu and h round to x.dtype (as the reference's modules do) before
h is quantized with a2_scale; y rounds to x.dtype; the combine is FP32.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from beam_trtllm.quant_formats import dequantize_fp8, fake_quant_fp8_activation

from ._common import div_rn_by, to_e4m3
from ._fp8_act import quant_fp8_per_tensor, quant_fp8_sorted_rows
from ._checks import ACT_DTYPES, check_device, check_out_dtype
from ._gemm import gemm_loop, round_to, silu_mul, tile_of, tma_gemm_loop, unswap
from ._moe_common import (
    DIRECT_MAX_PAIRS, TL_DTYPES, GemmConfig, Routing, block_tile, check_expert_weights,
    check_ids_in_range, check_routing, check_tensor, configs_for, empty_output, finish,
    overlap_launch, pair_overlap, past_last_row, plan_routing, ref_moe, routing_ptrs,
    signal_ready, tail_ptrs, takes_tma, tma_descriptors, wait_for_pair,
)
from ._pdl import let_next_launch
from .registry import beam_op, dispatch, register
from .tuning import tuned_moe

OP = "moe_fp8"
# Prefill: an expert's last <= 64 rows take a 64-row tail block, not a padded 128-row one
# (_moe_sort.py). H200, 16K tokens (2026-11-29, commit 4ae389e): sorted rows 1.126 -> 1.059 x
# the pairs, 14.46-14.51 -> 14.24 ms; 32-row tails 14.26-14.32 ms.
PREFILL_TAIL_M = 64
FP8 = (torch.float8_e4m3fn,)
# One token's gate/up (<= DECODE_PAIRS pairs): 32 weight rows of each of gate and up a program
# (640 programs for Beam's 8 x 2560) over 256-deep steps, 3 stages. In the H200 engine bench's
# chained layers 2.5-3 us faster than the shared 64-row, 128-deep, 4-stage shape (0.1231-0.1238
# against 0.1260-0.1277 ms a sliding MoE layer; 2026-11-30, commit 8c54f83: see
# docs/benchmarks-history.md);
# the down GEMM keeps the shared shape (32- or 64-row 256-deep variants were slower).
DECODE_PAIRS = 8
DECODE_GATE_UP = GemmConfig(16, 32, 256, 4, 3, swap=True)


def check_moe_fp8(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, a13_scale, a2_scale,
                  out_dtype=None):
    """-> (E, I, the activations' dtype)."""
    check_routing(OP, x, topk_ids, topk_weights, ACT_DTYPES + FP8)
    act = check_out_dtype(OP, x, out_dtype)
    e, inner = check_expert_weights(OP, x, w13, w2, FP8)
    check_tensor(OP, "w13_scale", w13_scale, (e, 2 * inner), (torch.float32,))
    check_tensor(OP, "w2_scale", w2_scale, (e, x.shape[1]), (torch.float32,))
    check_tensor(OP, "a13_scale", a13_scale, (), (torch.float32,))
    check_tensor(OP, "a2_scale", a2_scale, (), (torch.float32,))
    check_device(OP, x, w13_scale=w13_scale, w2_scale=w2_scale, a13_scale=a13_scale,
                 a2_scale=a2_scale)
    return e, inner, act


@register(OP, "reference")
def ref_moe_fp8(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, a13_scale, a2_scale,
                out_dtype=None, *, per_slot: bool = False,
                scale: float = 1.0):
    e, _, act = check_moe_fp8(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, a13_scale,
                              a2_scale, out_dtype)
    check_ids_in_range(OP, topk_ids, e)
    codes = x.dtype in FP8  # then x's decoded values are exactly what the quantizer gives
    quant13 = (lambda a: a) if codes else (lambda a: fake_quant_fp8_activation(a, a13_scale))

    def expert(i):
        return dequantize_fp8(w13[i], w13_scale[i]), dequantize_fp8(w2[i], w2_scale[i])

    return ref_moe(
        x.float() * a13_scale if codes else x, topk_ids, topk_weights, expert, quant13,
        lambda a: fake_quant_fp8_activation(a, a2_scale), act_dtype=act, per_slot=per_slot,
        scale=scale,
    )


@beam_op("moe_fp8", mutates_args=())
def moe_fp8(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    a13_scale: torch.Tensor, a2_scale: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
    *, per_slot: bool = False, scale: float = 1.0,
) -> torch.Tensor:
    return dispatch(OP, x.device, x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale,
                    a13_scale, a2_scale, out_dtype, per_slot=per_slot, scale=scale)


@moe_fp8.register_fake
def _(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, a13_scale, a2_scale, out_dtype=None,
      *, per_slot=False, scale=1.0):
    act = check_moe_fp8(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, a13_scale,
                        a2_scale, out_dtype)[2]
    return empty_output(x, topk_ids, act, per_slot)


# ---------------------------------------------------------------------------- triton
@triton.jit
def _moe_fp8_kernel(a_ptr, a_desc, a_tail_desc, a_scale_ptr, w_ptr, w_desc, ws_ptr, out_ptr,
                    out_scale_ptr, flags_ptr, ready_count, ids_ptr, sorted_ptr,
                    block_expert_ptr, num_rows_ptr, block_start_ptr, block_rows_ptr, numel,
                    top_k, num_m, N, K, stride_am, stride_we, stride_wn, stride_se, stride_om,
                    ACT: tl.constexpr, GATED: tl.constexpr, DIRECT: tl.constexpr,
                    SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TAIL_M: tl.constexpr,
                    TMA: tl.constexpr, OVERLAP: tl.constexpr, PDL: tl.constexpr):
    # FP8 x FP8 on the tensor cores, promoted to FP32 every BLOCK_K, then * a_scale * w_scale[n].
    # GATED: h = silu(gate) * up (rounded to ACT as the reference), stored as FP8 codes of
    # h / out_scale (the down projection's static input scale). Else y[slot] in out's dtype.
    # TAIL_M: row blocks come from block_start / block_rows; a tail block runs on a TAIL_M-row
    # tile with the weights on the MMA's M side.
    # TMA (tail-block layouts only): activation rows already in sorted order (a_ptr is indexed
    # by sorted row) and weights as [E * N_total, K], all loaded by the TMA.
    # OVERLAP (direct pairs): the down GEMM launches early (PDL) and each of its programs waits
    # for its pair's h tiles, which gate/up counts in flags_ptr (_moe_common). The down GEMM
    # lets the next kernel (the boundary norm, in the decode chain: _pdl.py) launch early.
    let_next_launch(OVERLAP and PDL)
    pid_m, pid_n = tile_of(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if TAIL_M == 0:
        if past_last_row(pid_m, num_rows_ptr, DIRECT, BLOCK_M):
            return
        tile = block_tile(pid_m, pid_n, ids_ptr, sorted_ptr, block_expert_ptr, numel, top_k, N,
                          GATED, DIRECT, BLOCK_M, BLOCK_N)
        if OVERLAP and not GATED:  # (direct: block pid_m is pair pid_m)
            wait_for_pair(flags_ptr, pid_m, ready_count, tl.cdiv(N, BLOCK_N), num_m, PDL)
        _fp8_tile(tile, a_ptr, a_desc, 0, a_scale_ptr, w_ptr, w_desc, ws_ptr, out_ptr,
                  out_scale_ptr, N, K, stride_am, stride_we, stride_wn, stride_se, stride_om, ACT,
                  GATED, SWAP, False, BLOCK_M, BLOCK_N, BLOCK_K)
        if OVERLAP and GATED:
            signal_ready(flags_ptr, pid_m)
    else:
        if tl.load(block_expert_ptr + pid_m) < 0:  # idle block
            return
        row0 = tl.load(block_start_ptr + pid_m)
        if tl.load(block_rows_ptr + pid_m) == TAIL_M:
            tail = block_tile(pid_m, pid_n, ids_ptr, sorted_ptr, block_expert_ptr, numel, top_k,
                              N, GATED, False, TAIL_M, BLOCK_N, block_start_ptr, True)
            _fp8_tile(tail, a_ptr, a_tail_desc, row0, a_scale_ptr, w_ptr, w_desc, ws_ptr,
                      out_ptr, out_scale_ptr, N, K, stride_am, stride_we, stride_wn, stride_se,
                      stride_om, ACT, GATED, True, TMA, TAIL_M, BLOCK_N, BLOCK_K)
        else:
            full = block_tile(pid_m, pid_n, ids_ptr, sorted_ptr, block_expert_ptr, numel, top_k,
                              N, GATED, False, BLOCK_M, BLOCK_N, block_start_ptr, True)
            _fp8_tile(full, a_ptr, a_desc, row0, a_scale_ptr, w_ptr, w_desc, ws_ptr, out_ptr,
                      out_scale_ptr, N, K, stride_am, stride_we, stride_wn, stride_se,
                      stride_om, ACT, GATED, SWAP, TMA, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _fp8_tile(tile, a_ptr, a_desc, a_row0, a_scale_ptr, w_ptr, w_desc, ws_ptr, out_ptr,
              out_scale_ptr, N, K, stride_am, stride_we, stride_wn, stride_se, stride_om,
              ACT: tl.constexpr, GATED: tl.constexpr, SWAP: tl.constexpr, TMA: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program's tile (`block_tile`'s tuple): the K loop, the epilogue and the store."""
    expert, slots, valid, rows, a_rows, offs_n, n_mask = tile
    if TMA:
        w_row0 = (expert * (stride_we // stride_wn)).to(tl.int32) + tl.min(offs_n)
        acc, acc_up = tma_gemm_loop(a_desc, a_row0, w_desc, w_row0, N, K, GATED, SWAP, BLOCK_M,
                                    BLOCK_N, BLOCK_K)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        w_ptrs = (w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
                  + offs_k[None, :])
        acc, acc_up = gemm_loop(a_ptrs, valid, w_ptrs, n_mask, K, N * stride_wn, GATED, SWAP,
                                "fp8", BLOCK_M, BLOCK_N, BLOCK_K)
    a_scale = tl.load(a_scale_ptr)
    ws_ptrs = ws_ptr + expert * stride_se + offs_n
    gate = unswap(acc, SWAP) * a_scale * tl.load(ws_ptrs, mask=n_mask, other=0.0)[None, :]
    if GATED:
        up = unswap(acc_up, SWAP) * a_scale * tl.load(ws_ptrs + N, mask=n_mask, other=0.0)[None, :]
        out = to_e4m3(div_rn_by(silu_mul(gate, up, ACT), tl.load(out_scale_ptr)))
        out_rows = rows
    else:
        out = round_to(gate, ACT)
        out_rows = slots
    out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _gemm(a, a_scale, w, ws, out, out_scale, routing: Routing, numel, top_k, n, k, gated,
          act, cfg: GemmConfig, tma: bool = False, overlap=None):
    """One grouped GEMM launch. overlap: `_moe_common.pair_overlap`'s (direct pairs), or None."""
    grid = (routing.m_blocks * triton.cdiv(n, cfg.block_n),)
    a_desc, a_tail_desc, w_desc = tma_descriptors(a, w, routing, cfg, tma)
    flags, ready_count, overlap_kw = overlap_launch(overlap, a.device, cfg.group_m, gated)
    _moe_fp8_kernel[grid](
        a, a_desc, a_tail_desc, a_scale, w, w_desc, ws, out, out_scale, flags, ready_count,
        *routing_ptrs(routing), *tail_ptrs(routing), numel, top_k, routing.m_blocks, n, k,
        a.stride(0), w.stride(0), w.stride(1), ws.stride(0), out.stride(0), ACT=TL_DTYPES[act],
        GATED=gated, DIRECT=routing.direct, SWAP=cfg.swap, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, TAIL_M=routing.tail_m, TMA=tma, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **overlap_kw,
    )


@register(OP, "triton")
def moe_fp8_triton(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, a13_scale, a2_scale,
                   out_dtype=None, direct=None, config13=None, config2=None, tma=None,
                   overlap=True, *, per_slot: bool = False,
                   scale: float = 1.0):
    """Launcher. `direct` / `config*` / `tma` override the launch choices (tests and bench/
    only; `tma` needs a tail-block layout); overlap=False runs direct pairs' down GEMM after
    all of gate/up."""
    e, inner, act = check_moe_fp8(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale,
                                  a13_scale, a2_scale, out_dtype)
    t, h = x.shape
    top_k = topk_ids.shape[1]
    numel = t * top_k
    if numel == 0:
        return empty_output(x, topk_ids, act, per_slot)
    direct = numel <= DIRECT_MAX_PAIRS if direct is None else direct
    config13, config2 = tuned_moe(OP, numel, e, inner, h, config13, config2)
    if config13 is None and numel <= DECODE_PAIRS:
        config13 = DECODE_GATE_UP
    c13, c2 = configs_for(numel if not direct else 1, e, config13, config2, tails=True)
    if config13 is None and c13.block_m == 128:  # prefill: the H200 sweeps' best shapes
        tail_m = PREFILL_TAIL_M if config2 is None else config2.tail_m  # one token sort
        c13 = GemmConfig(128, 128, 128, 8, 3, swap=True, tail_m=tail_m)
        if config2 is None:  # 4 warps: 14.42 vs 14.67 ms at 16K tokens (BENCHMARKS, run 4)
            c2 = GemmConfig(128, 128, 128, 4, 3, tail_m=tail_m)
    routing = plan_routing(topk_ids, e, c13.block_m, direct, 0 if direct else c13.tail_m)
    tma = takes_tma(x, routing, (c13, c2), x, w13, w2) if tma is None else tma
    if tma:  # the activations gathered into sorted rows as they are quantized
        xq = quant_fp8_sorted_rows(x, a13_scale, routing.slot_rows, routing.rows)
    else:
        xq = x.contiguous() if x.dtype in FP8 else quant_fp8_per_tensor(x, a13_scale)
    hq = torch.empty((routing.rows, inner), dtype=FP8[0], device=x.device)
    overlap = pair_overlap(x.device, routing, numel, triton.cdiv(inner, c13.block_n)) \
        if overlap else None
    _gemm(xq, a13_scale, w13, w13_scale, hq, a2_scale, routing, numel, top_k, inner, h, True,
          act, c13, tma, overlap)
    y = torch.empty((numel, h), dtype=act, device=x.device)
    _gemm(hq, a2_scale, w2, w2_scale, y, a2_scale, routing, numel, top_k, h, inner, False,
          act, c2, tma, overlap)
    return finish(y, topk_weights, t, per_slot, scale)
