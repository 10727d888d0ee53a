"""beam::rmsnorm and beam::add_rmsnorm (and their _fp8 forms, which also write the FP8 codes
of their output): the reference ops against transformers' BeamDecoderLayer's sublayer
boundaries (its norms and depth_scaled_residual_add, bit for bit), and the Triton kernels
against the reference ops."""

from __future__ import annotations

import pytest
import torch

import hf_oracle
import plugins  # noqa: F401  (registers torch.ops.beam.*)
from beam_trtllm.config import PRESETS
from beam_trtllm.quant_formats import quantize_fp8_activation
from conftest import tol
from kernel_cases import KERNEL_DEVICE
from plugins.add_rmsnorm import CHUNKED, ref_add_rmsnorm
from plugins.rmsnorm import ROW_CONFIG, ref_rmsnorm

TINY = PRESETS["tiny"]
EPS = TINY.rms_norm_eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", [0, 2, 5])
def test_add_rmsnorm_op_is_a_decoder_layer_boundary(layer, dtype):
    """Both boundaries of transformers' BeamDecoderLayer (after the attention: post-attention
    norm, residual add of index 2L, pre-FFN norm; after the FFN: post-FFN norm, index 2L + 1,
    the next layer's input norm), bit for bit in FP32 and BF16: h' = rnd(rnd(b * y_n) +
    rnd(a * h)) as depth_scaled_residual_add rounds it. In BF16 one FP32 rounding of the
    residual sum instead (the v1 formula) would differ."""
    block = hf_oracle.decoder_layer(TINY, layer, dtype, seed=layer)
    nxt = hf_oracle.decoder_layer(TINY, min(layer + 1, TINY.num_hidden_layers - 1), dtype)
    h = (torch.randn(7, TINY.hidden_size) * 2.0).to(dtype)
    y = (torch.randn(7, TINY.hidden_size) * 0.3).to(dtype)
    boundaries = [(2 * layer, block.post_attention_layernorm, block.pre_feedforward_layernorm,
                   block.attn_residual_add_idx),
                  (2 * layer + 1, block.post_feedforward_layernorm, nxt.input_layernorm,
                   block.mlp_residual_add_idx)]
    for sublayer, post, pre, idx in boundaries:
        a, b = TINY.residual_coeffs(sublayer)
        assert idx == sublayer + 2
        h_new, x = torch.ops.beam.add_rmsnorm(h, y, post.weight, pre.weight, a, b, EPS)
        with torch.no_grad():
            want_h = hf_oracle.modeling().depth_scaled_residual_add(post(y), h, idx)
            want_x = pre(want_h)
        assert torch.equal(h_new, want_h) and torch.equal(x, want_x), sublayer
        if dtype == torch.bfloat16:
            one_rounding = (a * h.float() + b * post(y).float()).to(dtype)
            assert not torch.equal(h_new, one_rounding)
    assert torch.equal(torch.ops.beam.rmsnorm(h, block.input_layernorm.weight, EPS),
                       block.input_layernorm(h))


def _rows(t, h, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, generator=gen) * scale).to(dtype)


# Several rows per tile (ROWS) with a row count that is not a multiple of it, and a persistent
# grid of one program per "SM" (4 in the interpreter), so that programs loop over tiles.
ROWS = [pytest.param(1, id="rows1"), pytest.param(4, id="rows4")]


def _use_kernel(monkeypatch, rows, key="few"):
    """rows: ROWS per tile of the whole-row kernel, or "chunked": add_rmsnorm's chunked
    prefill kernel at any row count, in 64-wide chunks (H = 200 and 1000 end in a partial one,
    H = 64 is a single chunk)."""
    if rows == "chunked":
        monkeypatch.setitem(CHUNKED, "min_rows", 1)
        monkeypatch.setitem(CHUNKED, "CHUNK", 64)
    else:
        monkeypatch.setitem(CHUNKED, "min_rows", 1 << 62)
        monkeypatch.setitem(ROW_CONFIG, key, dict(ROW_CONFIG[key], ROWS=rows, programs_per_sm=1))


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
@pytest.mark.parametrize("rows", ROWS + [pytest.param("chunked", id="chunked")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,sublayer", [(1, 64, 0), (13, 200, 5), (5, 1000, 103)])
def test_add_rmsnorm_kernel_matches_reference(t, h, sublayer, dtype, rows, monkeypatch):
    _use_kernel(monkeypatch, rows)
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
    if bf16 and t * h >= 1000:  # the residual's three roundings, not one FP32 sum rounded once
        from plugins._reference import rms_norm

        once = (a * hs.float() + b * rms_norm(y, w_post, EPS).float()).to(dtype)
        flips, moved = int((got_h.cpu() != want_h).sum()), int((once != want_h).sum())
        assert moved > t * h // 50 and flips * 10 < moved, (flips, moved)


# ---------------------------------------------------------------------------- FP8 outputs
def _codes(x):
    return x.view(torch.uint8)


def test_fp8_norm_ops_are_the_norms_plus_the_activation_quantizer():
    """rmsnorm_fp8 / add_rmsnorm_fp8 (CPU: the references) give the plain ops' outputs bit for
    bit and the codes linear_fp8 would make of them; values beyond 448 * scale saturate."""
    h, y = _rows(6, 200, torch.bfloat16, 13), _rows(6, 200, torch.bfloat16, 14, scale=4.0)
    w = (1.0 + 0.1 * _rows(1, 200, torch.float32, 15)[0]).to(torch.bfloat16)
    scale = torch.tensor(2.5 / 448)  # |x| reaches ~4: the top of the range saturates
    a, b = TINY.residual_coeffs(7)
    h_new, x, q = torch.ops.beam.add_rmsnorm_fp8(h, y, w, w, scale, a, b, EPS)
    want = ref_add_rmsnorm(h, y, w, w, a, b, EPS)
    assert torch.equal(h_new, want[0]) and torch.equal(x, want[1])
    assert torch.equal(_codes(q), _codes(quantize_fp8_activation(x, scale)))
    assert (q.float().abs() == 448).any() and not q.float().isnan().any()
    x1, q1 = torch.ops.beam.rmsnorm_fp8(h, w, scale, EPS)
    assert torch.equal(x1, ref_rmsnorm(h, w, EPS))
    assert torch.equal(_codes(q1), _codes(quantize_fp8_activation(x1, scale)))


@pytest.mark.kernel
@pytest.mark.parametrize("rows", [4, "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h", [(1, 64), (13, 200), (5, 1000)])
def test_fp8_norm_kernels_match_reference(t, h, dtype, rows, monkeypatch):
    """The kernels' x / h' as the plain kernels' (tolerances above); their FP8 codes are exactly
    the quantizer's of the x they return (same rounding, saturation, -0.0)."""
    _use_kernel(monkeypatch, rows, "few_fp8")
    hs, y = _rows(t, h, dtype, 16), _rows(t, h, dtype, 17, scale=5.0)
    w_post = (1.0 + 0.1 * _rows(1, h, torch.float32, 18)[0]).to(dtype)
    w_pre = (1.0 + 0.1 * _rows(1, h, torch.float32, 19)[0]).to(dtype)
    scale = torch.tensor(3.0 / 448)
    a, b = TINY.residual_coeffs(9)
    dev = KERNEL_DEVICE
    got_h, got_x, got_q = (v.cpu() for v in torch.ops.beam.add_rmsnorm_fp8(
        hs.to(dev), y.to(dev), w_post.to(dev), w_pre.to(dev), scale.to(dev), a, b, EPS))
    want_h, want_x = ref_add_rmsnorm(hs, y, w_post, w_pre, a, b, EPS)
    one, two = ("bf16-1ulp", "bf16-2ulp") if dtype == torch.bfloat16 else ("fp32-reorder",) * 2
    torch.testing.assert_close(got_h, want_h, **tol(one, dtype))
    torch.testing.assert_close(got_x, want_x, **tol(two, dtype))
    assert torch.equal(_codes(got_q), _codes(quantize_fp8_activation(got_x, scale)))
    got_y, got_q = (v.cpu() for v in torch.ops.beam.rmsnorm_fp8(
        hs.to(dev), w_pre.to(dev), scale.to(dev), EPS))
    torch.testing.assert_close(got_y, ref_rmsnorm(hs, w_pre, EPS), **tol(one, dtype))
    assert torch.equal(_codes(got_q), _codes(quantize_fp8_activation(got_y, scale)))


@pytest.mark.kernel
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter's own FP32 -> FP8 "
                    "cast turns NaN into 0x7C; compiled kernels use the GPU's cvt")
def test_fp8_quantizer_keeps_nan_and_saturates_inf_like_torch():
    """The FP8 activation codes of NaN, ±inf, out-of-range and tiny values are torch's: NaN stays
    NaN (a min / max clamp without NaN propagation would make it ±448), ±inf saturate."""
    from plugins._fp8_act import quant_fp8_per_tensor

    special = [float("nan"), -float("nan"), float("inf"), -float("inf"), 1e4, -1e4, 1e-9, -1e-9]
    x = torch.tensor(special + [0.5] * 8, dtype=torch.bfloat16, device="cuda")[None]
    scale = torch.tensor(2.0, device="cuda")
    got = quant_fp8_per_tensor(x, scale).cpu()
    want = quantize_fp8_activation(x.cpu(), scale.cpu())
    is_nan = torch.tensor([v != v for v in special] + [False] * 8)[None]
    assert torch.equal(_codes(got)[~is_nan], _codes(want)[~is_nan])
    assert ((_codes(got)[is_nan] & 0x7F) == 0x7F).all()  # E4M3's NaN; its sign bit is free


@pytest.mark.kernel
def test_fp8_quantizer_rounds_every_e4m3_boundary_like_torch():
    """Codes at every rounding boundary of float8_e4m3fn (each midpoint between neighbours, and
    one FP32 ulp either side), both signs, subnormals, the saturation edge and random values:
    bit for bit torch's clamp-then-cast. Compiled this is the GPU's cvt.rn.satfinite alone
    (plugins._common.to_e4m3); in the interpreter the bit arithmetic of e4m3_grid."""
    from plugins._fp8_act import quant_fp8_per_tensor

    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0..448
    mid = (grid[:-1] + grid[1:]) / 2
    below = torch.nextafter(mid, torch.zeros_like(mid))
    above = torch.nextafter(mid, torch.full_like(mid, 1e9))
    edge = torch.tensor([448.0, 447.99, 464.0, 463.99, 464.01, 480.0, 1e30, 2.0**-10, 2.0**-11])
    rand = torch.randn(4096, generator=torch.Generator().manual_seed(7)) * 60
    pos = torch.cat([grid, mid, below, above, edge, rand.abs()])
    x = torch.cat([pos, -pos])[None]
    one = torch.tensor(1.0)
    got = quant_fp8_per_tensor(x.to(KERNEL_DEVICE), one.to(KERNEL_DEVICE)).cpu()
    assert torch.equal(_codes(got), _codes(quantize_fp8_activation(x, one)))


@pytest.mark.kernel
def test_fp8_quantizer_division_is_div_rn():
    """div_rn_by (the quantizers' FP64 reciprocal product) gives div_rn's bits for every
    normal quotient and the same FP8 codes for every pair: random pairs, 4M on a GPU, 256K in
    the interpreter (NumPy's FP64; 16e9 on the H200: docs/benchmarks-history.md)."""
    from division_check import division_mismatches, random_pairs

    n = 1 << (22 if KERNEL_DEVICE == "cuda" else 18)
    x, s = random_pairs(n, seed=0, device=KERNEL_DEVICE)
    got = division_mismatches(x, s)
    assert got["normal"] == 0 and got["codes"] == 0, got


@pytest.mark.kernel
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("t", [1, 6])
def test_add_rmsnorm_adds_fp32_partials_of_y(t, splits):
    """y given as FP32 partial sums [S, T, H] (linear_fp8's split_k output): the kernels (and
    the reference) give bit for bit what they give for y = the partials' sum in order, rounded
    to h's dtype; a y of the wrong width is refused with its shape."""
    from plugins._common import sum_partials

    h = _rows(t, 200, torch.bfloat16, 21)
    parts = torch.stack([_rows(t, 200, torch.float32, 22 + s, scale=3.0) for s in range(splits)])
    w = (1.0 + 0.1 * _rows(1, 200, torch.float32, 30)[0]).to(torch.bfloat16)
    scale = torch.tensor(3.0 / 448)
    a, b = TINY.residual_coeffs(5)
    dev = KERNEL_DEVICE
    args = (w.to(dev), w.to(dev), scale.to(dev), a, b, EPS)
    got = torch.ops.beam.add_rmsnorm_fp8(h.to(dev), parts.to(dev), *args)
    want = torch.ops.beam.add_rmsnorm_fp8(h.to(dev), sum_partials(parts, h.dtype).to(dev), *args)
    for g, w_ in zip(got, want):
        assert torch.equal(_codes(g.cpu()) if g.dtype == torch.float8_e4m3fn else g.cpu(),
                           _codes(w_.cpu()) if w_.dtype == torch.float8_e4m3fn else w_.cpu())
    ref = ref_add_rmsnorm(h, parts, w, w, a, b, EPS)
    assert torch.equal(ref[0], ref_add_rmsnorm(h, sum_partials(parts, h.dtype), w, w, a, b,
                                               EPS)[0])
    with pytest.raises(Exception, match=r"y partials \(2, 1, 100\) must be \[S, 1, 200\]"):
        torch.ops.beam.add_rmsnorm(h[:1], torch.zeros(2, 1, 100), w, w, a, b, EPS)


@pytest.mark.kernel
@pytest.mark.parametrize("t", [1, 5])
def test_add_rmsnorm_combines_weighted_per_slot_outputs(t):
    """y as an MoE's per-slot outputs [k, T, H] (a transposed [T, k, H] view) with y_weights
    [T, k] (the router's, summing to ~1) and y_scale (the routed scaling factor, on the summed
    output): bit for bit add_rmsnorm of the MoE combine kernel's output with that scale (the
    kernels), and of the reference combine (the reference op); y_scale matters; a y_weights of
    the wrong shape, with a plain y, or a y_scale without y_weights is refused."""
    from plugins._moe_common import combine
    from plugins._common import sum_partials

    k, hid, scale_y = 4, 200, TINY.routed_scaling_factor
    h = _rows(t, hid, torch.bfloat16, 31)
    slots = torch.stack([_rows(k, hid, torch.bfloat16, 32 + i, scale=2.0) for i in range(t)])
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(t)) + 0.05
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    w = (1.0 + 0.1 * _rows(1, hid, torch.float32, 40)[0]).to(torch.bfloat16)
    scale = torch.tensor(3.0 / 448)
    a, b = TINY.residual_coeffs(3)
    dev = KERNEL_DEVICE
    args = (w.to(dev), w.to(dev), scale.to(dev), a, b, EPS)
    got = torch.ops.beam.add_rmsnorm_fp8(h.to(dev), slots.to(dev).transpose(0, 1), *args,
                                         weights.to(dev), scale_y)
    y = combine(slots.to(dev).reshape(t * k, hid), weights.to(dev), t, scale_y)
    want = torch.ops.beam.add_rmsnorm_fp8(h.to(dev), y, *args)
    for g, w_ in zip(got, want):
        assert torch.equal(g.cpu().view(torch.uint8), w_.cpu().view(torch.uint8))
    unscaled = torch.ops.beam.add_rmsnorm_fp8(h.to(dev), slots.to(dev).transpose(0, 1), *args,
                                              weights.to(dev))
    assert not torch.equal(unscaled[0].cpu(), got[0].cpu())
    ref = ref_add_rmsnorm(h, slots.transpose(0, 1), w, w, a, b, EPS, y_weights=weights,
                          y_scale=scale_y)
    want_y = (sum(slots[:, j].float() * weights[:, j:j + 1] for j in range(k)) * scale_y)
    assert torch.equal(sum_partials(slots.transpose(0, 1), h.dtype, weights, scale_y),
                       want_y.to(h.dtype))
    want_ref = ref_add_rmsnorm(h, want_y.to(h.dtype), w, w, a, b, EPS)
    assert torch.equal(ref[0], want_ref[0]) and torch.equal(ref[1], want_ref[1])
    with pytest.raises(Exception, match=rf"y_weights \({t}, 3\) must be \[{t}, 4\]"):
        torch.ops.beam.add_rmsnorm(h, slots.transpose(0, 1), w, w, a, b, EPS, torch.zeros(t, 3))
    with pytest.raises(Exception, match="y_weights needs y as partials"):
        torch.ops.beam.add_rmsnorm(h, h, w, w, a, b, EPS, weights)
    with pytest.raises(Exception, match="y_scale 2.5 scales a weighted sum"):
        torch.ops.beam.add_rmsnorm(h, h, w, w, a, b, EPS, None, scale_y)
