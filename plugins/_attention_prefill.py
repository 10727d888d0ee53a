"""Tiled flash attention for chunked prefill and mixed steps (ragged batch, any query count).

One program takes BLOCK_Q query tokens of one sequence and all G query heads of one KV head:
the tile's BLOCK_M = BLOCK_Q·G rows share every K/V tile, so a decode sequence in a mixed
batch still reads its cache once per KV-head group. Keys come in two loops: the cached ones
(paged block table or ring, FP8 dequantised by one scale per tile) and then the chunk's own
keys from k_new / v_new. The grid, T // BLOCK_Q + B query tiles by Hkv, depends on shapes
only: tile i belongs to the last sequence b with cu_seqlens_q[b] // BLOCK_Q + b <= i (found by
binary search), which leaves at least ceil(n_b / BLOCK_Q) tiles for every sequence b.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._attention_tiles import (LOG2E, as_cached_fp8, cache_tile_offsets, dot_precision,
                               fp8_forms, fp8_scale, load_cached_tile, pow2_block_size,
                               query_operands, softmax_step, store_output)
from ._common import FP8_DTYPE, is_fp8, next_pow2
from ._decode_config import DECODE_CONFIG

# (BLOCK_M, BLOCK_N, num_warps, num_stages) on the GPU, by layer kind; the interpreter gets
# small tiles so that the CPU tests spend their time on the shapes that matter, not on padding.
# H200, 8 x 2K fresh prefill, 48 / 8 heads of 128 (docs/BENCHMARKS.md, 2026-12-01): sliding
# (window 512) 722 us with 32-key tiles and 4 warps against 768 with the full layers' shape,
# which is the best there (1266 us; 32-key tiles 1361).
# fp8_operands: how an FP8 cache's tiles become MMA operands (_attention_tiles.FP8_SETTINGS):
# on full layers the decode kernel's default. Their cached-key loop took 3 conversions a
# code pair for BF16 operands (sm_90 SASS, a 64-key tile: 788 instructions, 96 of them
# conversions, a thread; with K by cvt and V by bits 720 and 16). Sliding layers keep
# Triton's cast: their 4-warp tiles already sit at 255 registers, and the FP16 forms spill
# inside the K loop there (sm_90 build: 6 to 92 spill instructions), for at most
# window - 1 cached keys a query tile.
PREFILL_CONFIG = {
    "full": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3,
                 fp8_operands=DECODE_CONFIG["fp8_operands"]),
    "sliding": dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3, fp8_operands=1),
}
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)  # (tiles only)


@triton.jit
def _find_sequence(cu_ptr, tile, B, BLOCK_Q: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """Largest b < B with cu[b] // BLOCK_Q + b <= tile."""
    lo = tile * 0
    hi = B - 1 + lo
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        ok = tl.load(cu_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _unmasked_tiles(new_lo, p_first, p_last, window, BLOCK_N: tl.constexpr):
    """The own-key tiles from new_lo (BLOCK_N apart) that every query row of the tile
    [p_first, p_last] sees, [head_end, mid): keys j with p_last - window < j <= p_first. The
    tiles before (some rows' windows start inside) and after (the diagonal) are masked; the
    mask's ALU work per score is about the softmax's."""
    head_end = new_lo
    if window > 0:
        head_end = new_lo + tl.cdiv(tl.maximum(p_last - window + 1 - new_lo, 0),
                                    BLOCK_N) * BLOCK_N
        head_end = tl.minimum(head_end, p_last + 1)
    mid = head_end + (tl.maximum(p_first + 1 - head_end, 0) // BLOCK_N) * BLOCK_N
    return head_end, mid


@triton.jit
def _own_keys(q, pos, m_i, l_i, acc, kn_ptr, vn_ptr, first_row, stride_kn, stride_vn, head_kn,
              head_vn, j_lo, j_hi, head_end, mid, p_last, d, window, qk_scale, ks_ptr, vs_ptr,
              D: tl.constexpr, BLOCK_N: tl.constexpr, IS_FP8: tl.constexpr,
              DOT_PREC: tl.constexpr, K_FORM: tl.constexpr, V_FORM: tl.constexpr):
    """Fold this chunk's keys j in [j_lo, j_hi) (k_new / v_new row first_row + j) into the
    running softmax of the query tile. Only the tiles outside [head_end, mid), which some rows
    of the tile do not see, are masked: one loop with a branch a tile, not one loop per run
    of tiles, so the software pipeline is filled once. With an FP8 cache the keys and values
    are taken as the cache stores them (their FP8 codes, and the scales applied as to cached
    tiles), so a query sees its own chunk's keys exactly as a later step reads them back: the
    result does not depend on where a prefix came from. (K_FORM / V_FORM: the operand forms
    of the cached tiles, _attention_tiles.py; q is in K's already.)"""
    dtype = q.dtype
    for j0 in range(j_lo, j_hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        valid = j <= p_last
        rows = (first_row + j).to(tl.int64)
        kv_mask = valid[:, None] & (d[None, :] < D)
        k = tl.load(kn_ptr + rows[:, None] * stride_kn + head_kn + d[None, :], mask=kv_mask,
                    other=0.0)
        v = tl.load(vn_ptr + rows[:, None] * stride_vn + head_vn + d[None, :], mask=kv_mask,
                    other=0.0)
        if IS_FP8:
            k = as_cached_fp8(k, ks_ptr, dtype, K_FORM)
            v = as_cached_fp8(v, vs_ptr, dtype, V_FORM)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        if (j0 < head_end) | (j0 >= mid):
            diff = pos[:, None] - j[None, :]
            visible = valid[None, :] & (diff >= 0) & ((window == 0) | (diff < window))
            scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = softmax_step(scores, m_i, l_i, acc, v, DOT_PREC, V_FORM)
    return m_i, l_i, acc


@triton.jit
def _prefill_kernel(q_ptr, kn_ptr, vn_ptr, gate_ptr, out_ptr, out_scale_ptr, kc_ptr, vc_ptr, cu_ptr,
                    q_start_ptr, hist_ptr, index_ptr, ks_ptr, vs_ptr, B,
                    stride_kn, stride_knh, stride_vn, stride_vnh, M, block_size, stride_blk,
                    stride_row, stride_head, window, qk_scale,
                    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    SEARCH_STEPS: tl.constexpr, IS_FP8: tl.constexpr, DOT_PREC: tl.constexpr,
                    OUT_FP8: tl.constexpr, K_FORM: tl.constexpr, V_FORM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr):
    # the tiles in reverse: a causal sequence's last query tiles, which see the most keys,
    # start first and the short ones fill the last wave
    tile, h = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)
    b = _find_sequence(cu_ptr, tile, B, BLOCK_Q, SEARCH_STEPS)
    seq_lo = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - seq_lo
    t0 = (tile - (seq_lo // BLOCK_Q + b)) * BLOCK_Q
    if t0 < n:
        dtype = q_ptr.dtype.element_ty
        r = tl.arange(0, BLOCK_M)
        tok = t0 + r // G  # row r = (token t0 + r // G, query head h * G + r % G)
        head = h * G + r % G
        row_ok = (r < BLOCK_Q * G) & (tok < n)
        d = tl.arange(0, BLOCK_D)
        q_rows = (seq_lo + tok).to(tl.int64) * HQ + head
        q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :],
                    mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
        q = query_operands(q, K_FORM)
        start = tl.load(q_start_ptr + b)
        pos = start + tok  # query positions [BLOCK_M]
        p_first = start + t0
        p_last = start + tl.minimum(t0 + BLOCK_Q, n) - 1
        lo = tl.load(hist_ptr + b)
        if window > 0:
            lo = tl.maximum(lo, p_first - window + 1)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_scale = qk_scale
        if IS_FP8:
            k_scale = qk_scale * fp8_scale(ks_ptr, K_FORM)
        index_row = index_ptr + b.to(tl.int64) * M
        head_off = h * stride_head
        for j0 in range(lo, start, BLOCK_N):  # cached keys: every query here is past them
            j = j0 + tl.arange(0, BLOCK_N)
            valid = j < start
            offs = cache_tile_offsets(index_row, j, valid, M, block_size, stride_blk, stride_row,
                                      BLOCK_SIZE)
            k = load_cached_tile(kc_ptr, offs, head_off, d, valid, D, dtype, K_FORM)
            v = load_cached_tile(vc_ptr, offs, head_off, d, valid, D, dtype, V_FORM, True)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * k_scale
            visible = valid[None, :] & ((window == 0) | (pos[:, None] - j[None, :] < window))
            scores = tl.where(visible, scores, float("-inf"))
            m_i, l_i, acc = softmax_step(scores, m_i, l_i, acc, v, DOT_PREC, V_FORM)
        new_lo = tl.maximum(lo, start)  # this chunk's own keys from here
        head_end, mid = _unmasked_tiles(new_lo, p_first, p_last, window, BLOCK_N)
        first_row = seq_lo - start  # k_new row of this chunk's position j: first_row + j
        kn_head, vn_head = h * stride_knh, h * stride_vnh
        m_i, l_i, acc = _own_keys(q, pos, m_i, l_i, acc, kn_ptr, vn_ptr, first_row, stride_kn,
                                  stride_vn, kn_head, vn_head, new_lo, p_last + 1, head_end, mid,
                                  p_last, d, window, k_scale, ks_ptr, vs_ptr, D, BLOCK_N, IS_FP8,
                                  DOT_PREC, K_FORM, V_FORM)
        if IS_FP8:  # every value was an FP8 code: one scale for all
            acc = acc * fp8_scale(vs_ptr, V_FORM)
        out_offs = q_rows[:, None] * D + d[None, :]
        out_mask = row_ok[:, None] & (d[None, :] < D)
        gate = tl.load(gate_ptr + out_offs, mask=out_mask, other=0.0).to(tl.float32)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * gate
        store_output(out_ptr, out_offs, o, out_mask, out_scale_ptr, dtype, OUT_FP8)


def launch_prefill(q, k_new, v_new, gate, k_cache, v_cache, cu_seqlens_q, q_start, hist_start,
                   cache_index, window, k_scale, v_scale, out_scale=None, config=None):
    from .registry import triton_interpreted

    kind = "sliding" if window > 0 else "full"
    cfg = dict(PREFILL_CONFIG[kind], **(INTERPRETER_CONFIG if triton_interpreted() else {}))
    cfg.update(config or {})
    t, hq, d = q.shape
    hkv, b = k_new.shape[1], cu_seqlens_q.shape[0] - 1
    g = hq // hkv
    block_m = max(cfg["BLOCK_M"], next_pow2(g))
    block_q = block_m // g
    out = q.new_empty(t, hq * d, dtype=q.dtype if out_scale is None else FP8_DTYPE)
    grid = (t // block_q + b, hkv)
    k_form, v_form = fp8_forms(cfg["fp8_operands"], q.dtype, k_cache.dtype)
    _prefill_kernel[grid](
        q, k_new, v_new, gate, out, gate if out_scale is None else out_scale, k_cache, v_cache,
        cu_seqlens_q, q_start, hist_start,
        cache_index, k_scale, v_scale, b, k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), cache_index.shape[1], k_cache.shape[1], k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), window, LOG2E / d**0.5,
        HQ=hq, G=g, D=d, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=max(16, next_pow2(d)),
        BLOCK_N=cfg["BLOCK_N"], SEARCH_STEPS=max(1, (b - 1).bit_length()),
        IS_FP8=is_fp8(k_cache.dtype), DOT_PREC=dot_precision(q.dtype),
        OUT_FP8=out_scale is not None, K_FORM=k_form, V_FORM=v_form,
        BLOCK_SIZE=pow2_block_size(k_cache.shape[1]) if cfg.get("pow2_blocks", True) else 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
