"""Checkpoint-layout weights for the linear_* ops, made with quant_formats' encoders."""

from __future__ import annotations

import torch

from beam_trtllm import quant_formats as qf


def linear_args(fmt: str, x: torch.Tensor, n: int, seed: int, per_row: bool = False) -> tuple:
    """Positional args of beam::linear_<fmt> for a weight [n, K] ~ N(0, 1/K)."""
    k = x.shape[-1]
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    if fmt == "fp8":
        if per_row:
            pairs = [qf.quantize_fp8(row) for row in w]
            q = torch.stack([p[0] for p in pairs])
            scale = torch.stack([p[1] for p in pairs])
        else:
            q, scale = qf.quantize_fp8(w)
        input_scale = (x.abs().amax().float() / qf.FP8_MAX).reshape(())
        return x, q, scale, input_scale
    if fmt == "fp8_block":
        return (x, *qf.quantize_fp8_block(w))
    if fmt == "nvfp4":
        return (x, *qf.quantize_nvfp4(w))
    raise ValueError(fmt)
