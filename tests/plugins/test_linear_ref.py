"""linear_* ops on the plain CPU path (the reference), their meta shapes and their errors."""

import pytest
import torch

import plugins  # noqa: F401
from _linear_testdata import linear_args
from beam_trtllm import quant_formats as qf
from plugins import linear_fp8, linear_fp8_block, linear_nvfp4
from plugins.registry import PluginError

REFS = {"fp8": linear_fp8.ref_linear_fp8, "fp8_block": linear_fp8_block.ref_linear_fp8_block,
        "nvfp4": linear_nvfp4.ref_linear_nvfp4}


@pytest.mark.parametrize("fmt", sorted(REFS))
def test_cpu_op_is_the_reference_and_meta_has_the_shape(fmt, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(2, 3, 160).to(torch.bfloat16)
    args = linear_args(fmt, x, n=48, seed=0)
    op = getattr(torch.ops.beam, f"linear_{fmt}")
    y = op(*args)
    assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    assert torch.equal(y, REFS[fmt](*args))
    meta = op(*(a.to("meta") for a in args))
    assert meta.shape == (2, 3, 48) and meta.dtype == torch.bfloat16


def test_fp8_reference_is_w8a8():
    x = torch.randn(5, 64)
    _, q, scale, input_scale = linear_args("fp8", x, n=24, seed=1, per_row=True)
    assert scale.shape == (24,)
    xq = (x / input_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * input_scale
    expected = xq @ (q.float() * scale[:, None]).t()
    assert torch.equal(linear_fp8.ref_linear_fp8(x, q, scale, input_scale), expected)


def test_errors_name_the_input():
    x = torch.randn(4, 64).to(torch.bfloat16)
    _, w, s, s2 = linear_args("nvfp4", x, n=32, seed=0)
    with pytest.raises(PluginError, match=r"linear_nvfp4: x has shape \[4, 48\]"):
        linear_nvfp4.ref_linear_nvfp4(x[:, :48], w, s, s2)
    with pytest.raises(PluginError, match="weight_scale has dtype"):
        linear_nvfp4.ref_linear_nvfp4(x, w, s.float(), s2)
    _, w8, s8 = linear_args("fp8_block", x, n=32, seed=0)
    with pytest.raises(PluginError, match=r"weight_scale has shape \[1, 2\], expected \[1, 1\]"):
        linear_fp8_block.ref_linear_fp8_block(x, w8, torch.ones(1, 2))
    assert qf.FP8_BLOCK == 128


def test_fp8_codes_input_reference_meta_and_errors(monkeypatch):
    """linear_fp8 on FP8 codes: the reference decodes them with input_scale (equal to the op on
    the unquantized x), the fake impl takes out_dtype, and a missing or conflicting out_dtype
    is one clear error."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(3, 64).to(torch.bfloat16)
    _, w, s, xs = linear_args("fp8", x, n=32, seed=2, per_row=True)
    codes = qf.quantize_fp8_activation(x, xs)
    y = torch.ops.beam.linear_fp8(codes, w, s, xs, torch.bfloat16)
    assert torch.equal(y, torch.ops.beam.linear_fp8(x, w, s, xs))
    meta = torch.ops.beam.linear_fp8(*(a.to("meta") for a in (codes, w, s, xs)), torch.float32)
    assert meta.shape == (3, 32) and meta.dtype == torch.float32
    with pytest.raises(PluginError, match="x holds FP8 codes: out_dtype must be one of"):
        torch.ops.beam.linear_fp8(codes, w, s, xs)
    with pytest.raises(PluginError, match="out_dtype torch.float16 differs from x's dtype"):
        torch.ops.beam.linear_fp8(x, w, s, xs, torch.float16)


def test_fp8_gemm_path_choice():
    """Decode-sized M runs the Triton swap-AB GEMM on CUDA too; cuBLAS from SMALL_M + 1 tokens
    where its rules hold (K, N multiples of 16; row-wise scales only with BF16 output)."""
    per_tensor, per_row = torch.tensor(1.0), torch.ones(64)
    small = linear_fp8.SMALL_M
    assert not linear_fp8.takes_scaled_mm(1, 64, 64, per_row, torch.bfloat16, cuda=True)
    assert not linear_fp8.takes_scaled_mm(small, 64, 64, per_row, torch.bfloat16, cuda=True)
    assert linear_fp8.takes_scaled_mm(small + 1, 64, 64, per_row, torch.bfloat16, cuda=True)
    assert not linear_fp8.takes_scaled_mm(small + 1, 64, 64, per_row, torch.float32, cuda=True)
    assert linear_fp8.takes_scaled_mm(small + 1, 64, 64, per_tensor, torch.float32, cuda=True)
    assert not linear_fp8.takes_scaled_mm(small + 1, 64, 72, per_tensor, torch.float32, cuda=True)
    assert not linear_fp8.takes_scaled_mm(4096, 64, 64, per_tensor, torch.bfloat16, cuda=False)


def test_fp8_split_k_reference_meta_rule_and_errors(monkeypatch):
    """split_k: FP32 partials over 128-aligned channel ranges that add up to the GEMM (meta
    shape [S, ..., N]); `decode_split_k` splits batch-1 o_proj (3) on 132 SMs, and a
    q/k/v-sized GEMM (2), not Beam's packed q/k/v/gate (224 tiles fill the GPU); split_k < 1 is
    refused."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(2, 3, 400).to(torch.bfloat16)
    args = linear_args("fp8", x, n=48, seed=5)
    parts = torch.ops.beam.linear_fp8(*args, None, 2)
    assert parts.shape == (2, 2, 3, 48) and parts.dtype == torch.float32
    whole = linear_fp8.ref_linear_fp8(x.float(), *args[1:])  # the same codes, FP32 out
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)
    assert linear_fp8.split_channels(400, 2) == 256 and linear_fp8.split_channels(208, 3) == 128
    meta = torch.ops.beam.linear_fp8(*(a.to("meta") for a in args), None, 3)
    assert meta.shape == (3, 2, 3, 48) and meta.dtype == torch.float32
    rule = linear_fp8.decode_split_k
    assert rule(1, 5120, 6144, 132) == 3  # o_proj: 80 tiles of 64 rows, 240 programs
    assert rule(1, 5120, 6144, 114) == 2  # ... 160 on 114 SMs (240 would need a second wave)
    assert rule(1, 8192, 5120, 132) == 2  # a q/k/v without the gate: 128 tiles
    assert rule(1, 8192, 5120, 114) == 1  # ... but not on 114 SMs (a second wave)
    assert rule(1, 5120, 4096, 132) == 2  # 3 splits would leave fewer than 2048 channels
    assert rule(17, 5120, 6144, 132) == 1 and rule(1, 256, 2048, 132) == 1
    assert rule(1, 49152, 5120, 132) == 1  # a dense gate/up: 768 tiles
    assert rule(1, 14336, 5120, 132) == 1  # Beam's q/k/v + output gate: 224 tiles
    with pytest.raises(PluginError, match="split_k must be >= 1, got 0"):
        linear_fp8.ref_linear_fp8(*args, split_k=0)
