"""RoPE and SSMax angles for beam::qk_prep, in FP64 as `reference.rope_cos_sin` and
`reference.ssmax_scale` compute them, so they stay exact at 1M positions.

Kernel float arguments are FP32, so FP64 constants travel as hi + lo pairs (`f64_pair`,
rebuilt by `f64` in the kernel); theta^(-2i/D) comes from a per-device FP64 table made by the
reference's own formula (`rope_inv_freq`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl


def f64_pair(x: float) -> tuple[float, float]:
    """x as hi + lo, both exact in FP32: kernel float arguments are FP32, the math is FP64."""
    hi = float(np.float32(x))
    return hi, float(np.float32(x - hi))


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def rope_inv_freq(theta: float, head_dim: int, device: torch.device) -> torch.Tensor:
    """theta^(-2i/D) for i < D/2 in float64, computed as `reference.rope_cos_sin` computes it,
    on `device`, cached. Made by device ops, so a first call inside a CUDA-graph capture still
    works, but its two small kernels then replay with the graph: callers make it before
    capturing (the engine at load)."""
    key = (float(theta), head_dim, str(device))
    if key not in _INV_FREQ:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device)
        _INV_FREQ[key] = theta ** (-exponents / head_dim)
    return _INV_FREQ[key]


@triton.jit
def f64(pair_hi, pair_lo):
    return tl.cast(pair_hi, tl.float64) + tl.cast(pair_lo, tl.float64)


def rotation_constants(ssmax_base: float, ssmax_exponent: float) -> tuple[float, ...]:
    """`rotation`'s FP64 constants as FP32 pairs: 2pi, 1/2pi, 1/ssmax_base, ssmax_exponent."""
    return (*f64_pair(2 * math.pi), *f64_pair(1 / (2 * math.pi)), *f64_pair(1.0 / ssmax_base),
            *f64_pair(ssmax_exponent))


@triton.jit
def rotation(pos_ptr, inv_freq_ptr, t, d, IS_FULL: tl.constexpr, D: tl.constexpr, two_pi_hi,
             two_pi_lo, inv_two_pi_hi, inv_two_pi_lo, inv_base_hi, inv_base_lo, exp_hi, exp_lo):
    """(cos, sin) [1, BLOCK_D2] of token t's RoPE angles; on full layers (scale, 0), so that
    `x1 * cos - x2 * sin` is exactly the SSMax-scaled x1."""
    pos = tl.load(pos_ptr + t).to(tl.float64)
    if IS_FULL:
        ratio = pos * f64(inv_base_hi, inv_base_lo)
        scale = tl.exp(f64(exp_hi, exp_lo) * tl.log(1.0 + ratio)).to(tl.float32)
        cos = tl.zeros(d.shape, tl.float32) + scale
        sin = tl.zeros(d.shape, tl.float32)
    else:
        # inv_freq_i = theta^(-2i/D) from the reference's own FP64 table (`rope_inv_freq`):
        # every thread holds ~8-12 of the [heads, D/2] tile's angles, and an FP64 exp and
        # division each made the sliding layers' qk_prep 2.2 us slower than the full ones'.
        inv_freq = tl.load(inv_freq_ptr + d, mask=d < D // 2, other=0.0)
        angle = pos * inv_freq
        # Reduce to about [-pi, pi] in FP64 (any whole number of turns near angle / 2pi will
        # do), then FP32 cos/sin (abs. error ~2e-7): FP64 cos/sin cost ~100 more registers
        # per thread and spilled.
        turns = (angle * f64(inv_two_pi_hi, inv_two_pi_lo) + 0.5).to(tl.int64).to(tl.float64)
        reduced = (angle - turns * f64(two_pi_hi, two_pi_lo)).to(tl.float32)
        cos = tl.cos(reduced)
        sin = tl.sin(reduced)
    return cos, sin
