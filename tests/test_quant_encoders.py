"""The encoders of beam_trtllm/quant_formats.py against the installed ModelOpt 0.47, byte for byte,
and round trips through the decoders the kernels' references use."""

import pytest
import torch

from beam_trtllm import quant_formats as qf

nvfp4_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
fp8_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.fp8_tensor")


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[0, :16] = 0.0  # an all-zero NVFP4 block (its scale becomes 1.0 before the cast)
    w[1, 3] = 0.11  # a clear outlier sets the global amax
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(48, 80), (130, 272)])
def test_nvfp4_matches_modelopt_bytes(shape):
    w = _weight(*shape, seed=1)
    packed, scale, scale_2 = qf.quantize_nvfp4(w)
    ref_q, ref_scale, ref_scale_2 = nvfp4_tensor.NVFP4QTensor.quantize(w, 16)
    assert torch.equal(packed, ref_q._quantized_data)
    assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))
    assert torch.equal(scale_2, ref_scale_2.reshape(()))
    deq = qf.dequantize_nvfp4(packed, scale, scale_2)
    assert torch.equal(deq, ref_q.dequantize(torch.float32, scale=ref_scale, double_scale=ref_scale_2,
                                             block_sizes={-1: 16}))


def test_nvfp4_shared_scale_2_as_for_gate_and_up():
    gate, up = _weight(32, 64, seed=2), _weight(32, 64, seed=3) * 3
    shared = torch.maximum(qf.nvfp4_scale_2(gate), qf.nvfp4_scale_2(up))
    packed, scale, _ = qf.quantize_nvfp4(gate, shared)
    ref_q, ref_scale, _ = nvfp4_tensor.NVFP4QTensor.quantize(gate, 16, weights_scaling_factor_2=shared)
    assert torch.equal(packed, ref_q._quantized_data)
    assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))


def test_fp8_block_matches_modelopt_bytes():
    # What export_hf_checkpoint does for fp8_pb_wo: the weight quantizer's FP32 block amax / 448
    # is passed to FP8QTensor.quantize as `scales` (so the division runs in FP32). Calling it
    # without scales computes a BF16 scale instead, which is not what the exporter writes
    # (the whole export path is checked in tests/test_convert_encoders.py).
    w = _weight(200, 300, seed=4)
    q, scale = qf.quantize_fp8_block(w)
    assert torch.equal(scale, qf.fp8_block_amax(w) / 448)
    ref_q, _ = fp8_tensor.FP8QTensor.quantize(w, scale, block_sizes={-1: 128, -2: 128})
    assert torch.equal(q.view(torch.uint8), ref_q._quantized_data.view(torch.uint8))
    assert scale.shape == (2, 3) and scale.dtype == torch.float32


def test_fp8_per_tensor_divides_in_the_weight_dtype():
    w = _weight(64, 96, seed=5)
    q, scale = qf.quantize_fp8(w)
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert torch.equal(scale, w.abs().amax().float() / 448)
    # ModelOpt's export: (W_bf16 / scale).to(e4m3) with the division in bf16.
    assert torch.equal(q.view(torch.uint8), (w / scale).to(torch.float8_e4m3fn).view(torch.uint8))
    ref_q, _ = fp8_tensor.FP8QTensor.quantize(w, scales=scale)
    assert torch.equal(q.view(torch.uint8), ref_q._quantized_data.view(torch.uint8))


def test_per_token_block_activation_quant_round_trip():
    x = torch.randn(5, 200) * 3
    x[2, 128:] = 0.0  # an all-zero group stays finite
    q, scale = qf.quantize_fp8_per_token_block(x)
    assert q.shape == (5, 200) and scale.shape == (5, 2)
    assert torch.isfinite(q.float()).all()
    back = qf.fake_quant_fp8_per_token_block(x)
    assert (back - x).abs().max() <= x.abs().max() * 2**-4
    assert torch.equal(back[2, 128:], torch.zeros(72))
