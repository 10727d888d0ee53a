"""beam::cache_write — store K/V rows into a layer's KV cache at flat slots.

    k_cache.view(-1, Hkv, D)[slot_mapping[t]] = store(k[t])      for every t with slot >= 0
    (same for v);  store(x) = clamp(x / scale, ±448) for float8_e4m3fn caches, x otherwise

Shapes / dtypes: k, v [T, Hkv, D] (fp32, bf16, fp16); k_cache, v_cache [N, bs, Hkv, D]
(paged blocks of a full layer, or `[max_seqs, sliding_window, Hkv, D]` rings of a sliding
layer; fp32/bf16/fp16 or float8_e4m3fn; only the last dim need be contiguous);
slot_mapping [T] int64 (slot = block * bs + row, -1 = skip); k_scale, v_scale fp32 [] (used
only by FP8 caches). Flat slot s lives at cache[s // bs, s % bs].
Contract: mutates k_cache and v_cache in place, returns nothing. Non-negative slots must be
distinct (two writes to one slot would race). Used after a sliding layer's multi-token prefill
chunk (DESIGN.md §3); beam::qk_prep does the same store for decode. CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, cast_rne, check, check_cache_pair, check_tensor, div_rn_by,
                      next_pow2, to_cache)
from .registry import beam_op, dispatch, register

OP = "cache_write"


@register(OP, "reference")
def ref_cache_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, rows = slots // block_size, slots % block_size
    k_cache[blocks, rows] = to_cache(k[keep], k_cache.dtype, k_scale)
    v_cache[blocks, rows] = to_cache(v[keep], v_cache.dtype, v_scale)


@triton.jit
def store_cache_rows(cache_ptr, slot, block_size, stride_blk, stride_row, heads, dims, x, scale,
                     mask):
    """Store x ([heads, dims] FP32 values of one token) at flat `slot` (skipped when < 0)."""
    dtype = cache_ptr.dtype.element_ty
    if dtype == tl.float8e4nv:
        x = div_rn_by(x, scale)  # IEEE division: the same FP8 bits as torch's x / scale
    base = (slot // block_size) * stride_blk + (slot % block_size) * stride_row
    tl.store(cache_ptr + base + heads + dims, cast_rne(x, dtype), mask=mask & (slot >= 0))


@triton.jit
def _cache_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
                        stride_kt, stride_kh, stride_vt, stride_vh,
                        block_size, stride_blk, stride_row, stride_head,
                        HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < D)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0).to(tl.float32)
    k_scale = tl.load(ks_ptr)
    v_scale = tl.load(vs_ptr)
    store_cache_rows(kc_ptr, slot, block_size, stride_blk, stride_row, h * stride_head, d, k,
                     k_scale, mask)
    store_cache_rows(vc_ptr, slot, block_size, stride_blk, stride_row, h * stride_head, d, v,
                     v_scale, mask)


@register(OP, "triton")
def _launch_cache_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    t, hkv, d = k.shape
    if t == 0:
        return
    _cache_write_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.shape[1], k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HKV=hkv, D=d, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), num_warps=4)


def check_kv_rows(op: str, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    check_tensor(op, "k", k, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(op, "v", v, ndim=3, dtypes=(k.dtype,), device=k.device)
    check(v.shape == k.shape, op, f"v {tuple(v.shape)} must have k's shape {tuple(k.shape)}")
    check(k.stride(2) == 1 and v.stride(2) == 1, op, "k and v must be contiguous in head_dim")
    check_cache_pair(op, k_cache, v_cache, k_scale, v_scale, k.device)
    check(k_cache.shape[2:] == k.shape[1:], op,
          f"k_cache rows {tuple(k_cache.shape[2:])} must be [Hkv, D] = {tuple(k.shape[1:])}")
    check_slots(op, slot_mapping, k.shape[0], k.device)


def check_slots(op: str, slot_mapping, t: int, device) -> None:
    check_tensor(op, "slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), device=device)
    check(slot_mapping.shape[0] == t, op,
          f"slot_mapping has {slot_mapping.shape[0]} entries for {t} tokens")


@beam_op("cache_write", mutates_args=("k_cache", "v_cache"))
def cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    check_kv_rows(OP, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    dispatch(OP, k.device, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@cache_write.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    check_kv_rows(OP, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
