"""The spec's per-op formulas in plain torch, shared by the ops' `ref_` implementations.

The whole-model oracle is transformers' `BeamForCausalLM` (docs/DESIGN.md "The oracle"); these
are the pieces of it that several `beam::` ops reproduce, written with transformers' operations
in transformers' order so that each op's reference rounds where the canonical model rounds
(shared/BEAM_SPEC.md "Forward pass, with the rounding points").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from beam_trtllm.config import SSMAX_BASE, SSMAX_EXPONENT


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w in FP32, one rounding to x.dtype (no `1 + w`)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """1 / theta^(2j/D) for j < D/2, FP32, computed as transformers' default RoPE computes it:
    on the CPU, then moved to `device` (CUDA's pow differs in the last ULP for some j, e.g.
    D = 24, which at p = 3M moves an angle by 1e-2 rad)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
    return (1.0 / (theta ** exponents)).to(device)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin [..., D] FP32 of the angles p * inv_freq (an FP32 product) for rotate-half RoPE."""
    inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [..., T, heads, D], positions [..., T]: rotate-half RoPE in FP32, one rounding."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    cos, sin = cos[..., None, :], sin[..., None, :]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return ((x * cos) + (rotated * sin)).to(x.dtype)


def ssmax_scale(positions: torch.Tensor) -> torch.Tensor:
    """SSMax query scale of full layers, exp(0.1 * log1p((p + 1) / 2048)) in FP32."""
    return torch.exp(SSMAX_EXPONENT * torch.log1p((positions.float() + 1) / SSMAX_BASE))


def output_gate(g: torch.Tensor, gate_bias: torch.Tensor) -> torch.Tensor:
    """The attention's output gate per element: rnd(sigmoid(rnd(g + gate_bias[h]))).
    g [T, Hq, D] (the gate_proj output, in the model dtype), gate_bias [Hq]."""
    return torch.sigmoid(g + gate_bias.to(g.dtype)[:, None])


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [B, Tq, Tk]: key j visible to query p iff j <= p and (window: p - j < window)."""
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    visible = diff >= 0
    if window is not None:
        visible &= diff < window
    return visible


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int,
          topk_group: int, top_k: int, renormalize: bool = True):
    """Beam's group-limited sigmoid router in FP32 (transformers' BeamTopKRouter; its logits
    rounded once from FP64 dots).
    x [N, H] -> (ids int64 [N, k], weights fp32 [N, k]); the routed scale is not applied here
    (it multiplies the summed expert output)."""
    # the logits' dots in FP64, rounded once: a row's value is then independent of how many
    # rows share the call (CPU FP32 GEMMs pick kernels by row count, so a decode row and the
    # same row in a verify step could differ by an ULP); within ULPs of transformers' FP32
    logits = F.linear(x.double(), weight.double()).float()
    scores = torch.sigmoid(logits)  # [N, E]
    biased = scores + bias.float()
    n, e = scores.shape
    grouped = biased.view(n, n_group, e // n_group)
    group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [N, n_group]
    kept_groups = group_score.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(n, -1)
    candidates = biased.masked_fill(~expert_mask, float("-inf"))
    ids = candidates.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights


def residual_add(h: torch.Tensor, y: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """Depth-scaled residual in the model dtype: rnd(rnd(b * y) + rnd(a * h)) (transformers'
    depth_scaled_residual_add, y being the post-norm sublayer output)."""
    return y * b + h * a


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in FP32, one rounding to gate's dtype (gate and up are GEMM outputs).
    One FP32 temporary, worked in place: an 8K-token chunk's dense MLP (20480 wide) had four
    of 640 MiB alive at once."""
    h = gate.float() if gate.dtype != torch.float32 else gate.clone()
    F.silu(h, inplace=True)
    return h.mul_(up).to(gate.dtype)
