"""beam::qk_prep and beam::cache_write: the reference ops against transformers' BeamAttention
(its own forward, bit for bit), RoPE angles and the SSMax scale against transformers' at far
positions, and the Triton kernels against the reference ops. Cache writes are checked bit for
bit."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import hf_oracle
import plugins  # noqa: F401  (registers torch.ops.beam.*)
from beam_trtllm.config import PRESETS, SLIDING
from beam_trtllm.hf_model import hf_config
from conftest import tol
from kernel_cases import DTYPE_CASES, KERNEL_DEVICE
from plugins._common import FP8_DTYPE
from plugins._reference import rope_cos_sin, ssmax_scale
from plugins._rope import rope_inv_freq, rotation
from plugins.cache_write import ref_cache_write
from plugins.qk_prep import ref_qk_prep
from plugins.registry import PluginError

TINY = PRESETS["tiny"]
EPS, THETA = TINY.rms_norm_eps, TINY.rope_theta
# Positions where RoPE's FP32 angles and SSMax are far from their small-position values: SSMax
# at p + 1 (s(0) != 1, s(2047) = 2^0.1 = 1.072), angles of up to 2^20 radians.
FAR = [0, 1, 5, 2046, 2047, 2048, 4095, 100_000, 1_000_000, (1 << 20) - 1]


def _caches(n_rows, bs, hkv, d, kv_dtype, device="cpu"):
    k_cache = torch.full((n_rows, bs, hkv, d), float("nan")).to(kv_dtype).to(device)
    fp8 = kv_dtype == FP8_DTYPE
    scales = (torch.tensor(7.0 / 448 if fp8 else 1.0, device=device),
              torch.tensor(3.0 / 448 if fp8 else 1.0, device=device))
    return k_cache, k_cache.clone(), *scales


def _bits(x):
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_ref_qk_prep_is_transformers_attention(kind, dtype):
    """q (normed, then RoPE'd or SSMax-scaled), k, v and the element-wise output gate
    sigmoid(gate_proj(x) + gate_bias[h]) (nonzero bias) of the reference op are, bit for bit,
    what transformers' BeamAttention.forward computes from the same projections, at positions
    up to 2^20; the cache rows written are the op's k / v, and no other row moves."""
    layer = TINY.full_layers[0] if kind == "full" else TINY.sliding_layers[0]
    attn = hf_oracle.attention(TINY, layer, dtype, seed=1)
    assert attn.gate_bias.abs().min() > 0
    t = len(FAR)
    x = torch.randn(1, t, TINY.hidden_size).to(dtype)
    pos = torch.tensor([FAR])
    want = hf_oracle.projections(TINY, attn, x, pos)
    hkv, d = TINY.num_key_value_heads, TINY.head_dim
    k_cache, v_cache, ks, vs = _caches(4, 8, hkv, d, dtype)
    slots = torch.tensor([3, -1, 0, 31, 17, -1, 8, 9, 30, 1])
    got = ref_qk_prep(hf_oracle.packed_projection(attn, x[0]), pos[0], attn.q_norm.weight,
                      attn.k_norm.weight, attn.gate_bias, k_cache, v_cache, slots, ks, vs,
                      kind == "full", EPS, THETA)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == dtype and torch.equal(g, w[0]), name
    assert got[3].shape == (t, TINY.num_attention_heads, d) and torch.equal(got[3], want[3][0])
    written = slots >= 0
    assert torch.equal(k_cache.view(-1, hkv, d)[slots[written]], got[1][written])
    assert torch.equal(v_cache.view(-1, hkv, d)[slots[written]], got[2][written])
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots[written]] = False
    assert k_cache.view(-1, hkv, d)[untouched].isnan().all()


def test_ssmax_scale_is_transformers_at_p_plus_one():
    """The SSMax scale is transformers' compute_attention_scaling bit for bit: exp(0.1 *
    log1p((p + 1) / 2048)) in FP32, so 1.0000488 at p = 0 (not 1: position p + 1) and 2^0.1
    at p = 2047, growing to 1.38 at 2^20."""
    pos = torch.tensor(FAR)
    got = ssmax_scale(pos)
    want = hf_oracle.modeling().compute_attention_scaling(pos[None])[0, 0, :, 0]
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert got[0] > 1.0 and math.isclose(got[0], (1 + 1 / 2048) ** 0.1, rel_tol=1e-6)
    assert math.isclose(got[FAR.index(2047)], 2 ** 0.1, rel_tol=1e-6)
    assert got[-1] > 1.38


def test_rope_angles_are_transformers_fp32_angles():
    """cos / sin of the RoPE angles are BeamRotaryEmbedding's bit for bit up to 2^20: the FP32
    product p * inv_freq (which at 1M is 0.03 rad away from the exact angle, so an FP64 angle
    would not match) and the FP32 inverse frequencies."""
    mb, hf = hf_oracle.modeling(), hf_config(TINY)
    pos = torch.tensor([FAR])
    x = torch.zeros(1, len(FAR), TINY.hidden_size)
    want_cos, want_sin = mb.BeamRotaryEmbedding(hf)(x, pos, SLIDING)
    cos, sin = rope_cos_sin(pos, TINY.head_dim, THETA)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert torch.equal(rope_inv_freq(THETA, TINY.head_dim, "cpu"),
                       mb.BeamRotaryEmbedding(hf).sliding_attention_inv_freq)
    exact = pos[..., None].double() * rope_inv_freq(THETA, TINY.head_dim, "cpu").double()
    assert (exact.cos()[..., : TINY.head_dim // 2].float() - cos[..., : TINY.head_dim // 2]
            ).abs().max() > 1e-2


@triton.jit
def _rotation_kernel(pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, IS_FULL: tl.constexpr,
                     D: tl.constexpr, BLOCK_D2: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_D2)[None, :]
    cos, sin = rotation(pos_ptr, inv_freq_ptr, t, d, IS_FULL, D)
    tl.store(cos_ptr + t * (D // 2) + d, cos, mask=d < D // 2)
    tl.store(sin_ptr + t * (D // 2) + d, sin, mask=d < D // 2)


@pytest.mark.kernel
@pytest.mark.parametrize("d", [16, 24])  # 24: half of it (12) is not a power of two
def test_kernel_rotation_is_transformers_angles_and_ssmax(d):
    """qk_prep's `rotation`: on sliding layers cos / sin of the FP32 angle p * inv_freq
    (transformers' BeamRotaryEmbedding) up to p = 2^20, on full layers (SSMax s(p + 1), 0),
    to the last ULPs of the math library."""
    dev = KERNEL_DEVICE
    pos = torch.tensor(FAR + [3_000_000])
    inv_freq = rope_inv_freq(THETA, d, dev)
    out = {}
    for full in (False, True):
        cos = torch.full((len(pos), d // 2), float("nan"), device=dev)
        sin = cos.clone()
        _rotation_kernel[(len(pos),)](pos.to(dev), inv_freq, cos, sin, IS_FULL=full, D=d,
                                      BLOCK_D2=triton.next_power_of_2(d // 2))
        out[full] = cos.cpu(), sin.cpu()
    want_cos, want_sin = rope_cos_sin(pos, d, THETA)
    math_tol = tol("fp32-math", torch.float32)
    torch.testing.assert_close(out[False][0], want_cos[:, : d // 2], **math_tol)
    torch.testing.assert_close(out[False][1], want_sin[:, : d // 2], **math_tol)
    scale = ssmax_scale(pos)[:, None].expand(-1, d // 2)
    torch.testing.assert_close(out[True][0], scale, **math_tol)
    assert torch.equal(out[True][1], torch.zeros_like(scale))


def test_ref_cache_write_fp8_stores_saturated_value_over_scale():
    k = torch.tensor([[[0.5, -1000.0, 3.0, -0.0]]])
    k_cache, v_cache, ks, vs = _caches(2, 2, 1, 4, FP8_DTYPE)
    ref_cache_write(k, k, k_cache, v_cache, torch.tensor([2]), ks, vs)
    assert k_cache[1, 0, 0].float().tolist() == [32.0, -448.0, 192.0, -0.0]  # 0.5/(7/448)=32


# ---------------------------------------------------------------------------- kernels
def _qkvg_case(t, hq, hkv, d, dtype, seed):
    """A packed projection [T, 2·Hq·D + 2·Hkv·D] of O(1) outputs (gate logits of std 1.5),
    positions at random up to 2^20 and far ones first, norm weights, a per-head gate bias."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * hq * d + 2 * hkv * d
    qkvg = (torch.randn(t, width, generator=gen) * 1.5).to(dtype)
    positions = torch.randint(0, 1 << 20, (t,), generator=gen)
    first = torch.tensor([0, 1, 2047, 7, 2048, 100_000])[: min(6, t)]
    positions[: len(first)] = first
    qw = 1.0 + 0.1 * torch.randn(d, generator=gen)
    kw = 1.0 + 0.1 * torch.randn(d, generator=gen)
    gate_bias = 0.5 * torch.randn(hq, generator=gen)
    return qkvg, positions, qw.to(dtype), kw.to(dtype), gate_bias.to(dtype)


def _gate_tol(dtype):
    """The gate's sigmoid(rnd(g + b)): the kernel's FP32 exp differs by ULPs from torch's, so
    a BF16 gate near a rounding boundary can land one ULP away."""
    return tol("bf16-1ulp", dtype) if dtype == torch.bfloat16 else tol("qk-prep", dtype)


@pytest.mark.kernel
@pytest.mark.parametrize("dtype,kv_dtype", DTYPE_CASES)
@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_qk_prep_kernel_matches_reference(kind, dtype, kv_dtype):
    """13 tokens (odd), G = 3, block size 5, positions to 2^20 (SSMax far from 1 on the full
    layer), nonzero gate bias."""
    t, hq, hkv, d, bs = 13, 6, 2, 32, 5
    qkvg, positions, qw, kw, gb = _qkvg_case(t, hq, hkv, d, dtype, seed=5)
    slots = torch.randperm(7 * bs)[:t]
    slots[[2, 9]] = -1
    rest = (kind == "full", EPS, THETA)
    want_caches = _caches(7, bs, hkv, d, kv_dtype)
    want = ref_qk_prep(qkvg, positions, qw, kw, gb, want_caches[0], want_caches[1], slots,
                       *want_caches[2:], *rest)
    dev = KERNEL_DEVICE
    caches = _caches(7, bs, hkv, d, kv_dtype, dev)
    got = torch.ops.beam.qk_prep(qkvg.to(dev), positions.to(dev), qw.to(dev), kw.to(dev),
                                 gb.to(dev), caches[0], caches[1], slots.to(dev), *caches[2:],
                                 *rest)
    q, k, v, g = (x.cpu() for x in got)
    torch.testing.assert_close(q, want[0], **tol("qk-prep", dtype))
    torch.testing.assert_close(k, want[1], **tol("qk-prep", dtype))
    assert torch.equal(v, want[2])  # v is copied through
    assert g.dtype == dtype and g.shape == (t, hq, d)
    torch.testing.assert_close(g, want[3], **_gate_tol(dtype))
    # data movement, exact: each written slot holds store(the op's own k / v), nothing else moved
    expect_k, expect_v = _caches(7, bs, hkv, d, kv_dtype)[:2]
    ref_cache_write(k, v, expect_k, expect_v, slots, *(s.cpu() for s in caches[2:]))
    assert torch.equal(_bits(caches[0].cpu()), _bits(expect_k))
    assert torch.equal(_bits(caches[1].cpu()), _bits(expect_v))


@pytest.mark.kernel
@pytest.mark.parametrize("dtype,kv_dtype", DTYPE_CASES)
def test_cache_write_kernel_is_exact(dtype, kv_dtype):
    t, hkv, d, bs = 11, 3, 24, 8  # head_dim and head count not powers of two
    gen = torch.Generator().manual_seed(6)
    k = (torch.randn(t, hkv, d, generator=gen) * 3).to(dtype)
    v = (torch.randn(t, hkv, d, generator=gen) * 3).to(dtype)
    k[0, 0, :3] = torch.tensor([1e4, -1e4, -1e-9]).to(dtype)  # saturates / tiny negative in FP8
    slots = torch.randperm(4 * bs, generator=gen)[:t]
    slots[[1, 6]] = -1
    want_k, want_v, ks, vs = _caches(4, bs, hkv, d, kv_dtype)
    ref_cache_write(k, v, want_k, want_v, slots, ks, vs)
    dev = KERNEL_DEVICE
    got_k, got_v, ks_d, vs_d = _caches(4, bs, hkv, d, kv_dtype, dev)
    torch.ops.beam.cache_write(k.to(dev), v.to(dev), got_k, got_v, slots.to(dev), ks_d, vs_d)
    assert torch.equal(_bits(got_k.cpu()), _bits(want_k))
    assert torch.equal(_bits(got_v.cpu()), _bits(want_v))


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 4])
def test_qk_prep_kernel_gate_on_awkward_heads(t, dtype):
    """The element-wise gate with its per-head bias where the tiles do not fit: Hq = 18 (two
    programs of 16 query heads, the second mostly empty), head_dim 24 (a 32-wide tile, 12 of
    whose halves' lanes are masked), G = 6 as in Beam; the gate bias in FP32 (the op rounds it
    to the model dtype first, as the model holds it)."""
    hq, hkv, d, bs = 18, 3, 24, 4
    qkvg, positions, qw, kw, _ = _qkvg_case(t, hq, hkv, d, dtype, seed=7 + t)
    gb = torch.linspace(-2.0, 2.0, hq)
    slots = torch.randperm(3 * bs)[:t]
    rest = (False, EPS, THETA)
    ref_caches = _caches(3, bs, hkv, d, dtype)
    want = ref_qk_prep(qkvg, positions, qw, kw, gb, *ref_caches[:2], slots, *ref_caches[2:],
                       *rest)
    dev = KERNEL_DEVICE
    caches = _caches(3, bs, hkv, d, dtype, dev)
    got = [o.cpu() for o in torch.ops.beam.qk_prep(
        qkvg.to(dev), positions.to(dev), qw.to(dev), kw.to(dev), gb.to(dev), caches[0],
        caches[1], slots.to(dev), *caches[2:], *rest)]
    torch.testing.assert_close(got[0], want[0], **tol("qk-prep", dtype))
    torch.testing.assert_close(got[3], want[3], **_gate_tol(dtype))
    # the bias is per head, broadcast over head_dim: head 0 (bias -2) gates lower than head 17
    assert got[3][:, 0].float().mean() < got[3][:, -1].float().mean()


@pytest.mark.kernel
@pytest.mark.parametrize("dtype,kv_dtype", DTYPE_CASES)
@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_qk_prep_kernel_adds_split_partials(kind, dtype, kv_dtype):
    """qkvg as a split GEMM's FP32 partials (3 here; the GPU's batch-1 q/k/v takes 2) with
    out_dtype: every output (the gate too) and cache row equals the op's on their in-order sum
    rounded to out_dtype, bit for bit; the reference op agrees."""
    t, hq, hkv, d, bs = 5, 6, 2, 32, 5
    gen = torch.Generator().manual_seed(11)
    width = 2 * hq * d + 2 * hkv * d
    parts = torch.randn(3, t, width, generator=gen) * 0.9  # three K slices of O(1) outputs
    summed = (parts[0] + parts[1] + parts[2]).to(dtype)
    _, positions, qw, kw, gb = _qkvg_case(t, hq, hkv, d, dtype, seed=12)
    slots = torch.randperm(7 * bs, generator=gen)[:t]
    rest = (kind == "full", EPS, THETA)
    dev = KERNEL_DEVICE
    on_dev = [a.to(dev) for a in (positions, qw, kw, gb)]
    outs = []
    for qkvg, extra in ((summed, {}), (parts, {"out_dtype": dtype})):
        caches = _caches(7, bs, hkv, d, kv_dtype, dev)
        got = torch.ops.beam.qk_prep(qkvg.to(dev), *on_dev, caches[0], caches[1],
                                     slots.to(dev), *caches[2:], *rest, **extra)
        outs.append([o.cpu() for o in (*got, caches[0], caches[1])])
    for got, want in zip(outs[1], outs[0]):
        assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))
    ref_caches = _caches(7, bs, hkv, d, kv_dtype)
    want = ref_qk_prep(parts, positions, qw, kw, gb, ref_caches[0], ref_caches[1], slots,
                       *ref_caches[2:], *rest, out_dtype=dtype)
    torch.testing.assert_close(outs[1][0], want[0], **tol("qk-prep", dtype))
    assert torch.equal(outs[1][2], want[2])  # v: the rounded sum, copied through
    torch.testing.assert_close(outs[1][3], want[3], **_gate_tol(dtype))


def test_qk_prep_refuses_partials_without_out_dtype():
    parts = torch.randn(2, 3, 2 * 6 * 32 + 2 * 2 * 32)
    k_cache, v_cache, ks, vs = _caches(4, 4, 2, 32, torch.float32)
    w = torch.ones(32)
    with pytest.raises(PluginError, match="needs out_dtype"):
        torch.ops.beam.qk_prep(parts, torch.arange(3), w, w, torch.zeros(6), k_cache, v_cache,
                               torch.arange(3), ks, vs, False, EPS, THETA)
