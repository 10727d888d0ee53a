"""beam::qk_prep and beam::cache_write: the reference ops against reference.py's
BeamAttention.project, and the Triton kernels against the reference ops. Cache writes are
checked bit for bit."""

from __future__ import annotations

import pytest
import torch

import plugins  # noqa: F401  (registers torch.ops.beam.*)
from beam_trtllm.config import PRESETS
from beam_trtllm.reference import BeamAttention
from conftest import tol
from kernel_cases import DTYPE_CASES, KERNEL_DEVICE
from plugins._common import FP8_DTYPE, to_cache
from plugins.cache_write import ref_cache_write
from plugins.qk_prep import GATE_CONFIG, ref_qk_prep
from plugins.registry import PluginError

TINY = PRESETS["tiny"]
EPS, THETA = TINY.rms_norm_eps, TINY.rope_theta


def _caches(n_rows, bs, hkv, d, kv_dtype, device="cpu"):
    k_cache = torch.full((n_rows, bs, hkv, d), float("nan")).to(kv_dtype).to(device)
    fp8 = kv_dtype == FP8_DTYPE
    scales = (torch.tensor(7.0 / 448 if fp8 else 1.0, device=device),
              torch.tensor(3.0 / 448 if fp8 else 1.0, device=device))
    return k_cache, k_cache.clone(), *scales


def _bits(x):
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


@pytest.mark.parametrize("gate", ["packed", "from_x"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_ref_qk_prep_is_the_reference_projection(kind, dtype, gate):
    layer = TINY.full_layers[0] if kind == "full" else TINY.sliding_layers[0]
    torch.manual_seed(0)
    attn = BeamAttention(TINY, layer).to(dtype).eval().requires_grad_(False)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=TINY.hidden_size**-0.5)
    for norm in (attn.q_norm, attn.k_norm):
        torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1)
    t = 9
    x = torch.randn(1, t, TINY.hidden_size).to(dtype)
    pos = torch.tensor([[0, 1, 5, 8, 300, 301, 4095, 100_000, 1_000_000]])  # far positions too
    q_want, k_want, v_want, g_want = attn.project(x, pos)
    w = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.g_proj.weight]
    # packed: one GEMM for q, k, v and the gate logits; from_x: q, k, v only, and the op
    # computes the gate from x and g_proj's weight
    gate_args = (x[0], attn.g_proj.weight) if gate == "from_x" else ()
    qkvg = x[0] @ torch.cat(w[:3] if gate_args else w).t()
    hkv, d = TINY.num_key_value_heads, TINY.head_dim
    k_cache, v_cache, ks, vs = _caches(4, 8, hkv, d, dtype)
    slots = torch.tensor([3, -1, 0, 31, 17, -1, 8, 9, 30])
    q, k, v, g = ref_qk_prep(qkvg, pos[0], attn.q_norm.weight, attn.k_norm.weight, k_cache,
                             v_cache, slots, ks, vs, kind == "full", EPS, THETA,
                             TINY.ssmax_base, TINY.ssmax_exponent, *gate_args)
    # The packed projection is the same matmul as the reference's separate ones up to the
    # GEMM's blocking, so compare at the matmul's own rounding.
    what = "fp32-reorder" if dtype == torch.float32 else "qk-prep"
    for got, want in ((q, q_want[0]), (k, k_want[0]), (v, v_want[0])):
        torch.testing.assert_close(got, want, **tol(what, dtype))
    torch.testing.assert_close(g, g_want[0], **tol("fp32-reorder", torch.float32))
    written = slots >= 0
    assert torch.equal(k_cache.view(-1, hkv, d)[slots[written]], k[written])
    assert torch.equal(v_cache.view(-1, hkv, d)[slots[written]], v[written])
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots[written]] = False
    assert k_cache.view(-1, hkv, d)[untouched].isnan().all()


def test_ref_cache_write_fp8_stores_saturated_value_over_scale():
    k = torch.tensor([[[0.5, -1000.0, 3.0, -0.0]]])
    k_cache, v_cache, ks, vs = _caches(2, 2, 1, 4, FP8_DTYPE)
    ref_cache_write(k, k, k_cache, v_cache, torch.tensor([2]), ks, vs)
    assert k_cache[1, 0, 0].float().tolist() == [32.0, -448.0, 192.0, -0.0]  # 0.5/(7/448)=32


# ---------------------------------------------------------------------------- kernels
def _qkvg_case(t, hq, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    width = hq * d + 2 * hkv * d + hq
    qkvg = (torch.randn(t, width, generator=gen) * 1.5).to(dtype)  # projection outputs, O(1)
    positions = torch.randint(0, 1 << 20, (t,), generator=gen)
    positions[:3] = torch.tensor([0, 1, 7])[: min(3, t)]
    qw = 1.0 + 0.1 * torch.randn(d, generator=gen)
    kw = 1.0 + 0.1 * torch.randn(d, generator=gen)
    return qkvg, positions, qw.to(dtype), kw.to(dtype)


@pytest.mark.kernel
@pytest.mark.parametrize("dtype,kv_dtype", DTYPE_CASES)
@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_qk_prep_kernel_matches_reference(kind, dtype, kv_dtype):
    t, hq, hkv, d, bs = 13, 6, 2, 32, 5  # odd token count, G = 3, block size 5
    qkvg, positions, qw, kw = _qkvg_case(t, hq, hkv, d, dtype, seed=5)
    slots = torch.randperm(7 * bs)[:t]
    slots[[2, 9]] = -1
    rest = (kind == "full", EPS, THETA, 2048.0, 0.1)
    want_caches = _caches(7, bs, hkv, d, kv_dtype)
    want = ref_qk_prep(qkvg, positions, qw, kw, want_caches[0], want_caches[1], slots,
                       *want_caches[2:], *rest)
    dev = KERNEL_DEVICE
    caches = _caches(7, bs, hkv, d, kv_dtype, dev)
    got = torch.ops.beam.qk_prep(qkvg.to(dev), positions.to(dev), qw.to(dev), kw.to(dev),
                                 caches[0], caches[1], slots.to(dev), *caches[2:], *rest)
    q, k, v, g = (x.cpu() for x in got)
    torch.testing.assert_close(q, want[0], **tol("qk-prep", dtype))
    torch.testing.assert_close(k, want[1], **tol("qk-prep", dtype))
    assert torch.equal(v, want[2])  # v is copied through
    torch.testing.assert_close(g, want[3], **tol("qk-prep", torch.float32))
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
@pytest.mark.parametrize("t", [1, 3, 21])
def test_qk_prep_kernel_gate_from_x_matches_reference(t, dtype, monkeypatch):
    """qkvg without the gate columns, gate = sigmoid(bf16(x · g_weight^T)) computed in the op;
    q/k/v/cache as with the packed gate. H = 200 (not a tile multiple), Hq = 18 (two programs
    of query heads per token, two 16-head gate tiles, both partial), G = 6 as in Beam; 1 and 3
    tokens take the FMA path, 21 two 16-token tensor-core tiles (the second partial)."""
    monkeypatch.setitem(GATE_CONFIG, "tile_tokens", 16)
    hq, hkv, d, h, bs = 18, 3, 32, 200, 5
    qkvg, positions, qw, kw = _qkvg_case(t, hq, hkv, d, dtype, seed=7 + t)
    qkv = qkvg[:, :-hq].contiguous()
    gen = torch.Generator().manual_seed(t)
    x = (torch.randn(t, h, generator=gen) * 2).to(dtype)  # a normed hidden row, RMS ~ 2
    g_weight = (torch.randn(hq, h, generator=gen) * h**-0.5).to(dtype)
    slots = torch.randperm(7 * bs)[:t] if t <= 7 * bs else torch.full((t,), -1)
    rest = (False, EPS, THETA, 2048.0, 0.1)
    want_caches = _caches(7, bs, hkv, d, dtype)
    want = ref_qk_prep(qkv, positions, qw, kw, *want_caches[:2], slots, *want_caches[2:], *rest,
                       x, g_weight)
    dev = KERNEL_DEVICE
    caches = _caches(7, bs, hkv, d, dtype, dev)
    got = torch.ops.beam.qk_prep(qkv.to(dev), positions.to(dev), qw.to(dev), kw.to(dev),
                                 caches[0], caches[1], slots.to(dev), *caches[2:], *rest,
                                 x.to(dev), g_weight.to(dev))
    q, k, v, g = (o.cpu() for o in got)
    torch.testing.assert_close(q, want[0], **tol("qk-prep", dtype))
    torch.testing.assert_close(k, want[1], **tol("qk-prep", dtype))
    assert torch.equal(v, want[2])
    torch.testing.assert_close(g, want[3], **tol("gate-from-x", dtype))
    # data movement, exact: each written slot holds the op's own k / v (which may sit a few
    # FP32 ULPs from the reference's on a GPU), every other slot is untouched
    expect_k, expect_v = _caches(7, bs, hkv, d, dtype)[:2]
    ref_cache_write(k, v, expect_k, expect_v, slots, *(s.cpu() for s in caches[2:]))
    assert torch.equal(_bits(caches[0].cpu()), _bits(expect_k))
    assert torch.equal(_bits(caches[1].cpu()), _bits(expect_v))


@pytest.mark.kernel
@pytest.mark.parametrize("dtype,kv_dtype", DTYPE_CASES)
@pytest.mark.parametrize("kind,gate", [("sliding", "packed"), ("full", "from-x"),
                                       ("sliding", "from-x")])
def test_qk_prep_kernel_adds_split_partials(kind, gate, dtype, kv_dtype):
    """qkvg as a split GEMM's FP32 partials (3 here; the GPU's batch-1 q/k/v takes 2) with
    out_dtype: every output and cache row equals the op's on their in-order sum rounded to
    out_dtype, bit for bit; the reference op agrees."""
    t, hq, hkv, d, h, bs = 5, 6, 2, 32, 48, 5
    gen = torch.Generator().manual_seed(11)
    width = hq * d + 2 * hkv * d + (hq if gate == "packed" else 0)
    parts = torch.randn(3, t, width, generator=gen) * 0.9  # three K slices of O(1) outputs
    summed = (parts[0] + parts[1] + parts[2]).to(dtype)
    _, positions, qw, kw = _qkvg_case(t, hq, hkv, d, dtype, seed=12)
    gate_args = ()
    if gate == "from-x":
        gate_args = ((torch.randn(t, h, generator=gen) * 2).to(dtype),
                     (torch.randn(hq, h, generator=gen) * h**-0.5).to(dtype))
    slots = torch.randperm(7 * bs, generator=gen)[:t]
    rest = (kind == "full", EPS, THETA, 2048.0, 0.1)
    dev = KERNEL_DEVICE
    on_dev = [a.to(dev) for a in (positions, qw, kw)]
    outs = []
    for qkvg, extra in ((summed, {}), (parts, {"out_dtype": dtype})):
        caches = _caches(7, bs, hkv, d, kv_dtype, dev)
        got = torch.ops.beam.qk_prep(qkvg.to(dev), *on_dev, caches[0], caches[1],
                                     slots.to(dev), *caches[2:], *rest,
                                     *(a.to(dev) for a in gate_args), **extra)
        outs.append([o.cpu() for o in (*got, caches[0], caches[1])])
    for got, want in zip(outs[1], outs[0]):
        assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))
    ref_caches = _caches(7, bs, hkv, d, kv_dtype)
    want = ref_qk_prep(parts, positions, qw, kw, ref_caches[0], ref_caches[1], slots,
                       *ref_caches[2:], *rest, *gate_args, out_dtype=dtype)
    torch.testing.assert_close(outs[1][0], want[0], **tol("qk-prep", dtype))
    assert torch.equal(outs[1][2], want[2])  # v: the rounded sum, copied through


def test_qk_prep_refuses_partials_without_out_dtype():
    parts = torch.randn(2, 3, 6 * 32 + 2 * 2 * 32 + 6)
    k_cache, v_cache, ks, vs = _caches(4, 4, 2, 32, torch.float32)
    w = torch.ones(32)
    with pytest.raises(PluginError, match="needs out_dtype"):
        torch.ops.beam.qk_prep(parts, torch.arange(3), w, w, k_cache, v_cache,
                               torch.arange(3), ks, vs, False, EPS, THETA, 2048.0, 0.1)
