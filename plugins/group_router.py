"""beam::group_router — DeepSeek-V3 group-limited routing, entirely in FP32.

    s  = sigmoid(x · Wᵀ)                         x upcast to FP32, W FP32          [T, E]
         (<= 8 tokens: FP32 FMAs; more: 3xTF32 tensor-core products, whose error is of
          FP32's order; see docs/BENCHMARKS.md for the ids matched at 16K tokens)
    sb = s + bias                                 selection only
    group_score[g] = sum of the 2 largest sb of group g (n_group contiguous groups)
    keep the topk_group groups with the largest group_score
    ids = the k experts with the largest sb among the kept groups, ordered by sb descending
    w   = s[ids];  w = w / (sum(w) + 1e-20) if renormalize
(the routed scaling factor multiplies the MoE's summed output, not these weights)

Shapes / dtypes: x [T, H] (fp32, bf16, fp16), weight [E, H] fp32, bias [E] fp32; n_group,
topk_group, k ints; renormalize bool
-> (topk_ids [T, k] int32, topk_weights [T, k] fp32).
Contract: functional, returns two new tensors. Equal scores break toward the lower expert id.
Matches `_reference.route` (transformers' BeamTopKRouter; int64 ids there). CUDA-graph
safe: two launches (an FP32 GEMV/GEMM for the logits, then one program per token for the
selection). In the decode chain (_pdl.py) the few-token GEMV reads its weights before waiting
for x (`PRELOAD`, the "router" link), and its last program to store its logits does the
selection (the "select" fold: one launch, the same bits; a ticket per token block from
`_common.sync_counters`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _pdl
from ._common import (FLOAT_DTYPES, check, check_tensor, last_to_arrive, next_pow2,
                      rows_times_weights_after_wait, sync_counters)
from ._pdl import chain_mode, launch_early, let_next_launch, wait_for_inputs
from ._reference import route
from .registry import beam_op, dispatch, register

OP = "group_router"


@register(OP, "reference")
def ref_group_router(x, weight, bias, n_group: int, topk_group: int, k: int,
                     renormalize: bool):
    ids, weights = route(x, weight, bias, n_group, topk_group, k, renormalize)
    return ids.to(torch.int32), weights


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, tickets_ptr, bias_ptr, ids_ptr, weights_ptr,
                          T, E, H, stride_x, BLOCK_T: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT: tl.constexpr,
                          USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
                          PRELOAD: tl.constexpr, FOLD_SELECT: tl.constexpr, NG: tl.constexpr,
                          EPG: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
                          RENORM: tl.constexpr, NG_P2: tl.constexpr, EPG_P2: tl.constexpr,
                          K_P2: tl.constexpr):
    """Partial logits [SPLIT, T, E]: split s sums channels [s*per, (s+1)*per) (split-K spreads a
    batch-1 GEMV over more SMs; the selection kernel adds the splits in a fixed order). PDL:
    the decode chain (_pdl.py). PRELOAD (launched early, one channel block a program): the
    program's weight tile is read before the wait, while the kernels before it still run, so
    after it only x is read; the sum is the same as rows_times_weights' single step."""
    let_next_launch(PDL)
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(2)
    per = tl.cdiv(tl.cdiv(H, SPLIT), BLOCK_H) * BLOCK_H
    h_hi = tl.minimum(split * per + per, H)
    acc = rows_times_weights_after_wait(x_ptr, stride_x, w_ptr, H, t, e, split * per, h_hi, T,
                                        E, BLOCK_T, BLOCK_E, BLOCK_H, USE_DOT, DOT_PREC,
                                        PRELOAD, PDL)
    out = out_ptr + split.to(tl.int64) * T * E
    tl.store(out + t[:, None].to(tl.int64) * E + e[None, :], acc,
             mask=(t[:, None] < T) & (e[None, :] < E))
    if FOLD_SELECT:  # the token block's last program to store its logits selects for it
        ticket = tickets_ptr + tl.program_id(1)
        if last_to_arrive(ticket, tl.num_programs(0) * SPLIT):
            for i in range(BLOCK_T):
                token = tl.program_id(1) * BLOCK_T + i
                if token < T:
                    _select_experts(out_ptr, bias_ptr, ids_ptr, weights_ptr, T * E,
                                    token.to(tl.int64), E, NG, EPG, TOPK_GROUP, K, RENORM,
                                    SPLIT, NG_P2, EPG_P2, K_P2)
            tl.atomic_xchg(ticket, 0)  # for the next launch


@triton.jit
def _order_key(score, index, INDEX_BITS: tl.constexpr):
    """uint64 keys whose unsigned order is score descending, then index ascending: the score's
    FP32 bits made monotone (negatives flipped, positives' sign bit set) above the index's
    complement. One max-reduction of keys then finds the best score and the lowest index
    holding it (the reference's tie rule), where a max and a min-of-index took two; -inf
    (masked) maps below every finite score."""
    bits = score.to(tl.uint32, bitcast=True)
    monotone = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000).to(tl.uint64)
    mask: tl.constexpr = (1 << INDEX_BITS) - 1
    return (monotone << INDEX_BITS) | (mask - index.to(tl.uint64))


@triton.jit
def _key_score(key, INDEX_BITS: tl.constexpr):
    """The FP32 score a _order_key key was made from (bit for bit)."""
    monotone = (key >> INDEX_BITS).to(tl.uint32)
    bits = tl.where((monotone >> 31) != 0, monotone & 0x7FFFFFFF, monotone ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _key_index(key, INDEX_BITS: tl.constexpr):
    mask: tl.constexpr = (1 << INDEX_BITS) - 1
    return (mask - (key & mask)).to(tl.int32)


@triton.jit
def _router_select_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, split_stride,
                          E: tl.constexpr, NG: tl.constexpr, EPG: tl.constexpr,
                          TOPK_GROUP: tl.constexpr, K: tl.constexpr, RENORM: tl.constexpr,
                          SPLIT: tl.constexpr, NG_P2: tl.constexpr, EPG_P2: tl.constexpr,
                          K_P2: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)  # (the decode chain: launched while the logits kernel runs)
    _select_experts(logits_ptr, bias_ptr, ids_ptr, weights_ptr, split_stride,
                    tl.program_id(0).to(tl.int64), E, NG, EPG, TOPK_GROUP, K, RENORM, SPLIT,
                    NG_P2, EPG_P2, K_P2)


@triton.jit
def _select_experts(logits_ptr, bias_ptr, ids_ptr, weights_ptr, split_stride, t, E,
                    NG: tl.constexpr, EPG: tl.constexpr,
                    TOPK_GROUP: tl.constexpr, K: tl.constexpr, RENORM: tl.constexpr,
                    SPLIT: tl.constexpr, NG_P2: tl.constexpr, EPG_P2: tl.constexpr,
                    K_P2: tl.constexpr):
    """Token t's experts and weights from its partial logits (read from L2: `.cg`, since in
    the folded form other programs stored them)."""
    g = tl.arange(0, NG_P2)
    j = tl.arange(0, EPG_P2)[None, :]
    valid = (g[:, None] < NG) & (j < EPG)
    expert = g[:, None] * EPG + j  # [NG_P2, EPG_P2], group-major like the reference's view
    logit = tl.zeros([NG_P2, EPG_P2], tl.float32)
    for s in tl.static_range(SPLIT):
        logit += tl.load(logits_ptr + s * split_stride + t * E + expert, mask=valid, other=0.0,
                         cache_modifier=".cg")
    s = 1.0 / (1.0 + tl.exp(-logit))
    sb = tl.where(valid, s + tl.load(bias_ptr + expert, mask=valid, other=0.0), float("-inf"))
    key = _order_key(sb, expert, 32)  # padded lanes: -inf, below every real expert
    # group score: the two best biased scores of each group (the best's one lane removed)
    first = tl.max(key, axis=1)
    second = tl.max(tl.where(key == first[:, None], 0, key), axis=1)
    group_score = _key_score(first, 32) + _key_score(second, 32)
    group_key = _order_key(tl.where(g < NG, group_score, float("-inf")), g, 32)
    kept = g < 0
    for _ in tl.static_range(TOPK_GROUP):
        top = tl.max(group_key, axis=0)
        kept = kept | (group_key == top)
        group_key = tl.where(group_key == top, 0, group_key)
    key = tl.where(kept[:, None] & valid, key, 0)
    slots = tl.arange(0, K_P2)
    picks = tl.zeros([K_P2], dtype=tl.int32)
    for i in tl.static_range(K):
        top = tl.max(tl.max(key, axis=1), axis=0)
        picks = tl.where(slots == i, _key_index(top, 32), picks)
        key = tl.where(key == top, 0, key)
    # the picks' unbiased scores, gathered from the tile after the loop (where a sum a pick
    # would add reductions, and a load of their logits would wait on memory)
    flat = (picks // EPG) * EPG_P2 + picks % EPG
    chosen_w = tl.where(slots < K, tl.gather(tl.reshape(s, [NG_P2 * EPG_P2]), flat, 0), 0.0)
    if RENORM:
        chosen_w = tl.math.div_rn(chosen_w, tl.sum(chosen_w, axis=0) + 1e-20)
    tl.store(ids_ptr + t * K + slots, picks, mask=slots < K)
    tl.store(weights_ptr + t * K + slots, chosen_w, mask=slots < K)


# Logits kernel shapes: for a few tokens a GEMV over experts (and channels: SPLIT), since
# batch-1 decode reads 5 MB of FP32 weight and must spread it over many SMs; tiles otherwise.
# Chosen by the H200 sweep in bench/kernels_sweep.py.
# "many" multiplies in 3xTF32 (each FP32 operand split into a TF32 high and low part, three
# tensor-core products): FP32-level accuracy at 2.7x the speed of cuBLAS' FP32 GEMM on the H200.
ROUTER_CONFIG = {
    "few": dict(BLOCK_E=2, BLOCK_H=1024, SPLIT=5, num_warps=4),
    # 8 warps: 569 against 595 us at 16K tokens (H200, 2026-12-01), the same bits
    "many": dict(BLOCK_T=128, BLOCK_E=64, BLOCK_H=32, SPLIT=1, DOT_PREC="tf32x3", num_warps=8),
}


# Up to FEW_TOKENS tokens the logits are the GEMV (and its folded selection: one launch). A
# verify step of one request has 1 + 7 rows: on the "many" tiles it took ~11 us a layer of
# the trained tiny on the H200 (two launches, one program), against ~1.5 us for decode
# (2026-12-04); at Beam's width it would run ceil(256 / 64) = 4 programs over 5 MB of weights.
FEW_TOKENS = 8


def logits_launch_params(t: int) -> dict:
    if t <= FEW_TOKENS:
        return dict(ROUTER_CONFIG["few"], BLOCK_T=next_pow2(t), USE_DOT=False, DOT_PREC="ieee")
    return dict(ROUTER_CONFIG["many"], USE_DOT=True)


@register(OP, "triton")
def _launch_group_router(x, weight, bias, n_group: int, topk_group: int, k: int,
                         renormalize: bool):
    t, h = x.shape
    e = weight.shape[0]
    ids = x.new_empty(t, k, dtype=torch.int32)
    weights = x.new_empty(t, k, dtype=torch.float32)
    if t == 0:
        return ids, weights
    p = logits_launch_params(t)
    logits = x.new_empty(p["SPLIT"], t, e, dtype=torch.float32)
    grid = (triton.cdiv(e, p["BLOCK_E"]), triton.cdiv(t, p["BLOCK_T"]), p["SPLIT"])
    pdl, early = chain_mode(x.device, "router"), launch_early(x.device, "router")
    preload = bool(early) and triton.cdiv(h, p["SPLIT"]) <= p["BLOCK_H"]
    # the few-token GEMV's last program selects (a decode step's few tokens, one at a time)
    fold = not p["USE_DOT"] and _pdl.folded("select")
    tickets = sync_counters(x.device, grid[1], "router") if fold else ids  # (else unread)
    epg = e // n_group
    select = dict(NG=n_group, EPG=epg, TOPK_GROUP=topk_group, K=k, RENORM=renormalize,
                  NG_P2=next_pow2(n_group), EPG_P2=next_pow2(epg), K_P2=next_pow2(k))
    _router_logits_kernel[grid](x, weight, logits, tickets, bias, ids, weights,
                                t, e, h, x.stride(0), PDL=pdl,
                                PRELOAD=preload, FOLD_SELECT=fold, **select, **p, **early)
    if not fold:
        _router_select_kernel[(t,)](logits, bias, ids, weights, t * e,
                                    E=e, SPLIT=p["SPLIT"], PDL=pdl,
                                    num_warps=1 if e <= 256 else 4, **select, **early)
    return ids, weights


def _check(x, weight, bias, n_group: int, topk_group: int, k: int) -> None:
    check_tensor(OP, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(OP, "weight", weight, ndim=2, dtypes=(torch.float32,), device=x.device)
    check_tensor(OP, "bias", bias, ndim=1, dtypes=(torch.float32,), device=x.device)
    e, h = weight.shape
    check(h == x.shape[1], OP, f"weight is [{e}, {h}] but x rows have {x.shape[1]} channels")
    check(bias.shape[0] == e, OP, f"bias has {bias.shape[0]} entries for {e} experts")
    check(x.stride(1) == 1 and weight.is_contiguous() and bias.is_contiguous(), OP,
          "x rows, weight and bias must be contiguous")
    check(n_group > 0 and e % n_group == 0 and e // n_group >= 2, OP,
          f"n_group={n_group} must divide the {e} experts into groups of at least 2")
    check(0 < topk_group <= n_group, OP, f"topk_group={topk_group} must be in [1, {n_group}]")
    check(0 < k <= topk_group * (e // n_group), OP,
          f"k={k} must be in [1, topk_group * experts_per_group = {topk_group * (e // n_group)}]")


@beam_op("group_router", mutates_args=())
def group_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int,
                 topk_group: int, k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, weight, bias, n_group, topk_group, k)
    return dispatch(OP, x.device, x, weight, bias, n_group, topk_group, k, renormalize)


@group_router.register_fake
def _(x, weight, bias, n_group, topk_group, k, renormalize):
    _check(x, weight, bias, n_group, topk_group, k)
    t = x.shape[0]
    return x.new_empty(t, k, dtype=torch.int32), x.new_empty(t, k, dtype=torch.float32)
