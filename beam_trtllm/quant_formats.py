"""Tensor formats of quantized Beam checkpoints (ModelOpt 0.47 conventions), decode side.

compressed-tensors FP8 per channel ("fp8_channel"): see the end of the file.

Shared by the converter (`beam-trt verify`), the kernels' references and the engine, so that
the format math lives in one place. Layouts, for a Linear weight W of shape [N, K]:

- FP8 per tensor: `weight` float8_e4m3fn [N, K]; `weight_scale` fp32 [] (W ~= weight * scale).
- FP8 128x128 blocks (ModelOpt `fp8_pb_wo`): `weight` float8_e4m3fn [N, K]; `weight_scale` fp32
  [ceil(N/128), 1, ceil(K/128), 1] on disk (ModelOpt 0.47 keeps the block-amax dims; a tensor
  of one block gets a 0-d scale), [ceil(N/128), ceil(K/128)] in memory
  (`fp8_block_scale_2d`); W[n, k] ~= weight[n, k] * scale[n // 128, k // 128].
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
    # (block scale * global scale) first, then the E2M1 value: ModelOpt's order, so a decode
    # here equals NVFP4QTensor.dequantize bit for bit.
    block = (weight_scale.float() * weight_scale_2.float()).repeat_interleave(NVFP4_BLOCK, dim=-1)
    return (values * block).to(dtype)


def fp8_block_scale_2d(weight_scale: torch.Tensor) -> torch.Tensor:
    """ModelOpt's on-disk block scale [nb, 1, kb, 1] (or 2-D already) -> [nb, kb]."""
    if weight_scale.dim() == 4:
        return weight_scale.reshape(weight_scale.shape[0], weight_scale.shape[2])
    return weight_scale


def fp8_block_scale_on_disk(scale_2d: torch.Tensor) -> torch.Tensor:
    """[nb, kb] -> what export_hf_checkpoint writes: [nb, 1, kb, 1], or 0-d for one block."""
    if scale_2d.numel() == 1:
        return scale_2d.reshape(())
    return scale_2d.reshape(scale_2d.shape[0], 1, scale_2d.shape[1], 1).contiguous()


def dequantize_fp8(weight, weight_scale, dtype=torch.float32) -> torch.Tensor:
    """Per-tensor (0-d scale), per-row ([N] scale) or 128x128-block (2-D or ModelOpt's 4-D
    [nb, 1, kb, 1] scale) FP8. A one-block `fp8_pb_wo` tensor has a 0-d scale: the same math."""
    w = weight.float()
    scale = fp8_block_scale_2d(weight_scale).float()
    if scale.dim() == 2:
        n, k = w.shape
        scale = scale.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    elif scale.dim() == 1:
        scale = scale[:, None]
    return (w * scale).to(dtype)


def quantize_fp8_activation(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """The codes of a static per-tensor FP8 activation quantizer: fp8(clamp(x / s, +-448))
    (IEEE FP32 division, round to nearest even, saturating)."""
    return (x.float() / input_scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fake_quant_fp8_activation(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """What a static per-tensor FP8 activation quantizer does to x (W8A8 GEMM inputs)."""
    q = quantize_fp8_activation(x, input_scale)
    return (q.float() * input_scale.float()).to(x.dtype)


def quantize_fp8_per_token_block(x: torch.Tensor, eps: float = 1e-10):
    """Dynamic FP8 activation quantization, one scale per token per 128 channels (DeepSeek-V3).

    x [..., K] -> (q float8_e4m3fn [..., K], scale fp32 [..., ceil(K/128)]) with
    scale = max(amax(group), eps) / 448 and q = clamp(x / scale, +-448). `eps` keeps an all-zero
    group finite (its codes are 0). The kernels compute exactly this (FP32 math).
    """
    k = x.shape[-1]
    groups = -(-k // FP8_BLOCK)
    xf = torch.nn.functional.pad(x.float(), (0, groups * FP8_BLOCK - k))
    xf = xf.unflatten(-1, (groups, FP8_BLOCK))
    scale = xf.abs().amax(-1).clamp_min(eps) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :k], scale


def fake_quant_fp8_per_token_block(x: torch.Tensor) -> torch.Tensor:
    """What the per-token-per-128 dynamic quantizer does to x (block-FP8 GEMM inputs)."""
    q, scale = quantize_fp8_per_token_block(x)
    groups = scale.shape[-1]
    k = x.shape[-1]
    qf = torch.nn.functional.pad(q.float(), (0, groups * FP8_BLOCK - k)).unflatten(-1, (groups, -1))
    return (qf * scale[..., None]).flatten(-2)[..., :k].to(x.dtype)


# ---------------------------------------------------------------------------- encode side
# Byte-identical to ModelOpt 0.47 (checked in tests/test_quant_encoders.py against the installed
# package): the converter and the kernels' tests make weights with these.
def _abs_max(weight: torch.Tensor) -> torch.Tensor:
    """amax |weight| (exact in any float dtype), without a full-size |weight| temporary."""
    lo, hi = torch.aminmax(weight)
    return torch.maximum(lo.abs(), hi.abs())


def quantize_fp8(weight: torch.Tensor, amax: torch.Tensor | None = None):
    """FP8 per tensor as `export_hf_checkpoint` writes it: (weight fp8 [N, K], weight_scale fp32 []).

    scale = fp32(amax / 448) from a Python-float division (`torch.tensor(amax.item() / 448)`);
    the division weight / scale runs in the weight's own dtype (a 0-d FP32 scale does not
    promote a BF16 tensor), as ModelOpt's export does.
    """
    amax = _abs_max(weight) if amax is None else amax
    scale = torch.tensor(float(amax) / FP8_MAX, dtype=torch.float32)
    if weight.device.type == "cpu":
        # CPU kernel: x / scale in FP32 with the full-precision scalar, rounded to x's dtype
        q = weight / scale
    else:
        # the same math spelled out: on CUDA a 0-d device scale would be cast to BF16 first
        q = (weight.float() / scale.to(weight.device)).to(weight.dtype)
    return q.to(torch.float8_e4m3fn), scale


def fp8_block_amax(weight: torch.Tensor) -> torch.Tensor:
    """Per 128x128 block amax (edge blocks zero-padded) as FP32 [ceil(N/128), ceil(K/128)]."""
    n, k = weight.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.nn.functional.pad(weight, (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    return padded.view(nb, FP8_BLOCK, kb, FP8_BLOCK).abs().amax(dim=(1, 3)).float()


def quantize_fp8_block(weight: torch.Tensor, block_amax: torch.Tensor | None = None):
    """FP8 128x128 blocks as `export_hf_checkpoint` writes `fp8_pb_wo`: (weight fp8 [N, K],
    weight_scale fp32 [ceil(N/128), ceil(K/128)]; see `fp8_block_scale_on_disk`).

    scale = fp32(block amax) / 448 in FP32 (the weight quantizer's FP32 amax), and the weight
    is divided by the FP32 scale in FP32 (a 2-D FP32 scale promotes the BF16 weight)."""
    n, k = weight.shape
    amax = fp8_block_amax(weight) if block_amax is None else block_amax
    scale = amax.float() / FP8_MAX
    expanded = scale.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return (weight / expanded.to(weight.device)).to(torch.float8_e4m3fn), scale


def fp8_activation_scale(amax: torch.Tensor) -> torch.Tensor:
    """`input_scale` of an FP8 Linear: fp32 amax / 448 (ModelOpt get_scaling_factor)."""
    return (amax.float() / FP8_MAX).reshape(())


def nvfp4_activation_scale(amax: torch.Tensor) -> torch.Tensor:
    """`input_scale` of an NVFP4 Linear: fp32 amax / (6 * 448)."""
    return (amax.float() / (E2M1_MAX * FP8_MAX)).reshape(())


def kv_cache_scale(amax: torch.Tensor) -> torch.Tensor:
    """`k_proj.k_scale` / `v_proj.v_scale`: fp32 amax / 448 (ModelOpt postprocess_state_dict)."""
    return (amax.float() / FP8_MAX).reshape(())


_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_ROUND_UP_TIES = (0.75, 1.75, 3.5)  # ties that round to the even (upper) code


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even E2M1 codes (sign << 3 | magnitude index), as ModelOpt's _cast_fp4."""
    magnitude = scaled.abs()
    index = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for bound in _E2M1_BOUNDS:  # searchsorted(left): the number of bounds strictly below
        index += (magnitude > bound).to(torch.uint8)
    for tie in _E2M1_ROUND_UP_TIES:
        index += (magnitude == tie).to(torch.uint8)
    return ((scaled < 0).to(torch.uint8) << 3) + index


def nvfp4_scale_2(weight: torch.Tensor) -> torch.Tensor:
    """The per-tensor NVFP4 scale amax / (6 * 448), FP32 []. Linears that share an input share
    the max of their values (ModelOpt's fused-input rule: q/k/v, an expert's gate/up)."""
    return (_abs_max(weight).float() / (E2M1_MAX * FP8_MAX)).reshape(())


def quantize_nvfp4(weight: torch.Tensor, weight_scale_2: torch.Tensor | None = None,
                   threads: int = 1):
    """NVFP4 as ModelOpt's NVFP4QTensor.quantize(weight, 16): returns (packed uint8 [N, K/2],
    weight_scale float8_e4m3fn [N, K/16], weight_scale_2 fp32 []). A BF16 CPU weight takes the
    compiled path of `quant_cpu` (same bytes, ~20x faster; `threads` splits its rows)."""
    if weight.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs the input dim to be a multiple of 16, got {weight.shape[-1]}")
    scale_2 = nvfp4_scale_2(weight) if weight_scale_2 is None else weight_scale_2.float()
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
        from . import quant_cpu

        if quant_cpu.available():
            packed, block_scale = quant_cpu.quantize_nvfp4(weight, scale_2, threads)
            return packed, block_scale, scale_2.reshape(())
    return _quantize_nvfp4_torch(weight, scale_2)


def _quantize_nvfp4_torch(weight: torch.Tensor, scale_2: torch.Tensor):
    """The same math in torch ops (any device): the CUDA path and the oracle of `quant_cpu`."""
    blocks = weight.unflatten(-1, (-1, NVFP4_BLOCK))
    block_scale = blocks.abs().amax(-1).float() / (E2M1_MAX * scale_2)
    block_scale[block_scale == 0] = 1.0
    block_scale = block_scale.clamp(min=2**-9, max=FP8_MAX).to(torch.float8_e4m3fn)
    scaled = (blocks / (block_scale.float() * scale_2)[..., None]).flatten(-2)
    codes = _e2m1_codes(scaled)
    packed = (codes[..., 1::2] << 4) | codes[..., 0::2]
    return packed, block_scale, scale_2


# ---------------------------------------------------------------------------- per channel
# compressed-tensors FP8_DYNAMIC (`float-quantized`, weights strategy "channel", activations
# strategy "token", dynamic): weight float8_e4m3fn [N, K] and weight_scale [N, 1] in the
# model's dtype (BF16 for a BF16 model), W ~= weight * weight_scale; activations quantized per
# token at run time.
def dequantize_fp8_channel(weight: torch.Tensor, weight_scale: torch.Tensor,
                           dtype: torch.dtype | None = None) -> torch.Tensor:
    """The compressed-tensors decompression of a per-channel FP8 weight: codes cast to the
    scale's dtype times the scale, in that dtype (BF16 for a BF16 checkpoint), so it equals
    `FloatQuantizationCompressor.decompress` bit for bit. `dtype` casts the result; for the
    exact FP32 product pass `weight_scale.float()`."""
    scale = weight_scale.reshape(weight.shape[0], 1)
    out = weight.to(scale.dtype) * scale
    return out if dtype is None else out.to(dtype)


def quantize_fp8_per_token(x: torch.Tensor, eps: float = 1e-10):
    """Dynamic FP8 activation quantization, one scale per token (row): x [..., K] ->
    (q float8_e4m3fn [..., K], scale fp32 [...]) with scale = max(amax(row), eps) / 448 and
    q = fp8(clamp(x / scale, +-448)) in FP32 (the kernels compute exactly this)."""
    xf = x.float()
    scale = xf.abs().amax(-1).clamp_min(eps) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fake_quant_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """What the per-token dynamic quantizer does to x (per-channel FP8 GEMM inputs)."""
    q, scale = quantize_fp8_per_token(x)
    return (q.float() * scale[..., None]).to(x.dtype)
