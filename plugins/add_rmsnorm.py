"""beam::add_rmsnorm — one sublayer boundary in one launch: post-norm, depth-scaled residual
add, next pre-norm.

    y_n = RMSNorm(y; w_post)                       rounded to y's dtype
    h'  = rnd(rnd(b * y_n) + rnd(a * h))           in h's dtype (transformers' rounding points)
    x   = RMSNorm(h'; w_pre)                       of the rounded h', cast to h's dtype

Shapes / dtypes: h [T, H], y [T, H] (fp32, bf16 or fp16, the same dtype), w_post [H],
w_pre [H]; a, b, eps python floats -> (h' [T, H], x [T, H]) in h's dtype.
y may also be [S, T, H] partials (any token stride): FP32 partial sums (beam::linear_fp8's
split_k output), y = their sum in order (y[0] + y[1] + ...) rounded to h's dtype, as the
split GEMM's own output would be; or, with y_weights [T, S] FP32, an MoE's per-slot expert
outputs (beam::moe_*(..., per_slot=True), transposed to [k, T, H]): y = y_scale * sum_s
y_weights[t, s] * float(y[s, t]) (from 0 in order, FP32), rounded once, as the MoE's combine
does (y_scale: the routed scaling factor, on the summed output). The whole-row
kernel adds them as it loads y (no reduction launch); the chunked one gets them summed first.
Contract: functional, returns two new tensors (no out=; h is not updated in place).
Matches `_reference.residual_add(h, rms_norm(y, w_post), a, b)` followed by
`rms_norm(h', w_pre)`; for the last layer w_pre is `model.norm.weight`. CUDA-graph safe.
Bytes moved: 4·T·H·sizeof(dtype) (read h, y; write h', x). Two kernels: the whole row in one
tile for a few rows (decode), the row in chunks for many (prefill; see CHUNKED).
beam::add_rmsnorm_fp8 runs the same kernels and also writes x's FP8 codes for the next W8A8
GEMM.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, FP8_DTYPE, cast_rne, check, check_tensor, next_pow2,
                      sum_partials, summed_partials)
from ._fp8_act import fp8_codes, load_fp8_scale
from ._pdl import chain_mode, launch_early, let_next_launch, wait_for_inputs
from ._reference import residual_add, rms_norm
from .registry import beam_op, dispatch, register
from .rmsnorm import row_launch_params

OP = "add_rmsnorm"


def adds_partials(t: int) -> bool:
    """Whether t rows take the whole-row kernel, which adds y's partials itself (a consumer
    should then hand them over rather than combine them in a launch of its own)."""
    return t < CHUNKED["min_rows"]


@register(OP, "reference")
def ref_add_rmsnorm(h, y, w_post, w_pre, a: float, b: float, eps: float, *, y_weights=None,
                    y_scale: float = 1.0):
    y = sum_partials(y, h.dtype, y_weights, y_scale)
    h_new = residual_add(h, rms_norm(y, w_post, eps), a, b)
    return h_new, rms_norm(h_new, w_pre, eps)


@triton.jit
def _residual(h, y, inv_rms_y, w_post, a, b, y_dtype: tl.constexpr, dtype: tl.constexpr):
    """h' = rnd(rnd(b * y_n) + rnd(a * h)), y_n = RMSNorm(y; w_post) rounded to y's dtype:
    transformers' roundings (FP32 in, h' returned in dtype)."""
    y_n = cast_rne(y * inv_rms_y * w_post, y_dtype).to(tl.float32)
    scaled_y = cast_rne(b * y_n, dtype).to(tl.float32)
    return cast_rne(scaled_y + cast_rne(a * h, dtype).to(tl.float32), dtype)


@triton.jit
def _store_x(x_ptrs, q_ptrs, x_scale, h_new, inv_rms_h, w_pre, mask, dtype: tl.constexpr,
             QUANT: tl.constexpr):
    """x = RMSNorm(h'; w_pre) rounded to dtype, stored; QUANT: also its FP8 codes with the
    static scale x_scale."""
    x = cast_rne(h_new * inv_rms_h * w_pre, dtype)
    tl.store(x_ptrs, x, mask=mask)
    if QUANT:
        tl.store(q_ptrs, fp8_codes(x.to(tl.float32), x_scale), mask=mask)


@triton.jit
def _add_rmsnorm_kernel(h_ptr, y_ptr, yw_ptr, wpost_ptr, wpre_ptr, hout_ptr, x_ptr, q_ptr, qs_ptr,
                        T, stride_h, stride_y, stride_ys, stride_yw, stride_ho, stride_x, stride_q,
                        H, a, b, eps, y_scale, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                        STAGES: tl.constexpr, QUANT: tl.constexpr, PARTIALS: tl.constexpr,
                        WEIGHTED: tl.constexpr, PDL: tl.constexpr):
    # Persistent over tiles of ROWS rows, like beam::rmsnorm's kernel. QUANT: also the FP8
    # codes of the rounded x with the static scale at qs_ptr (beam::add_rmsnorm_fp8).
    # PARTIALS > 0: y holds that many partials stride_ys apart, added in order (WEIGHTED: each
    # times its row's weight at yw_ptr, from 0, the sum times y_scale) and rounded to h's
    # dtype (0: y is y).
    # PDL (the decode chain, _pdl.py): launched while the kernel before it runs, it loads the
    # norm weights, lets the next kernel launch and waits for h and y (PDL 2, the default:
    # waits, then lets the next one launch, which so does not sit on the SMs beside the GEMM
    # before this norm).
    let_next_launch(PDL)
    cols = tl.arange(0, BLOCK_H)[None, :]
    w_post = tl.load(wpost_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    w_pre = tl.load(wpre_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    x_scale = load_fp8_scale(qs_ptr, QUANT)
    wait_for_inputs(PDL)
    dtype = hout_ptr.dtype.element_ty
    for tile in tl.range(tl.program_id(0), tl.cdiv(T, ROWS), tl.num_programs(0),
                         num_stages=STAGES):
        rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        mask = (rows < T) & (cols < H)
        h = tl.load(h_ptr + rows * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            y = tl.zeros([ROWS, BLOCK_H], tl.float32)
            for part in tl.static_range(PARTIALS):
                w = tl.load(yw_ptr + rows * stride_yw + part, mask=rows < T, other=0.0)
                y += tl.load(y_ptr + part * stride_ys + rows * stride_y + cols, mask=mask,
                             other=0.0).to(tl.float32) * w
            y = cast_rne(y * y_scale, dtype).to(tl.float32)
        else:
            y = summed_partials(y_ptr + rows * stride_y + cols, mask, stride_ys, PARTIALS, dtype)
        y_dtype: tl.constexpr = dtype if PARTIALS > 0 else y_ptr.dtype.element_ty
        inv_rms_y = 1.0 / tl.sqrt_rn(tl.sum(y * y, axis=1) / H + eps)
        h_new = _residual(h, y, inv_rms_y[:, None], w_post, a, b, y_dtype, dtype)
        tl.store(hout_ptr + rows * stride_ho + cols, h_new, mask=mask)
        h_new = h_new.to(tl.float32)  # the next norm reads the rounded stream, as the model does
        inv_rms_h = 1.0 / tl.sqrt_rn(tl.sum(h_new * h_new, axis=1) / H + eps)
        _store_x(x_ptr + rows * stride_x + cols, q_ptr + rows * stride_q + cols, x_scale, h_new,
                 inv_rms_h[:, None], w_pre, mask, dtype, QUANT)


@triton.jit
def _add_rmsnorm_chunked_kernel(h_ptr, y_ptr, wpost_ptr, wpre_ptr, hout_ptr, x_ptr, q_ptr, qs_ptr,
                                stride_h, stride_y, stride_ho, stride_x, stride_q, H, a, b, eps,
                                CHUNK: tl.constexpr, QUANT: tl.constexpr):
    # One row per program in CHUNK-wide pieces (5 x 1024 for Beam's 5120: no idle lanes, where
    # the whole-row tile is 8192 wide), three passes: sum of y^2; h' (stored) and its sum of
    # squares; x (and its FP8 codes). Passes 2 and 3 re-read y and h' from L1/L2, not DRAM.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, CHUNK)
    y_row, h_row = y_ptr + row * stride_y, h_ptr + row * stride_h
    ho_row, x_row = hout_ptr + row * stride_ho, x_ptr + row * stride_x
    dtype = hout_ptr.dtype.element_ty
    x_scale = load_fp8_scale(qs_ptr, QUANT)
    sum_sq = tl.zeros([CHUNK], tl.float32)
    for c in range(0, H, CHUNK):
        y = tl.load(y_row + c + cols, mask=c + cols < H, other=0.0).to(tl.float32)
        sum_sq += y * y
    inv_rms_y = 1.0 / tl.sqrt_rn(tl.sum(sum_sq, axis=0) / H + eps)
    sum_sq = tl.zeros([CHUNK], tl.float32)
    for c in range(0, H, CHUNK):
        mask = c + cols < H
        y = tl.load(y_row + c + cols, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(h_row + c + cols, mask=mask, other=0.0).to(tl.float32)
        w_post = tl.load(wpost_ptr + c + cols, mask=mask, other=0.0).to(tl.float32)
        h_new = _residual(h, y, inv_rms_y, w_post, a, b, y_ptr.dtype.element_ty, dtype)
        tl.store(ho_row + c + cols, h_new, mask=mask)
        h_new = h_new.to(tl.float32)
        sum_sq += h_new * h_new
    inv_rms_h = 1.0 / tl.sqrt_rn(tl.sum(sum_sq, axis=0) / H + eps)
    tl.debug_barrier()  # h' written above is read back below (by this block's threads)
    for c in range(0, H, CHUNK):
        mask = c + cols < H
        h_new = tl.load(ho_row + c + cols, mask=mask, other=0.0).to(tl.float32)
        w_pre = tl.load(wpre_ptr + c + cols, mask=mask, other=0.0).to(tl.float32)
        _store_x(x_row + c + cols, q_ptr + row * stride_q + c + cols, x_scale, h_new, inv_rms_h,
                 w_pre, mask, dtype, QUANT)


# Many rows (a prefill chunk) run the chunked kernel: 86.5% of copy bandwidth at [16384, 5120]
# BF16 on the H200 where the whole-row persistent kernel reached 77.5% (2026-11-29, commit
# 81c8a4e; 4 warps 84.2%, 512-wide chunks 77.4%; docs/benchmarks-history.md). Few rows (decode) keep the whole-row tile:
# its one pass of loads has less latency than three dependent ones.
CHUNKED = dict(min_rows=1024, CHUNK=1024, num_warps=8)


def add_rmsnorm_rows(h, y, w_post, w_pre, a: float, b: float, eps: float,
                     x_scale: torch.Tensor | None = None, y_weights: torch.Tensor | None = None,
                     y_scale: float = 1.0):
    """Launcher of the kernels -> (h', x, FP8 codes of x with x_scale, or None)."""
    t, hidden = h.shape
    if y.dim() == 3 and not adds_partials(t):  # (the engine hands over partials for few rows)
        y, y_weights = sum_partials(y, h.dtype, y_weights, y_scale), None
    partials = y.shape[0] if y.dim() == 3 else 0
    yw = y_weights if y_weights is not None else y  # unread unless WEIGHTED
    h_new, x = torch.empty_like(h), torch.empty_like(h)
    q = None if x_scale is None else torch.empty(h.shape, dtype=FP8_DTYPE, device=h.device)
    quant = (x, w_pre, 0) if q is None else (q, x_scale, q.stride(0))  # unread if None
    if t >= CHUNKED["min_rows"]:
        _add_rmsnorm_chunked_kernel[(t,)](
            h, y, w_post, w_pre, h_new, x, quant[0], quant[1], h.stride(0), y.stride(0),
            h_new.stride(0), x.stride(0), quant[2], hidden, a, b, eps,
            CHUNK=min(CHUNKED["CHUNK"], next_pow2(hidden)), QUANT=q is not None,
            num_warps=CHUNKED["num_warps"])
    elif t:
        grid, p = row_launch_params(t, hidden, h.device, q is not None)
        pdl = chain_mode(h.device, "norm")
        _add_rmsnorm_kernel[(grid,)](
            h, y, yw, w_post, w_pre, h_new, x, quant[0], quant[1], t, h.stride(0), y.stride(-2),
            y.stride(0) if partials else 0, yw.stride(0), h_new.stride(0), x.stride(0),
            quant[2], hidden, a, b, eps, y_scale, QUANT=q is not None, PARTIALS=partials,
            WEIGHTED=y_weights is not None, PDL=pdl, **p, **launch_early(h.device, "norm"))
    return h_new, x, q


@register(OP, "triton")
def _launch_add_rmsnorm(h, y, w_post, w_pre, a: float, b: float, eps: float, *, y_weights=None,
                        y_scale: float = 1.0):
    return add_rmsnorm_rows(h, y, w_post, w_pre, a, b, eps, y_weights=y_weights,
                            y_scale=y_scale)[:2]


def check_add_rmsnorm(h, y, w_post, w_pre, op: str = OP, y_weights=None,
                      y_scale: float = 1.0) -> None:
    check_tensor(op, "h", h, ndim=2, dtypes=FLOAT_DTYPES)
    if y.dim() == 3:  # partials of y: FP32 sums, or weighted per-slot outputs
        dtypes = (torch.float32,) if y_weights is None else FLOAT_DTYPES
        check_tensor(op, "y partials", y, dtypes=dtypes, device=h.device)
        check(y.shape[1:] == h.shape and y.shape[0] >= 1, op,
              f"y partials {tuple(y.shape)} must be [S, {', '.join(map(str, h.shape))}]")
        if y_weights is not None:
            check_tensor(op, "y_weights", y_weights, ndim=2, dtypes=(torch.float32,),
                         device=h.device)
            check(tuple(y_weights.shape) == (h.shape[0], y.shape[0]) and
                  y_weights.stride(1) == 1, op, f"y_weights {tuple(y_weights.shape)} must be "
                  f"[{h.shape[0]}, {y.shape[0]}] with contiguous rows")
    else:
        check(y_weights is None, op, "y_weights needs y as partials [S, T, H]")
        check_tensor(op, "y", y, ndim=2, dtypes=(h.dtype,), device=h.device)
        check(y.shape == h.shape, op, f"y {tuple(y.shape)} must have h's shape {tuple(h.shape)}")
    check(y_scale == 1.0 or y_weights is not None, op,
          f"y_scale {y_scale} scales a weighted sum of partials: it needs y_weights")
    for name, w in (("w_post", w_post), ("w_pre", w_pre)):
        check_tensor(op, name, w, ndim=1, dtypes=FLOAT_DTYPES, device=h.device)
        check(w.shape[0] == h.shape[1], op,
              f"{name} has {w.shape[0]} entries, rows have {h.shape[1]}")
        check(w.stride(0) == 1, op, f"{name} must be contiguous")
    check(h.stride(1) == 1 and y.stride(-1) == 1, op, "h and y rows must be contiguous")


@beam_op("add_rmsnorm", mutates_args=())
def add_rmsnorm(h: torch.Tensor, y: torch.Tensor, w_post: torch.Tensor, w_pre: torch.Tensor,
                a: float, b: float, eps: float, y_weights: Optional[torch.Tensor] = None,
                y_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    check_add_rmsnorm(h, y, w_post, w_pre, y_weights=y_weights, y_scale=y_scale)
    return dispatch(OP, h.device, h, y, w_post, w_pre, a, b, eps, y_weights=y_weights,
                    y_scale=y_scale)


@add_rmsnorm.register_fake
def _(h, y, w_post, w_pre, a, b, eps, y_weights=None, y_scale=1.0):
    check_add_rmsnorm(h, y, w_post, w_pre, y_weights=y_weights, y_scale=y_scale)
    return torch.empty_like(h), torch.empty_like(h)
