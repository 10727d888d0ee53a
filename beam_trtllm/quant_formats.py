"""Tensor formats of quantized Beam checkpoints (ModelOpt 0.47 conventions), decode side.

Shared by the converter (`beam-trt verify`), the kernels' references and the engine, so that
the format math lives in one place. Layouts, for a Linear weight W of shape [N, K]:

- FP8 per tensor: `weight` float8_e4m3fn [N, K]; `weight_scale` fp32 [] (W ~= weight * scale).
- FP8 128x128 blocks: `weight` float8_e4m3fn [N, K]; `weight_scale` fp32
  [ceil(N/128), ceil(K/128)] (W[n, k] ~= weight[n, k] * scale[n // 128, k // 128]).
- NVFP4: `weight` uint8 [N, K/2], two E2M1 codes a byte, the EVEN element in the LOW nibble;
  `weight_scale` float8_e4m3fn [N, K/16] (one per 16 consecutive inputs); `weight_scale_2`
  fp32 [] (W ~= E2M1[code] * float(weight_scale) * weight_scale_2).
  E2M1 code = sign << 3 | magnitude index into (0, 0.5, 1, 1.5, 2, 3, 4, 6).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
FP8_BLOCK = 128
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_table(device=None) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_nvfp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> int64 codes [..., K]; element 2i from the low nibble, 2i+1 high."""
    low = (packed & 0x0F).long()
    high = (packed >> 4).long()
    return torch.stack([low, high], dim=-1).flatten(-2)


def dequantize_nvfp4(packed, weight_scale, weight_scale_2, dtype=torch.float32) -> torch.Tensor:
    values = e2m1_table(packed.device)[unpack_nvfp4_codes(packed)]  # [..., K]
    block = weight_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    return (values * block * weight_scale_2.float()).to(dtype)


def dequantize_fp8(weight, weight_scale, dtype=torch.float32) -> torch.Tensor:
    """Per-tensor (0-d scale), per-row ([N] scale) or 128x128-block (2-D scale) FP8."""
    w = weight.float()
    scale = weight_scale.float()
    if scale.dim() == 2:
        n, k = w.shape
        scale = scale.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    elif scale.dim() == 1:
        scale = scale[:, None]
    return (w * scale).to(dtype)


def fake_quant_fp8_activation(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """What a static per-tensor FP8 activation quantizer does to x (W8A8 GEMM inputs)."""
    q = (x.float() / input_scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * input_scale.float()).to(x.dtype)
