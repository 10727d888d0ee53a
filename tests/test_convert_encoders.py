"""Encoders of quant_formats and the converter (torch and the compiled CPU paths) against
ModelOpt 0.47's own export of one Linear, byte for byte, on awkward shapes, all-zero blocks and
weights, zero activations and values placed exactly on every rounding boundary (E2M1 ties, E4M3
ties of the block scales, E4M3 subnormal scales)."""

from __future__ import annotations

import pytest
import torch

from beam_trtllm import quant_cpu
from beam_trtllm import quant_formats as qf
from convert import ConvertError, encode_cpu
from convert.calibrate import Calibration
from convert.plan import Unit
from convert.quantize import quantize_unit
from modelopt_reference import export_linear

BF16 = torch.bfloat16


def _random(n, k, seed, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * scale).to(BF16)


def nvfp4_boundary_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Global amax 2.625 makes weight_scale_2 = 2^-10 exactly. Row 0: block scales exactly 1,
    so q = 1024 * x lands on every E2M1 bound (ties); row 1: block scales on E4M3 ties (normal
    and subnormal) and below the 2^-9 clamp; row 2: an all-zero block; other rows random."""
    w = _random(n, k, seed)
    w[0, 0] = 2.625
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 2**-10
    row0 = torch.cat([ties, -ties])  # one block of 16, amax 6 * 2^-10 -> block scale 1.0
    w[0, 16:32] = row0.to(BF16)
    block_amax = torch.tensor([1.0625, 1.1875, 3.5 * 2**-9, 1.5 * 2**-9, 2**-11]) * 6 * 2**-10
    for j, amax in enumerate(block_amax[: k // 16 - 1]):
        w[1, 16 * (j + 1): 16 * (j + 2)] = 0.0
        w[1, 16 * (j + 1)] = amax.to(BF16)
        w[1, 16 * (j + 1) + 1] = -(amax / 3).to(BF16)
    w[2, :16] = 0.0
    return w


def fp8_boundary_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """amax 448 * 2^-10: scale 2^-10, so q = 1024 * x sits on E4M3 ties (1.0625 -> 1,
    1.1875 -> 1.25, 0.0029296875 = 1.5 * 2^-9 -> 2^-8 subnormal) in the first row."""
    w = _random(n, k, seed)
    w[0, 0] = 448 * 2**-10
    ties = torch.tensor([1.0625, 1.1875, 3.25, 1.5 * 2**-9, 2.5 * 2**-9, 240.0, 208.0]) * 2**-10
    w[0, 1: 1 + len(ties)] = ties.to(BF16)
    w[0, 1 + len(ties): 1 + 2 * len(ties)] = (-ties).to(BF16)
    return w


def _inputs(k, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 5, k, generator=g) * 2.0).to(BF16) for _ in range(2)]


@pytest.mark.parametrize("shape", [(1, 16), (37, 48), (130, 272), (257, 80)])
@pytest.mark.parametrize("path", ["torch", "compiled"])
def test_nvfp4_matches_modelopt_export(modelopt, shape, path):
    w = nvfp4_boundary_weight(*shape, seed=shape[0]) if shape[0] >= 3 else _random(*shape, 7)
    ref = export_linear(w, "nvfp4", _inputs(shape[1], 1))
    scale_2 = qf.nvfp4_scale_2(w)
    if path == "torch":
        packed, scale, _ = qf._quantize_nvfp4_torch(w, scale_2)
    else:
        packed, scale = quant_cpu.quantize_nvfp4(w, scale_2, threads=2)
    assert torch.equal(scale_2, ref["weight_scale_2"])
    assert torch.equal(packed, ref["weight"])
    assert torch.equal(scale.view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    amax = max(x.abs().amax() for x in _inputs(shape[1], 1))
    assert torch.equal(qf.nvfp4_activation_scale(amax), ref["input_scale"])


def test_nvfp4_boundaries_really_hit_ties():
    """The boundary weight puts elements exactly on the E2M1 ties (else the test above is weak)."""
    w = nvfp4_boundary_weight(8, 64, seed=0)
    scale_2 = qf.nvfp4_scale_2(w)
    assert scale_2.item() == 2**-10
    packed, scale, _ = qf._quantize_nvfp4_torch(w, scale_2)
    codes = qf.unpack_nvfp4_codes(packed[0, 8:16]).tolist()  # row 0, block 1
    # 0.25->0, 0.75->2 (1.0), 1.25->2, 1.75->4 (2.0), 2.5->4, 3.5->6 (4.0), 5->6, 6->7
    assert codes == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 15]
    s = scale[1, 1:4].float().tolist()  # 1.0625 -> 1.0, 1.1875 -> 1.25, 3.5*2^-9 -> 4*2^-9
    assert s == [1.0, 1.25, 4 * 2**-9]


@pytest.mark.parametrize("shape", [(1, 7), (37, 50), (130, 300), (200, 128)])
def test_fp8_matches_modelopt_export(modelopt, shape):
    w = fp8_boundary_weight(*shape, seed=3) if shape[1] >= 15 else _random(*shape, 3)
    ref = export_linear(w, "fp8", _inputs(shape[1], 2))
    q, scale = qf.quantize_fp8(w)
    assert torch.equal(scale, ref["weight_scale"])
    assert torch.equal(q.view(torch.uint8), ref["weight"].view(torch.uint8))
    amax = max(x.abs().amax() for x in _inputs(shape[1], 2))
    assert torch.equal(qf.fp8_activation_scale(amax), ref["input_scale"])


@pytest.mark.parametrize("shape", [(37, 50), (130, 300), (257, 129), (128, 256)])
@pytest.mark.parametrize("path", ["torch", "compiled"])
def test_fp8_block_matches_modelopt_export(modelopt, shape, path):
    """Boundary values, a BF16-subnormal block amax and (on multi-block shapes) an all-zero
    block, which ModelOpt exports with scale 1.0 and zero codes (export_amax: 0 -> 448)."""
    w = fp8_boundary_weight(*shape, seed=4)
    if shape[0] > 128:
        w[128:, :] = 0.0  # the last row band: zero blocks
        w[-1, -1] = 3e-39  # ... except one element below FLT_MIN (clamped like ModelOpt)
    ref = export_linear(w, "fp8_pb_wo")
    if path == "torch":  # the converter's fallback: torch ops on the sanitised block amax
        amax = qf.fp8_block_amax(w)
        amax = torch.where(amax == 0, 448.0, amax).clamp_min(torch.finfo(torch.float32).tiny)
        q, scale = qf.quantize_fp8_block(w, amax)
    else:
        q, scale = encode_cpu.quantize_fp8_block(w, threads=2)
    on_disk = qf.fp8_block_scale_on_disk(scale)
    assert on_disk.shape == ref["weight_scale"].shape  # [nb, 1, kb, 1], or () for one block
    assert torch.equal(on_disk, ref["weight_scale"])
    assert torch.equal(q.view(torch.uint8), ref["weight"].view(torch.uint8))
    assert "input_scale" not in ref  # weight-only: activations are quantized per token


def _quantize_linear(w, fmt: str, input_amax: float):
    """The converter's quantize stage on one Linear `m` (calibrated input amax)."""
    unit = Unit("linear", ["m.weight"], ["m"], fmt)
    calib = Calibration({"m": torch.tensor(input_amax)})
    return dict(quantize_unit(unit, {"m.weight": w}, calib, threads=2))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp8_pb_wo"])
def test_all_zero_weight_and_zero_activations(modelopt, fmt):
    """An all-zero Linear whose input calibration saw only zeros. ModelOpt 0.47 defines the
    block-FP8 weight and every input_scale (a zero amax exports as maxbound) and we match it;
    its per-tensor FP8 and NVFP4 weights come out NaN (scale 0, then 0/0), where we write
    zero codes with the same maxbound rule (docs/CONVERT.md "All-zero weights")."""
    w = torch.zeros(130, 272, dtype=BF16)
    ref = export_linear(w, fmt, [torch.zeros(2, 272, dtype=BF16)] if fmt != "fp8_pb_wo" else None)
    ours = _quantize_linear(w, fmt, 0.0)
    if fmt == "fp8_pb_wo":
        assert torch.equal(ours["m.weight_scale"], ref["weight_scale"])
        assert torch.equal(ours["m.weight"].view(torch.uint8), ref["weight"].view(torch.uint8))
        return
    assert torch.equal(ours["m.input_scale"], ref["input_scale"])  # 1.0 / 6/2688
    assert torch.isnan(ref["weight"].float() if fmt == "fp8" else ref["weight_scale"].float()).all()
    assert not ours["m.weight"].view(torch.uint8).any()
    deq = (qf.dequantize_fp8(ours["m.weight"], ours["m.weight_scale"]) if fmt == "fp8" else
           qf.dequantize_nvfp4(ours["m.weight"], ours["m.weight_scale"], ours["m.weight_scale_2"]))
    assert torch.equal(deq, torch.zeros_like(deq))  # decodes to exact zeros, no NaN


def test_non_finite_weight_is_named_by_every_encoder():
    for fmt in ("fp8", "nvfp4", "fp8_pb_wo"):
        w = _random(130, 272, 3)
        w[129, 271] = float("nan") if fmt != "fp8_pb_wo" else float("inf")
        with pytest.raises(ConvertError, match="tensor m.weight holds inf or NaN"):
            _quantize_linear(w, fmt, 1.0)


def test_fp8_block_dequant_reads_modelopt_layout():
    w = _random(130, 300, 5)
    q, scale = qf.quantize_fp8_block(w)
    a = qf.dequantize_fp8(q, scale)
    b = qf.dequantize_fp8(q, qf.fp8_block_scale_on_disk(scale))
    assert torch.equal(a, b)
    assert (a - w.float()).abs().max() <= w.float().abs().max() / 16


def test_compiled_amax_and_non_finite():
    w = _random(300, 160, 9)
    assert torch.equal(quant_cpu.bf16_abs_max(w, threads=2), w.float().abs().max())
    w[17, 5] = float("inf")
    assert torch.isinf(quant_cpu.bf16_abs_max(w))
    w[17, 5] = float("nan")
    assert torch.isnan(quant_cpu.bf16_abs_max(w))


def test_fp8_spelled_out_division_is_the_cpu_kernel():
    """The CUDA branch of quantize_fp8 spells the CPU kernel's math out (FP32 division by the
    full-precision scale, then rounding to BF16) because CUDA would first round a 0-d device
    scale to BF16; on the CPU both spellings must give the same bytes (ties included)."""
    for seed, w in enumerate([fp8_boundary_weight(130, 300, 3), _random(257, 80, 11, scale=3.0)]):
        _, scale = qf.quantize_fp8(w)
        fast = (w / scale).to(torch.float8_e4m3fn)
        spelled = (w.float() / scale).to(BF16).to(torch.float8_e4m3fn)
        assert torch.equal(fast.view(torch.uint8), spelled.view(torch.uint8)), seed
        if scale.to(BF16).float() != scale:  # a BF16-rounded scale (what CUDA would use) differs
            rounded = (w / scale.to(BF16)).to(torch.float8_e4m3fn)
            assert not torch.equal(fast.view(torch.uint8), rounded.view(torch.uint8))
