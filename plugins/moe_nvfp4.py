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

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from beam_trtllm.quant_formats import NVFP4_BLOCK, dequantize_nvfp4

from ._checks import _expect, check_device
from ._gemm import dot_precision, round_to, silu_mul, tile_of, unswap
from ._moe_common import (
    DIRECT_MAX_PAIRS, TMA_MAX_BOX, GemmConfig, Routing, block_tile, check_expert_weights,
    check_ids_in_range, check_routing, check_tensor, combine_if_last, combine_tickets,
    configs_for, empty_output, fake_moe, finish, has_tma, overlap_launch, pair_overlap,
    past_last_row, plan_routing, ref_moe, routing_ptrs, signal_ready, tma_addressable,
    wait_for_pair,
)
from ._pdl import let_next_launch
from ._tiles import A_SIDE_PAIRS, nvfp4_k_loop, nvfp4_side, pairs_position
from .registry import beam_op, dispatch, register, triton_interpreted
from .tuning import tuned_moe

OP = "moe_nvfp4"
FP8 = (torch.float8_e4m3fn,)
# Decode launch shape (weights on the MMA's M side): 32-row weight tiles on 2 warps (mma.sync)
# keep twice as many programs in flight as 64-row warpgroup tiles, 3 stages (H200 sweep,
# 2026-11-29, commit 878db86, T=1: 126 us at 64 rows / 4 warps / 4 stages -> ~100 us); 8-token
# blocks (one pair each in direct mode) halve the MMAs and the activation fragments a K step
# against 16 (gate/up loop 555 -> 502 SASS instructions; T=1 94.7 -> 85.7 us).
DECODE = GemmConfig(8, 32, 128, 2, 3, swap=True)
# With the TMA (sm_90+): 256-deep K steps whose words and block scales the TMA loads into
# swizzled shared memory (no per-thread copies and their address registers; the per-thread
# copies' 64-byte rows read back with 4-way bank conflicts), direct pairs' activations as one
# row, and 16-row one-warp tiles (twice the programs; the smaller tile's shared memory now
# fits them). H200, T=1, 2026-11-30, commit 960c289: 83.1 us (DECODE) -> 71.2 (TMA, 32 rows / 2
# warps) -> 68.7 (one activation row) -> 66.8 (16 rows / 1 warp; 512 deep 66.4, 4 stages 68.1).
# Sorted blocks (more pairs than direct mode takes) keep 32 rows / 2 warps: T=64 1,092 us
# against 1,207 with 16 rows (and 1,184 with DECODE's 128-deep steps).
DECODE_TMA = GemmConfig(8, 16, 256, 1, 3, swap=True)
DECODE_TMA_SORTED = GemmConfig(8, 32, 256, 2, 3, swap=True)
# Direct pairs' gate/up over K % 512 == 0 (Beam: H = 5120) takes 512-deep steps on 32-row /
# 2-warp tiles: half the loop's per-step TMA, barrier and stage bookkeeping a weight (gate/up
# loop 821 SASS instructions a warp per 256 deep -> 746); T=1 64.7-65.2 -> 63.1-63.8 us (16
# rows / 1 warp at 512: 63.5-64.0; 1024 deep: 82-91, it spills). The down GEMM stays at 256:
# its 2560 programs must fit one wave, and 512-deep stages do not (69.4 us).
DECODE_TMA_GATE_UP = GemmConfig(8, 32, 512, 2, 3, swap=True)
# Prefill (128-row token blocks): gate/up with the weights on the MMA's M side (and their
# words by the TMA), down over 64-deep steps, 4 stages. H200, 16K tokens, 2026-12-03
# (bench/kernels_moe.py --sweep nvfp4:16384): 38.6 ms with the shared (128, 64, 128) /
# (128, 128, 128) shapes -> 30.1 (gate/up) -> 28.2 ms (down).
PREFILL = (GemmConfig(128, 128, 128, 8, 3, swap=True), GemmConfig(128, 128, 64, 8, 4))


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
    check_device(OP, x, w13_scale=w13_scale, w13_scale_2=w13_scale_2, w2_scale=w2_scale,
                 w2_scale_2=w2_scale_2)
    return e, inner


@register(OP, "reference")
def ref_moe_nvfp4(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                  *, per_slot: bool = False,
                  scale: float = 1.0):
    e, _ = check_moe_nvfp4(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale,
                           w2_scale_2)
    check_ids_in_range(OP, topk_ids, e)

    def expert(i):
        return (dequantize_nvfp4(w13[i], w13_scale[i], w13_scale_2[i]),
                dequantize_nvfp4(w2[i], w2_scale[i], w2_scale_2[i]))

    identity = lambda a: a  # noqa: E731  (W4A16: activations are not quantized)
    return ref_moe(x, topk_ids, topk_weights, expert, identity, identity, per_slot=per_slot,
                   scale=scale)


@beam_op("moe_nvfp4", mutates_args=())
def moe_nvfp4(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: torch.Tensor, w13_scale: torch.Tensor, w13_scale_2: torch.Tensor,
    w2: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2: torch.Tensor, *, per_slot: bool = False,
    scale: float = 1.0,
) -> torch.Tensor:
    return dispatch(OP, x.device, x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2,
                    w2, w2_scale, w2_scale_2, per_slot=per_slot, scale=scale)


moe_nvfp4.register_fake(fake_moe)


# ---------------------------------------------------------------------------- triton
@triton.jit
def _moe_nvfp4_kernel(a_ptr, w_ptr, w_desc, ws_ptr, s_desc, ws2_ptr, out_ptr, tw_ptr, comb_ptr,
                      tickets_ptr, flags_ptr, ready_count, ids_ptr, sorted_ptr, block_expert_ptr,
                      num_rows_ptr, numel, top_k, num_m, N, K, stride_am, stride_we, stride_wn,
                      stride_se, stride_sn, stride_om, scale, GATED: tl.constexpr,
                      DIRECT: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr, SIDE: tl.constexpr,
                      EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, TMA_W: tl.constexpr, TMA_S: tl.constexpr,
                      ONE_ROW: tl.constexpr, PAIRS_ORDER_OUT: tl.constexpr,
                      COMBINE: tl.constexpr, TOP_K: tl.constexpr, OVERLAP: tl.constexpr,
                      PDL: tl.constexpr):
    # As moe_bf16's kernel, with each weight tile decoded from NVFP4 on the fly (W4A16; w_ptr is
    # read as int32 words, strides in words) and 2^8 * the expert's global scale applied to the
    # FP32 accumulators. TMA_W / TMA_S: words / block scales by the TMA (w_desc, s_desc: 2-D
    # over all experts' rows; an expert's rows start at expert * stride_we / stride_wn).
    # PAIRS_ORDER_OUT (gate/up): h's columns stored in the code-pair decode's K order, which
    # the down GEMM then takes as is (SIDE A_SIDE_PAIRS_ORDERED). COMBINE (down, direct pairs):
    # the last program of a token's column tile also combines the token's slots into comb_ptr.
    # OVERLAP (direct pairs): gate/up counts each pair's stored h tiles in flags_ptr, the down
    # GEMM (launched early with PDL) waits for ready_count of its pair's (_moe_common). The
    # down GEMM lets the next kernel (the boundary norm, in the decode chain) launch early.
    let_next_launch(OVERLAP and PDL)
    pid_m, pid_n = tile_of(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if past_last_row(pid_m, num_rows_ptr, DIRECT, BLOCK_M):
        return
    expert, slots, valid, rows, a_rows, offs_n, n_mask = block_tile(
        pid_m, pid_n, ids_ptr, sorted_ptr, block_expert_ptr, numel, top_k, N, GATED, DIRECT,
        BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // 8)
    offs_ks = tl.arange(0, BLOCK_K // 16)
    rows_n = offs_n.to(tl.int64)[:, None]
    if ONE_ROW:  # a direct pair's one activation row (the MMA's other 7 token columns repeat
        # it; their outputs are never stored)
        a_row = pid_m // top_k if GATED else pid_m  # (direct: block pid_m is pair pid_m)
        a_ptrs = a_ptr + a_row.to(tl.int64) * stride_am + offs_k[None, :]
    else:
        a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + rows_n * stride_wn + offs_kw[None, :]
    s_ptrs = ws_ptr + expert * stride_se + rows_n * stride_sn + offs_ks[None, :]
    row_step_w, row_step_s = N * stride_wn, N * stride_sn  # gate row n -> up row N + n
    scale_2 = tl.load(ws2_ptr + expert) * 256.0  # (before the loop: expert not live across it)
    if OVERLAP and not GATED:  # (direct: block pid_m is pair pid_m)
        wait_for_pair(flags_ptr, pid_m, ready_count, tl.cdiv(N, BLOCK_N), num_m, PDL)
    acc, acc_up = nvfp4_k_loop(a_ptrs, w_ptrs, s_ptrs, valid, n_mask, row_step_w, row_step_s, K,
                               GATED, EVEN_K, SWAP, ASM, SIDE, PRECISION, BLOCK_M, BLOCK_N,
                               BLOCK_K, w_desc, s_desc,
                               (expert * (stride_we // stride_wn) + pid_n * BLOCK_N).to(tl.int32),
                               N, TMA_W, TMA_S, ONE_ROW)
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    out_cols = offs_n
    if GATED:
        out = silu_mul(unswap(acc, SWAP) * scale_2, unswap(acc_up, SWAP) * scale_2, out_dtype)
        out_rows = rows
        if PAIRS_ORDER_OUT:
            out_cols = pairs_position(offs_n)
    else:
        out = round_to(unswap(acc, SWAP) * scale_2, out_dtype)
        out_rows = slots
    out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * stride_om + out_cols[None, :]
    tl.store(out_ptrs, out.to(out_dtype), mask=valid[:, None] & n_mask[None, :])
    if OVERLAP and GATED:
        signal_ready(flags_ptr, pid_m)
    if COMBINE:  # (direct: block pid_m is pair pid_m of token pid_m // top_k)
        combine_if_last(out_ptr, tw_ptr, comb_ptr, tickets_ptr, pid_m // TOP_K, pid_n,
                        tl.cdiv(N, BLOCK_N), offs_n, n_mask, N, scale, TOP_K)


def use_asm(dtype: torch.dtype) -> bool:
    """The PTX decoder: BF16 activations on a GPU (the interpreter runs the plain decoder)."""
    return dtype == torch.bfloat16 and not triton_interpreted()


def takes_tma(x: torch.Tensor, k: int, cfg: GemmConfig, w: torch.Tensor,
              w_scale: torch.Tensor) -> tuple[bool, bool]:
    """(words by the TMA, block scales by the TMA) for one GEMM: decode launch shapes (weights
    on the MMA's M side) over whole K tiles, a device with a TMA (sm_90+; the interpreter
    emulates it), one TMA copy a tile (<= 256 rows and columns, >= 16 bytes a row) and
    operands it can address (contiguous, 16-byte aligned, rows a multiple of 16 bytes). The
    scales need 256-deep K tiles (16 scale bytes a row)."""
    if not cfg.swap or k % cfg.block_k or cfg.block_k < 32 or cfg.block_n > TMA_MAX_BOX \
            or cfg.block_k // 8 > TMA_MAX_BOX:
        return False, False
    words = has_tma(x.device) and tma_addressable(w)
    return words, words and cfg.block_k % 256 == 0 and tma_addressable(w_scale)


def tma_descriptor(m: torch.Tensor, rows: int, cols: int):
    """A TMA descriptor over m's [E * rows, last dim] 2-D view, copying [rows, cols] boxes."""
    flat = m.view(-1, m.shape[-1])
    return TensorDescriptor(flat, list(flat.shape), [flat.stride(0), 1], [rows, cols])


def takes_pairs_order(cfg2: GemmConfig, inner: int) -> bool:
    """Whether gate/up stores h at `pairs_position` for the down GEMM (launch shape cfg2) to
    take as is: that GEMM decodes code pairs, and h's rows and its K tiles are whole 64-element
    chunks (the positions move within those)."""
    return (nvfp4_side(cfg2.swap, cfg2.block_m) == A_SIDE_PAIRS.value and inner % 64 == 0
            and cfg2.block_k % 64 == 0)


def _gemm(a, w, ws, ws2, out, routing: Routing, numel, top_k, n, k, gated, cfg: GemmConfig,
          tma: bool, pairs_order: bool = False, combine=None, overlap=None):
    """One grouped GEMM launch. pairs_order: gate/up stores h in the code pairs' K order, down
    takes it so. combine (down, direct pairs): (topk_weights, combined output [T, H], the routed
    scale), which the launch fills as well as `out`. overlap: `_moe_common.pair_overlap`'s
    (direct pairs), or None."""
    grid = (routing.m_blocks * triton.cdiv(n, cfg.block_n),)
    words = w.view(torch.int32)  # [E, rows, K/8]: 8 codes a word
    tma_w, tma_s = takes_tma(a, k, cfg, w, ws) if tma else (False, False)
    w_desc = tma_descriptor(words, cfg.block_n, cfg.block_k // 8) if tma_w else None
    s_desc = tma_descriptor(ws, cfg.block_n, cfg.block_k // 16) if tma_s else None
    tw, comb, scale = combine if combine is not None else (None, None, 1.0)
    tickets = (combine_tickets(out.device, comb.shape[0] * triton.cdiv(n, cfg.block_n))
               if combine is not None else None)
    flags, ready_count, overlap_kw = overlap_launch(overlap, a.device, cfg.group_m, gated)
    _moe_nvfp4_kernel[grid](
        a, words, w_desc, ws, s_desc, ws2, out, tw, comb, tickets, flags, ready_count,
        *routing_ptrs(routing), numel, top_k, routing.m_blocks, n, k, a.stride(0),
        words.stride(0), words.stride(1), ws.stride(0), ws.stride(1), out.stride(0), scale,
        GATED=gated, DIRECT=routing.direct, SWAP=cfg.swap, ASM=use_asm(a.dtype),
        SIDE=nvfp4_side(cfg.swap, cfg.block_m, ordered=pairs_order and not gated),
        EVEN_K=k % cfg.block_k == 0, PRECISION=dot_precision(a.dtype), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TMA_W=tma_w, TMA_S=tma_s,
        ONE_ROW=tma_w and routing.direct, PAIRS_ORDER_OUT=pairs_order and gated,
        COMBINE=combine is not None, TOP_K=top_k if combine is not None else 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **overlap_kw,
    )


def decode_config(k: int, tma: bool = True, direct: bool = True,
                  gated: bool = False) -> GemmConfig:
    """The decode launch shape of a GEMM over K: where the TMA can load 256-deep tiles
    DECODE_TMA (direct pairs; DECODE_TMA_GATE_UP for gate/up over 512-deep ones) or
    DECODE_TMA_SORTED (sorted blocks), else DECODE."""
    if not tma or k % DECODE_TMA.block_k:
        return DECODE
    if direct and gated and k % DECODE_TMA_GATE_UP.block_k == 0:
        return DECODE_TMA_GATE_UP
    return DECODE_TMA if direct else DECODE_TMA_SORTED


def launch_configs(numel: int, experts: int, config13=None, config2=None, k13: int = 0,
                   k2: int = 0, tma: bool = False):
    """(gate/up, down) launch shapes: `configs_for`'s, with the decode shape (`decode_config`
    of the GEMM's K: k13 = hidden size, k2 = expert width; tma: the TMA can be used) for each
    GEMM the caller left open where those put the weights on the MMA's M side; that shape
    takes the given GEMM's block_m when the other is given (both GEMMs share one token
    sort); prefill sizes (128-row blocks) take PREFILL's shapes."""
    c13, c2 = configs_for(numel, experts, config13, config2)
    direct = numel <= 1  # (the launcher passes 1 for direct pairs)
    d13, d2 = decode_config(k13, tma, direct, gated=True), decode_config(k2, tma, direct)
    if config13 is None and c13.swap:
        c13 = d13 if config2 is None else dataclasses.replace(d13, block_m=c2.block_m)
    if config2 is None and c2.swap:
        c2 = d2 if config13 is None else dataclasses.replace(d2, block_m=c13.block_m)
    if c13.block_m == 128:  # prefill: PREFILL's shapes for the GEMMs left open
        c13, c2 = config13 or PREFILL[0], config2 or PREFILL[1]
    return c13, c2


@register(OP, "triton")
def moe_nvfp4_triton(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale,
                     w2_scale_2, direct=None, config13=None, config2=None, tma=True,
                     overlap=True, *, per_slot: bool = False,
                     scale: float = 1.0):
    """Launcher. `direct` / `config*` override the launch choices, tma=False turns the TMA
    loads off, overlap=False runs direct pairs' down GEMM after all of gate/up (tests and
    bench/ only)."""
    e, inner = check_moe_nvfp4(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2,
                               w2_scale, w2_scale_2)
    t, h = x.shape
    top_k = topk_ids.shape[1]
    numel = t * top_k
    if numel == 0:
        return empty_output(x, topk_ids, x.dtype, per_slot)
    direct = numel <= DIRECT_MAX_PAIRS if direct is None else direct
    config13, config2 = tuned_moe(OP, numel, e, inner, h, config13, config2, x.dtype)
    tma = tma and has_tma(x.device)
    c13, c2 = launch_configs(numel if not direct else 1, e, config13, config2, h, inner, tma)
    routing = plan_routing(topk_ids, e, c13.block_m, direct)
    x = x.contiguous()
    hbuf = torch.empty((routing.rows, inner), dtype=x.dtype, device=x.device)
    pairs_order = takes_pairs_order(c2, inner)
    overlap = pair_overlap(x.device, routing, numel, triton.cdiv(inner, c13.block_n)) \
        if overlap else None
    _gemm(x, w13, w13_scale, w13_scale_2, hbuf, routing, numel, top_k, inner, h, True, c13, tma,
          pairs_order, overlap=overlap)
    y = torch.empty((numel, h), dtype=x.dtype, device=x.device)
    if routing.direct and not per_slot:  # the down GEMM combines too: no combine launch
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
        _gemm(hbuf, w2, w2_scale, w2_scale_2, y, routing, numel, top_k, h, inner, False, c2,
              tma, pairs_order, combine=(topk_weights.contiguous(), out, scale),
              overlap=overlap)
        return out
    _gemm(hbuf, w2, w2_scale, w2_scale_2, y, routing, numel, top_k, h, inner, False, c2, tma,
          pairs_order, overlap=overlap)
    return finish(y, topk_weights, t, per_slot, scale)
