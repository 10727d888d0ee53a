"""Split-KV ("flash-decoding") attention for a pure decode step (one query per sequence).

At batch 1 a full layer has only Hkv = 8 (sequence, KV head) pairs: one program each would
use 8 of the H200's 132 SMs. The cached keys of each pair are cut into NUM_SPLITS contiguous
ranges, each program folds one range into a partial (max, sum, output) for the G query heads
of its KV head (G rows of one tensor-core tile, so K/V are read once per group), and a second
kernel merges the partials, applies the gate and writes the output (or, given the o_proj's
input scale, its FP8 codes). In the decode chain's "combine" fold (_pdl.py) there is no second
kernel: the last split program of a (sequence, KV head) to store its partial merges them, the
same bits (a ticket per pair from `_common.sync_counters`, put back to zero). With one split
(batches of >= 2 * SMs / Hkv sequences, or short caches) the split program writes the output
itself and the combine is not launched. NUM_SPLITS comes from shapes only (batch, heads, the
cache's addressable length), so the launch is CUDA-graph safe. An FP8 cache's codes become
FP16 operands (q and P too) by DECODE_CONFIG's "fp8_operands" form, or BF16 ones by Triton's
cast (_attention_tiles.py says how, and what that changes numerically).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_tiles import (FP8_CAST, LOG2E, P_LOG2_FP16, as_cached_fp8, as_operands,
                               cache_tile_offsets, dot_precision, fp8_forms, fp8_scale,
                               load_cached_tile, pow2_block_size, query_operands, softmax_step,
                               store_output)
from . import _pdl
from ._common import (FP8_DTYPE, TL_DTYPES, is_fp8, last_to_arrive, next_pow2, sm_count,
                      sync_counters)
from ._pdl import chain_mode, launch_early, let_next_launch, wait_for_inputs
from ._decode_config import DECODE_CONFIG
from .tuning import tuned_decode



@triton.jit
def _decode_split_kernel(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, q_start_ptr, hist_ptr, index_ptr,
                         ks_ptr, vs_ptr, part_o_ptr, part_m_ptr, part_l_ptr, gate_ptr, out_ptr,
                         out_scale_ptr, tickets_ptr, stride_kn, stride_knh, stride_vn,
                         stride_vnh, M, block_size, stride_blk, stride_row, stride_head, window,
                         qk_scale,
                         HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, IS_FP8: tl.constexpr,
                         K_FORM: tl.constexpr, V_FORM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         DOT_PREC: tl.constexpr, ACT: tl.constexpr, OUT_FP8: tl.constexpr,
                         PDL: tl.constexpr, PRELOAD: tl.constexpr, ONE_TILE: tl.constexpr,
                         FOLD_COMBINE: tl.constexpr):
    # NUM_SPLITS == 1: one program holds the whole context of its (sequence, KV head) and
    # writes the gated output itself (what the combine does with one split, bit for bit).
    # PDL (the decode chain, _pdl.py): it lets the combine (or the o_proj) launch at once and
    # waits for qk_prep's q / k / v. PRELOAD (launched early): the split's first K/V tile is
    # read before the wait; no kernel of the step writes it (qk_prep writes only the step's
    # own slot, position `start`, which no split reads: it comes from k_new / v_new), nor the
    # step's metadata (host copies before the graph's first kernel). ONE_TILE: no split holds
    # more than one tile (NUM_SPLITS * BLOCK_N covers the addressable cache): that tile is read
    # as PRELOAD's is, and there is no loop, so no pipeline buffers in shared memory either.
    let_next_launch(PDL)
    b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dtype = q_ptr.dtype.element_ty
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gd_mask = (g[:, None] < G) & (d[None, :] < D)
    s_lo, s_hi = _split_range(q_start_ptr, hist_ptr, b, split, window, NUM_SPLITS, BLOCK_N)
    k_scale = qk_scale
    if IS_FP8:
        k_scale = qk_scale * fp8_scale(ks_ptr, K_FORM)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    tile = (index_ptr + b.to(tl.int64) * M, M, block_size, stride_blk, stride_row,
            h * stride_head, d, s_hi)
    first = s_lo
    if PRELOAD or ONE_TILE:  # held as the cache's codes across the wait (FP8: half the regs)
        k0, v0, valid0 = _cached_tile(kc_ptr, vc_ptr, tile, s_lo, D, BLOCK_N,
                                      kc_ptr.dtype.element_ty, FP8_CAST, FP8_CAST, BLOCK_SIZE)
    wait_for_inputs(PDL)
    q = tl.load(q_ptr + (b * HQ + h * G + g[:, None]).to(tl.int64) * D + d[None, :],
                mask=gd_mask, other=0.0)
    q = query_operands(q, K_FORM)
    if PRELOAD or ONE_TILE:  # the loop's first step (an empty split's tile is all -inf)
        m_i, l_i, acc = _tile_step(q, as_operands(k0, dtype, K_FORM),
                                   as_operands(v0, dtype, V_FORM, True), valid0, k_scale, m_i,
                                   l_i, acc, DOT_PREC, V_FORM)
        first = s_lo + BLOCK_N
    if not ONE_TILE:
        for j0 in range(first, s_hi, BLOCK_N):
            k, v, valid = _cached_tile(kc_ptr, vc_ptr, tile, j0, D, BLOCK_N, dtype, K_FORM,
                                       V_FORM, BLOCK_SIZE)
            m_i, l_i, acc = _tile_step(q, k, v, valid, k_scale, m_i, l_i, acc, DOT_PREC,
                                       V_FORM)
    if split == NUM_SPLITS - 1:  # the step's own key (position `start`) comes from k_new,
        # as the cache stores it (FP8: its codes, scaled like the cached tiles')
        k1 = tl.load(kn_ptr + b.to(tl.int64) * stride_kn + h * stride_knh + d, mask=d < D,
                     other=0.0)
        v1 = tl.load(vn_ptr + b.to(tl.int64) * stride_vn + h * stride_vnh + d, mask=d < D,
                     other=0.0)
        if IS_FP8:
            k1 = as_cached_fp8(k1, ks_ptr, dtype, K_FORM)
            v1 = as_cached_fp8(v1, vs_ptr, dtype, V_FORM)
        m_i, l_i, acc = _own_key_step(q, k1, v1, k_scale, m_i, l_i, acc, V_FORM)
    if IS_FP8:
        acc = acc * fp8_scale(vs_ptr, V_FORM)
    if NUM_SPLITS == 1:
        _gated_output(acc, l_i, gate_ptr, out_ptr, out_scale_ptr, b, h, g, d, gd_mask, HQ, G,
                      D, ACT, OUT_FP8)
    else:
        part = ((b * HKV + h) * NUM_SPLITS + split).to(tl.int64) * G
        tl.store(part_o_ptr + (part + g[:, None]) * D + d[None, :], acc, mask=gd_mask)
        tl.store(part_m_ptr + part + g, m_i, mask=g < G)
        tl.store(part_l_ptr + part + g, l_i, mask=g < G)
        if FOLD_COMBINE:  # the (sequence, KV head)'s last split to finish merges them all
            ticket = tickets_ptr + b * HKV + h
            if last_to_arrive(ticket, NUM_SPLITS):
                _merge_splits(part_o_ptr, part_m_ptr, part_l_ptr, gate_ptr, out_ptr,
                              out_scale_ptr, b, h, 0, HQ, HKV, G, D, BLOCK_G, BLOCK_D,
                              NUM_SPLITS, ACT, OUT_FP8)
                tl.atomic_xchg(ticket, 0)  # for the next launch


@triton.jit
def _split_range(q_start_ptr, hist_ptr, b, split, window, NUM_SPLITS: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Cached positions [s_lo, s_hi) of this split: the visible ones below the step's own
    position, cut into NUM_SPLITS ranges of whole tiles."""
    start = tl.load(q_start_ptr + b)
    lo = tl.load(hist_ptr + b)
    if window > 0:  # the query at `start` sees keys > start - window
        lo = tl.maximum(lo, start - window + 1)
    n_cached = tl.maximum(start - lo, 0)
    per_split = tl.cdiv(tl.cdiv(n_cached, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + split * per_split
    return s_lo, tl.minimum(s_lo + per_split, start)


@triton.jit
def _cached_tile(kc_ptr, vc_ptr, tile, j0, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 dtype: tl.constexpr, K_FORM: tl.constexpr, V_FORM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr):
    """K and V of cache positions [j0, j0 + BLOCK_N) (zero past the split's end) as operands
    of forms K_FORM / V_FORM (_attention_tiles.py; the codes themselves: dtype the cache's and
    CAST) and which are valid; `tile` = (index row, M, block size, block and row strides, head
    offset, d, the split's end)."""
    index_row, M, block_size, stride_blk, stride_row, head_off, d, s_hi = tile
    j = j0 + tl.arange(0, BLOCK_N)
    valid = j < s_hi
    offs = cache_tile_offsets(index_row, j, valid, M, block_size, stride_blk, stride_row,
                              BLOCK_SIZE)
    k = load_cached_tile(kc_ptr, offs, head_off, d, valid, D, dtype, K_FORM)
    v = load_cached_tile(vc_ptr, offs, head_off, d, valid, D, dtype, V_FORM, True)
    return k, v, valid


@triton.jit
def _tile_step(q, k, v, valid, k_scale, m_i, l_i, acc, DOT_PREC: tl.constexpr,
               V_FORM: tl.constexpr):
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * k_scale
    scores = tl.where(valid[None, :], scores, float("-inf"))
    return softmax_step(scores, m_i, l_i, acc, v, DOT_PREC, V_FORM)


@triton.jit
def _own_key_step(q, k1, v1, qk_scale, m_i, l_i, acc, V_FORM: tl.constexpr):
    """Fold the step's own key and value (one row each, FP32 dot) into the running state
    (P in softmax_step's units for V_FORM)."""
    s1 = tl.sum(q.to(tl.float32) * k1.to(tl.float32)[None, :], axis=1) * qk_scale
    m_new = tl.maximum(m_i, s1)
    alpha = tl.exp2(m_i - m_new)
    if V_FORM != FP8_CAST:
        p1 = tl.exp2(s1 - (m_new - P_LOG2_FP16))
    else:
        p1 = tl.exp2(s1 - m_new)
    l_i = l_i * alpha + p1
    acc = acc * alpha[:, None] + p1[:, None] * v1.to(tl.float32)[None, :]
    return m_new, l_i, acc


@triton.jit
def _gated_output(acc, total, gate_ptr, out_ptr, out_scale_ptr, b, h, g, d, gd_mask,
                  HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, ACT: tl.constexpr,
                  OUT_FP8: tl.constexpr):
    """out[b, h*G + g] = acc / total * gate[b, h*G + g] per element (0 for a row without
    keys), in ACT or FP8 codes."""
    heads = h * G + g
    offs = (b * HQ + heads[:, None]).to(tl.int64) * D + d[None, :]
    gate = tl.load(gate_ptr + offs, mask=gd_mask, other=0.0).to(tl.float32)
    o = acc / tl.where(total == 0.0, 1.0, total)[:, None] * gate
    store_output(out_ptr, offs, o, gd_mask, out_scale_ptr, ACT, OUT_FP8)


@triton.jit
def _merge_splits(part_o_ptr, part_m_ptr, part_l_ptr, gate_ptr, out_ptr, out_scale_ptr, b, h,
                  d0, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  ACT: tl.constexpr, OUT_FP8: tl.constexpr):
    """The gated output of (sequence b, KV head h), head dims [d0, d0 + BLOCK_D), from its
    splits' partials (read from L2: `.cg`, since in the folded form other programs stored
    them)."""
    g = tl.arange(0, BLOCK_G)
    d = d0 + tl.arange(0, BLOCK_D)
    g_mask = g < G
    base = ((b * HKV + h) * NUM_SPLITS).to(tl.int64) * G
    # Elementwise over the splits (unrolled, every load in flight at once), no reduction
    # across threads: each thread's heads are its own. Finite for real heads (the last split
    # holds the step's own key); empty splits weigh 0.
    m_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for i in tl.static_range(NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + base + i * G + g, mask=g_mask,
                                          other=float("-inf"), cache_modifier=".cg"))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # padded head rows
    gd_mask = g_mask[:, None] & (d[None, :] < D)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for i in tl.static_range(NUM_SPLITS):
        m_i = tl.load(part_m_ptr + base + i * G + g, mask=g_mask, other=float("-inf"),
                      cache_modifier=".cg")
        l_i = tl.load(part_l_ptr + base + i * G + g, mask=g_mask, other=0.0, cache_modifier=".cg")
        o_i = tl.load(part_o_ptr + (base + i * G + g[:, None]) * D + d[None, :], mask=gd_mask,
                      other=0.0, cache_modifier=".cg")
        w_i = tl.exp2(m_i - m_max)
        total += w_i * l_i
        acc += w_i[:, None] * o_i
    _gated_output(acc, total, gate_ptr, out_ptr, out_scale_ptr, b, h, g, d, gd_mask, HQ, G, D,
                  ACT, OUT_FP8)


@triton.jit
def _decode_combine_kernel(part_o_ptr, part_m_ptr, part_l_ptr, gate_ptr, out_ptr, out_scale_ptr,
                           HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                           D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                           NUM_SPLITS: tl.constexpr,
                           ACT: tl.constexpr, OUT_FP8: tl.constexpr, PDL: tl.constexpr):
    # One program a (sequence, KV head, BLOCK_D head dims): with one a (sequence, KV head),
    # batch 1's merge ran on 8 SMs, each reading its pair's partials from L2 alone.
    let_next_launch(PDL)  # the o_proj launches now (the decode chain, _pdl.py)
    wait_for_inputs(PDL)
    _merge_splits(part_o_ptr, part_m_ptr, part_l_ptr, gate_ptr, out_ptr, out_scale_ptr,
                  tl.program_id(0), tl.program_id(1), tl.program_id(2) * BLOCK_D, HQ, HKV, G, D,
                  BLOCK_G, BLOCK_D, NUM_SPLITS, ACT, OUT_FP8)


def num_splits(batch: int, hkv: int, capacity: int, block_n: int, device: torch.device,
               programs_per_sm: int, min_split: int, wave_fit: bool = False) -> int:
    """Enough programs to fill the GPU, but no split shorter than `min_split` keys of the
    longest context the cache can address (`capacity`, a shape, not data). `wave_fit`: at
    most programs_per_sm programs an SM (whole waves, where that is the kernel's occupancy)
    instead of at least that many. On the CPU (interpreter) sm_count is 4: a few splits, so
    the tests exercise the merge."""
    slots = programs_per_sm * sm_count(device)
    want = max(1, slots // (batch * hkv)) if wave_fit else triton.cdiv(slots, batch * hkv)
    return max(1, min(want, triton.cdiv(capacity, max(min_split, block_n))))


def _operand_options(cfg: dict, q, k_cache) -> dict:
    """The split kernel's operand and cache-index constexprs: the FP8 cache's operand forms
    (cfg["fp8_operands"], _attention_tiles.FP8_SETTINGS) and the power-of-two block size;
    cfg may also set "pow2_blocks": False (divide by the block size at run time, as before
    the shifts) and "maxnreg" (a register cap), for benchmarks (bench/decode_fp8kv.py)."""
    k_form, v_form = fp8_forms(cfg["fp8_operands"], q.dtype, k_cache.dtype)
    block_size = pow2_block_size(k_cache.shape[1]) if cfg.get("pow2_blocks", True) else 0
    options = dict(IS_FP8=is_fp8(k_cache.dtype), K_FORM=k_form, V_FORM=v_form,
                   BLOCK_SIZE=block_size, DOT_PREC=dot_precision(q.dtype))
    if cfg.get("maxnreg"):
        options["maxnreg"] = cfg["maxnreg"]
    return options


def launch_decode(q, k_new, v_new, gate, k_cache, v_cache, q_start, hist_start, cache_index,
                  window, k_scale, v_scale, out_scale=None, config=None):
    cfg = dict(DECODE_CONFIG, **(config or tuned_decode(q, k_cache, cache_index) or {}))
    b, hq, d = q.shape
    hkv, block_size, m = k_new.shape[1], k_cache.shape[1], cache_index.shape[1]
    g = hq // hkv
    capacity = m * block_size  # the longest context the cache index can address (a shape)
    short = capacity <= cfg["short_capacity"]
    block_n = cfg["BLOCK_N_SHORT"] if short else cfg["BLOCK_N"]
    stages = cfg["num_stages_short"] if short else cfg["num_stages"]
    per_sm = cfg["programs_per_sm_fp8" if is_fp8(k_cache.dtype) else "programs_per_sm"]
    splits = cfg.get("splits") or num_splits(b, hkv, capacity, block_n, q.device, per_sm,
                                             cfg["min_split_short" if short else "min_split"],
                                             bool(cfg["wave_fit"]))
    out = q.new_empty(b, hq * d, dtype=q.dtype if out_scale is None else FP8_DTYPE)
    out_scale = gate if out_scale is None else out_scale  # (a pointer the kernels never read)
    block_g, block_d = max(16, next_pow2(g)), max(16, next_pow2(d))
    if splits == 1:  # no partials, no combine launch
        part_o = part_m = part_l = out
    else:
        part_o = q.new_empty(b, hkv, splits, g, d, dtype=torch.float32)
        part_m = q.new_empty(b, hkv, splits, g, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
    pdl, early = chain_mode(q.device, "attention"), launch_early(q.device, "attention")
    fold = splits > 1 and cfg.get("fold_combine", _pdl.folded("combine"))
    tickets = sync_counters(q.device, b * hkv, "attention") if fold else out  # (unread)
    common = dict(HQ=hq, HKV=hkv, G=g, D=d, BLOCK_D=block_d, NUM_SPLITS=splits,
                  ACT=TL_DTYPES[q.dtype], OUT_FP8=out.dtype == FP8_DTYPE, PDL=pdl)
    _decode_split_kernel[(b, hkv, splits)](
        q, k_new, v_new, k_cache, v_cache, q_start, hist_start, cache_index, k_scale, v_scale,
        part_o, part_m, part_l, gate, out, out_scale, tickets, k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1), m, block_size, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), window, LOG2E / d**0.5, BLOCK_G=block_g, BLOCK_N=block_n,
        PRELOAD=cfg.get("preload", bool(early)),
        ONE_TILE=bool(cfg.get("one_tile", True)) and splits * block_n >= capacity,
        FOLD_COMBINE=fold, **common, **early, **_operand_options(cfg, q, k_cache),
        num_warps=cfg["num_warps"], num_stages=stages)
    if splits > 1 and not fold:
        combine_d = min(block_d, cfg["combine_block_d"])
        _decode_combine_kernel[(b, hkv, triton.cdiv(d, combine_d))](
            part_o, part_m, part_l, gate, out, out_scale, BLOCK_G=next_pow2(g),
            **dict(common, BLOCK_D=combine_d), **early, num_warps=cfg["combine_warps"])
    return out
