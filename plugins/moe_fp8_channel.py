"""beam::moe_fp8_channel — routed experts with per-channel FP8 weights and dynamic per-token FP8
activations (compressed-tensors FP8_DYNAMIC experts).

    out[t] = sum_j w[t, j] * down_e(qt(silu(gate_e(qt(x[t]))) * up_e(qt(x[t]))))
    qt(a): per row s = max(amax |a|, 1e-10) / 448, a ~= fp8_e4m3(clamp(a / s, +-448)) * s
    W_e[n, c] = fp8 weight[n, c] * scale[n]

Inputs (repacked expert layout of docs/DESIGN.md §2):
    x [T, H] bf16 / fp16 / fp32; topk_ids [T, k] int32/int64; topk_weights [T, k] fp32
    w13        [E, 2I, H] float8_e4m3fn   rows [0, I) gate_proj, [I, 2I) up_proj
    w13_scale  [E, 2I]    fp32            one scale per output row (gate rows, then up rows)
    w2         [E, H, I]  float8_e4m3fn; w2_scale [E, H] fp32
Output: a new [T, H] tensor in x.dtype (or with per_slot [T, k, H]; no `out=`).

Numerics: FP8 x FP8 on the tensor cores, promoted to FP32 every BLOCK_K (as moe_fp8), the FP32
sum times a_scale[row] * w_scale[n]; gate, up, silu and h round to x.dtype as the reference's
modules do; h is then quantized per (token, expert) row over its whole width I, which a
gate/up tile of BLOCK_N channels cannot see, so gate/up stores h in x.dtype and one
per-token quantizer launch (`_fp8_token`) runs between the GEMMs; y rounds to x.dtype; the
combine is FP32. Launches: x's quantizer, gate/up, h's quantizer, down (+ the combine unless
per_slot). Decode (few pairs) takes direct pairs and moe_fp8's decode tile for gate/up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from beam_trtllm.quant_formats import fake_quant_fp8_per_token

from ._checks import check_device
from ._fp8_token import quant_fp8_per_token
from ._gemm import gemm_loop, round_to, silu_mul, tile_of, unswap
from ._moe_common import (
    DIRECT_MAX_PAIRS, TL_DTYPES, GemmConfig, Routing, block_tile, check_expert_weights,
    check_ids_in_range, check_routing, check_tensor, configs_for, empty_output, fake_moe,
    finish, past_last_row, plan_routing, ref_moe, routing_ptrs,
)
from .moe_fp8 import DECODE_GATE_UP, DECODE_PAIRS
from .registry import beam_op, dispatch, register

OP = "moe_fp8_channel"
FP8 = (torch.float8_e4m3fn,)


def check_moe_fp8_channel(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale):
    """-> (E, I)."""
    check_routing(OP, x, topk_ids, topk_weights)
    e, inner = check_expert_weights(OP, x, w13, w2, FP8)
    check_tensor(OP, "w13_scale", w13_scale, (e, 2 * inner), (torch.float32,))
    check_tensor(OP, "w2_scale", w2_scale, (e, x.shape[1]), (torch.float32,))
    check_device(OP, x, w13_scale=w13_scale, w2_scale=w2_scale)
    return e, inner


@register(OP, "reference")
def ref_moe_fp8_channel(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, *,
                        per_slot: bool = False, scale: float = 1.0):
    e, _ = check_moe_fp8_channel(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    check_ids_in_range(OP, topk_ids, e)

    def expert(i):
        return w13[i].float() * w13_scale[i][:, None], w2[i].float() * w2_scale[i][:, None]

    quant = fake_quant_fp8_per_token
    return ref_moe(x, topk_ids, topk_weights, expert, quant, quant, per_slot=per_slot,
                   scale=scale)


@beam_op("moe_fp8_channel", mutates_args=())
def moe_fp8_channel(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    *, per_slot: bool = False, scale: float = 1.0,
) -> torch.Tensor:
    return dispatch(OP, x.device, x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale,
                    per_slot=per_slot, scale=scale)


moe_fp8_channel.register_fake(fake_moe)


# ---------------------------------------------------------------------------- triton
@triton.jit
def _moe_fp8_channel_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, ids_ptr, sorted_ptr,
                            block_expert_ptr, num_rows_ptr, numel, top_k, num_m, N, K,
                            stride_am, stride_we, stride_wn, stride_se, stride_om,
                            ACT: tl.constexpr, GATED: tl.constexpr, DIRECT: tl.constexpr,
                            SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # GATED: h[row] = silu(gate) * up in ACT (rows of the h buffer); else y[slot] in ACT.
    pid_m, pid_n = tile_of(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if past_last_row(pid_m, num_rows_ptr, DIRECT, BLOCK_M):
        return
    expert, slots, valid, rows, a_rows, offs_n, n_mask = block_tile(
        pid_m, pid_n, ids_ptr, sorted_ptr, block_expert_ptr, numel, top_k, N, GATED, DIRECT,
        BLOCK_M, BLOCK_N)
    a_rows = a_rows.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    ws_ptrs = ws_ptr + expert * stride_se + offs_n
    w_scale = tl.load(ws_ptrs, mask=n_mask, other=0.0)
    a_scale = tl.load(as_ptr + a_rows, mask=valid, other=0.0)
    acc, acc_up = gemm_loop(a_ptrs, valid, w_ptrs, n_mask, K, N * stride_wn, GATED, SWAP, "fp8",
                            BLOCK_M, BLOCK_N, BLOCK_K)
    gate = unswap(acc, SWAP) * a_scale[:, None] * w_scale[None, :]
    if GATED:
        w_up = tl.load(ws_ptrs + N, mask=n_mask, other=0.0)
        up = unswap(acc_up, SWAP) * a_scale[:, None] * w_up[None, :]
        out = silu_mul(gate, up, ACT)
        out_rows = rows
    else:
        out = round_to(gate, ACT)
        out_rows = slots
    out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _gemm(a, a_s, w, ws, out, routing: Routing, numel, top_k, n, k, gated, act,
          cfg: GemmConfig):
    grid = (routing.m_blocks * triton.cdiv(n, cfg.block_n),)
    _moe_fp8_channel_kernel[grid](
        a, a_s, w, ws, out, *routing_ptrs(routing), numel, top_k, routing.m_blocks, n, k,
        a.stride(0), w.stride(0), w.stride(1), ws.stride(0), out.stride(0), ACT=TL_DTYPES[act],
        GATED=gated, DIRECT=routing.direct, SWAP=cfg.swap, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


@register(OP, "triton")
def moe_fp8_channel_triton(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, direct=None,
                           config13=None, config2=None, *, per_slot: bool = False,
                           scale: float = 1.0):
    """Launcher. `direct` / `config*` override the launch choices (tests and bench/ only)."""
    e, inner = check_moe_fp8_channel(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    t, h = x.shape
    top_k = topk_ids.shape[1]
    numel = t * top_k
    if numel == 0:
        return empty_output(x, topk_ids, x.dtype, per_slot)
    direct = numel <= DIRECT_MAX_PAIRS if direct is None else direct
    if config13 is None and numel <= DECODE_PAIRS:
        config13 = DECODE_GATE_UP
    c13, c2 = configs_for(numel if not direct else 1, e, config13, config2)
    routing = plan_routing(topk_ids, e, c13.block_m, direct)
    xq, xs = quant_fp8_per_token(x)
    # the token sort's padding rows are never read back into y; zeroed they quantize quietly
    alloc = torch.empty if routing.direct else torch.zeros
    hb = alloc((routing.rows, inner), dtype=x.dtype, device=x.device)
    _gemm(xq, xs, w13, w13_scale, hb, routing, numel, top_k, inner, h, True, x.dtype, c13)
    hq, hs = quant_fp8_per_token(hb)
    y = torch.empty((numel, h), dtype=x.dtype, device=x.device)
    _gemm(hq, hs, w2, w2_scale, y, routing, numel, top_k, h, inner, False, x.dtype, c2)
    return finish(y, topk_weights, t, per_slot, scale)
