"""beam::rmsnorm and beam::add_rmsnorm: the reference ops against a reference decoder layer's
sublayer boundary, and the Triton kernels against the reference ops."""

from __future__ import annotations

import pytest
import torch

import plugins  # noqa: F401  (registers torch.ops.beam.*)
from beam_trtllm.config import PRESETS
from beam_trtllm.reference import BeamDecoderLayer
from conftest import tol
from kernel_cases import KERNEL_DEVICE
from plugins.add_rmsnorm import ref_add_rmsnorm
from plugins.rmsnorm import ROW_CONFIG, ref_rmsnorm

TINY = PRESETS["tiny"]
EPS = TINY.rms_norm_eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_op_is_a_decoder_layer_boundary(dtype):
    """h' and the next pre-norm output of the op equal the reference layer's own steps."""
    layer = BeamDecoderLayer(TINY, 2).to(dtype).eval()
    for norm in (layer.post_attention_layernorm, layer.pre_feedforward_layernorm):
        torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1)
    h = torch.randn(7, TINY.hidden_size).to(dtype)
    y = (torch.randn(7, TINY.hidden_size) * 0.3).to(dtype)
    a, b = TINY.residual_coeffs(2 * 2)
    h_new, x = torch.ops.beam.add_rmsnorm(h, y, layer.post_attention_layernorm.weight,
                                          layer.pre_feedforward_layernorm.weight, a, b, EPS)
    with torch.no_grad():
        want_h = (a * h.float() + b * layer.post_attention_layernorm(y).float()).to(dtype)
        want_x = layer.pre_feedforward_layernorm(want_h)
    assert torch.equal(h_new, want_h) and torch.equal(x, want_x)
    assert torch.equal(torch.ops.beam.rmsnorm(h, layer.input_layernorm.weight, EPS),
                       layer.input_layernorm(h))


def _rows(t, h, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, generator=gen) * scale).to(dtype)


# Several rows per tile (ROWS) with a row count that is not a multiple of it, and a persistent
# grid of one program per "SM" (4 in the interpreter), so that programs loop over tiles.
ROWS = [pytest.param(1, id="rows1"), pytest.param(4, id="rows4")]


@pytest.mark.kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h", [(1, 64), (13, 200), (5, 1000)])  # H not a power of two
def test_rmsnorm_kernel_matches_reference(t, h, dtype, rows, monkeypatch):
    monkeypatch.setitem(ROW_CONFIG, "few", dict(ROW_CONFIG["few"], ROWS=rows, programs_per_sm=1))
    x = _rows(t, h, dtype, 7, scale=3.0)
    w = (1.0 + 0.1 * _rows(1, h, torch.float32, 8)[0]).to(dtype)
    want = ref_rmsnorm(x, w, EPS)
    got = torch.ops.beam.rmsnorm(x.to(KERNEL_DEVICE), w.to(KERNEL_DEVICE), EPS).cpu()
    torch.testing.assert_close(got, want, **tol("bf16-1ulp" if dtype == torch.bfloat16
                                                else "fp32-reorder", dtype))


@pytest.mark.kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,sublayer", [(1, 64, 0), (13, 200, 5), (5, 1000, 103)])
def test_add_rmsnorm_kernel_matches_reference(t, h, sublayer, dtype, rows, monkeypatch):
    monkeypatch.setitem(ROW_CONFIG, "few", dict(ROW_CONFIG["few"], ROWS=rows, programs_per_sm=1))
    hs, y = _rows(t, h, dtype, 9), _rows(t, h, dtype, 10, scale=5.0)
    w_post = (1.0 + 0.1 * _rows(1, h, torch.float32, 11)[0]).to(dtype)
    w_pre = (1.0 + 0.1 * _rows(1, h, torch.float32, 12)[0]).to(dtype)
    a, b = TINY.residual_coeffs(sublayer)
    want_h, want_x = ref_add_rmsnorm(hs, y, w_post, w_pre, a, b, EPS)
    dev = KERNEL_DEVICE
    got_h, got_x = torch.ops.beam.add_rmsnorm(hs.to(dev), y.to(dev), w_post.to(dev),
                                              w_pre.to(dev), a, b, EPS)
    bf16 = dtype == torch.bfloat16
    one, two = ("bf16-1ulp", "bf16-2ulp") if bf16 else ("fp32-reorder", "fp32-reorder")
    torch.testing.assert_close(got_h.cpu(), want_h, **tol(one, dtype))
    torch.testing.assert_close(got_x.cpu(), want_x, **tol(two, dtype))
