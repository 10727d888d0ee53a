"""RoPE angles and the SSMax scale for beam::qk_prep, in FP32 as transformers computes them.

Canonical Beam (transformers' BeamRotaryEmbedding / compute_attention_scaling) takes the angle
as the FP32 product p * inv_freq and cos/sin of that FP32 value, and the SSMax scale as
exp(0.1 * log1p((p + 1) / 2048)) in FP32. The kernel does the same operations on the same FP32
values through libdevice (correctly range-reduced cosf/sinf, as torch's CUDA cos/sin), so its
angles equal the model's wherever the math library's last ULP does.

Triton's interpreter (the kernels' CPU tests) has no libdevice: its `libdevice.*` are stubs
that return None. There the same FP32 operations run on NumPy (`tl.cos`, `tl.sin`, `tl.exp`
are NumPy's float32 functions) and log1p is taken from log(1 + x) with Goldberg's correction
(`_log1p`), within a few FP32 ULPs of torch's log1p.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from beam_trtllm.config import SSMAX_BASE, SSMAX_EXPONENT

from ._common import INTERPRETED
from ._reference import rope_inv_freq as _inv_freq_formula

_INV_FREQ: dict[tuple, torch.Tensor] = {}
_BASE = tl.constexpr(SSMAX_BASE)
_EXPONENT = tl.constexpr(SSMAX_EXPONENT)


def rope_inv_freq(theta: float, head_dim: int, device: torch.device) -> torch.Tensor:
    """theta^(-2j/D) for j < D/2 in FP32 (transformers' formula, computed on the CPU as
    transformers computes it), on `device`, cached. The host-to-device copy cannot run inside
    a CUDA-graph capture: callers make it before capturing (the engine at load)."""
    key = (float(theta), head_dim, str(device))
    if key not in _INV_FREQ:
        _INV_FREQ[key] = _inv_freq_formula(head_dim, float(theta), device)
    return _INV_FREQ[key]


@triton.jit
def _log1p(x):
    """log1p(x) for x >= 0 from FP32 log (interpreter only): log(u) * x / (u - 1), u = 1 + x
    rounded, which cancels the rounding of u (Goldberg, "What every computer scientist should
    know about floating-point arithmetic", Thm. 4)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@triton.jit
def rotation(pos_ptr, inv_freq_ptr, t, d, IS_FULL: tl.constexpr, D: tl.constexpr):
    """(cos, sin) [1, BLOCK_D2] of token t's RoPE angles; on full layers (scale, 0), so that
    `x1 * cos - x2 * sin` is exactly the SSMax-scaled x1."""
    pos = tl.load(pos_ptr + t).to(tl.float32)
    if IS_FULL:
        if INTERPRETED:
            scale = tl.exp(_EXPONENT * _log1p((pos + 1.0) / _BASE))
        else:
            scale = libdevice.exp(_EXPONENT * libdevice.log1p((pos + 1.0) / _BASE))
        cos = tl.zeros(d.shape, tl.float32) + scale
        sin = tl.zeros(d.shape, tl.float32)
    else:
        inv_freq = tl.load(inv_freq_ptr + d, mask=d < D // 2, other=0.0)
        angle = pos * inv_freq
        if INTERPRETED:
            cos = tl.cos(angle)
            sin = tl.sin(angle)
        else:
            cos = libdevice.cos(angle)
            sin = libdevice.sin(angle)
    return cos, sin
