"""beam::rmsnorm — RMSNorm of each row, FP32 math, cast back.

    y[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * w        (no `1 + w`)

Shapes / dtypes: x [T, H] (fp32, bf16 or fp16), w [H] (any float dtype) -> y [T, H] in x's dtype.
Contract: functional, returns a new tensor (no out=, nothing is written in place). Matches
`_reference.rms_norm` (the model's input_layernorm of layer 0 and the final norm;
every other norm is fused into beam::add_rmsnorm). CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._reference import rms_norm

from ._common import FLOAT_DTYPES, FP8_DTYPE, cast_rne, check, check_tensor, next_pow2, sm_count
from ._fp8_act import fp8_codes, load_fp8_scale
from .registry import beam_op, dispatch, register

OP = "rmsnorm"


@register(OP, "reference")
def ref_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, q_ptr, qs_ptr, T, stride_x, stride_y, stride_q, H, eps,
                    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, STAGES: tl.constexpr,
                    QUANT: tl.constexpr):
    # Whole rows stay in registers (H <= 16K), so x is read once. A program loops over tiles of
    # ROWS rows (persistent grid): w is read once per program and, with STAGES > 1, the next
    # tiles' loads are in flight while this one is reduced and stored. QUANT: also the FP8
    # codes of the rounded y with the static scale at qs_ptr (beam::rmsnorm_fp8).
    cols = tl.arange(0, BLOCK_H)[None, :]
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    y_scale = load_fp8_scale(qs_ptr, QUANT)
    for tile in tl.range(tl.program_id(0), tl.cdiv(T, ROWS), tl.num_programs(0),
                         num_stages=STAGES):
        rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        mask = (rows < T) & (cols < H)
        x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        inv_rms = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / H + eps)
        y = cast_rne(x * inv_rms[:, None] * w, y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows * stride_y + cols, y, mask=mask)
        if QUANT:
            tl.store(q_ptr + rows * stride_q + cols, fp8_codes(y.to(tl.float32), y_scale),
                     mask=mask)


# Launch shape of the row kernels (rmsnorm, add_rmsnorm) for "many" rows (a prefill chunk) and
# "few" (decode): rows per tile, elements per thread (-> warps), resident programs per SM
# (persistent grid) and pipeline depth. Chosen by the H200 sweep in bench/kernels_sweep.py.
# "few_fp8": the same with the FP8 codes written too, whose quantizer (IEEE division, E4M3
# rounding) costs registers: 8 elements per thread took 3.8 us at T = 1 where 16 took 4.3
# (H200, bench/decode_sweep.py --only norm1, with _common.div_rn_by).
ROW_CONFIG = {
    "many": dict(ROWS=1, elems_per_thread=32, programs_per_sm=2, STAGES=3),
    "few": dict(ROWS=1, elems_per_thread=32, programs_per_sm=4, STAGES=1),
    "few_fp8": dict(ROWS=1, elems_per_thread=8, programs_per_sm=4, STAGES=1),
}


def row_launch_params(t: int, h: int, device: torch.device,
                      quant: bool = False) -> tuple[int, dict]:
    """(grid size, kernel parameters) for a [t, h] row kernel (`quant`: writing FP8 codes)."""
    cfg = ROW_CONFIG["many" if t >= 1024 else ("few_fp8" if quant else "few")]
    block = next_pow2(h)
    warps = max(1, min(32, cfg["ROWS"] * block // (32 * cfg["elems_per_thread"])))
    tiles = triton.cdiv(t, cfg["ROWS"])
    grid = min(tiles, cfg["programs_per_sm"] * sm_count(device))
    return grid, dict(ROWS=cfg["ROWS"], BLOCK_H=block, STAGES=cfg["STAGES"],
                      num_warps=next_pow2(warps))


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 x_scale: torch.Tensor | None = None):
    """Launcher of the kernel -> (y, FP8 codes of y with x_scale, or None)."""
    t, h = x.shape
    y = torch.empty_like(x)
    q = None if x_scale is None else torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if t:
        grid, p = row_launch_params(t, h, x.device, q is not None)
        quant = (y, weight, 0) if q is None else (q, x_scale, q.stride(0))  # unread if None
        _rmsnorm_kernel[(grid,)](x, weight, y, quant[0], quant[1], t, x.stride(0), y.stride(0),
                                 quant[2], h, eps, QUANT=q is not None, **p)
    return y, q


@register(OP, "triton")
def _launch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rmsnorm_rows(x, weight, eps)[0]


def check_rmsnorm(x: torch.Tensor, weight: torch.Tensor, op: str = OP) -> None:
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check(weight.shape[0] == x.shape[1], op,
          f"weight has {weight.shape[0]} entries but x rows have {x.shape[1]}")
    check(x.stride(1) == 1 and weight.stride(0) == 1, op, "x rows and weight must be contiguous")


@beam_op("rmsnorm", mutates_args=())
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_rmsnorm(x, weight)
    return dispatch(OP, x.device, x, weight, eps)


@rmsnorm.register_fake
def _(x, weight, eps):
    check_rmsnorm(x, weight)
    return torch.empty_like(x)
