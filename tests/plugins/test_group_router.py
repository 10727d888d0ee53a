"""beam::group_router: the reference op against transformers' BeamTopKRouter (ids exact, weights
to the ULP), its rows independent of the batch, and the Triton kernels against the reference op
(expert ids exact)."""

from __future__ import annotations

import pytest
import torch

import hf_oracle
import plugins  # noqa: F401  (registers torch.ops.beam.*)
from beam_trtllm.config import PRESETS
from beam_trtllm.hf_model import hf_config
from conftest import tol
from kernel_cases import KERNEL_DEVICE
from plugins.group_router import ROUTER_CONFIG, ref_group_router

TINY = PRESETS["tiny"]


def _router_case(t, e, h, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    weight = torch.randn(e, h, generator=gen) / h**0.5 * 2.0  # logits of std ~2
    bias = 0.05 * torch.randn(e, generator=gen)
    return x, weight, bias


def _route_args(cfg):
    return (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob)


def _transformers_router(cfg, weight, bias):
    router = hf_oracle.modeling().BeamTopKRouter(hf_config(cfg))
    router.weight.data, router.e_score_correction_bias.data = weight, bias
    return router


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_router_op_is_transformers_router(dtype):
    """transformers' BeamTopKRouter: FP32 sigmoid, the biased scores for the group and expert
    choice, w / (sum(w) + 1e-20), no routed scale; the ids exact, the weights within the ULPs
    of its FP32 logit GEMM (ours rounds FP64 dots once)."""
    x, weight, bias = _router_case(17, TINY.num_experts, TINY.hidden_size, 0)
    x = x.to(dtype)
    _, want_w, want_ids = _transformers_router(TINY, weight, bias)(x)
    ids, w = torch.ops.beam.group_router(x, weight, bias, *_route_args(TINY))
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w, want_w, **tol("router-logits-fp32-gemm", torch.float32))
    torch.testing.assert_close(w.sum(-1), torch.ones(17), **tol("router-weights", torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_router_rows_do_not_depend_on_the_batch(dtype):
    """A row routed alone, in a batch of 8 (a verify step's) or of 40 gets the same ids and
    weights bit for bit: speculative decoding's lossless check on the CPU rests on it."""
    x, weight, bias = _router_case(40, TINY.num_experts, TINY.hidden_size, 3)
    x = x.to(dtype)
    ids, w = ref_group_router(x, weight, bias, *_route_args(TINY))
    for rows in (slice(0, 1), slice(5, 13), slice(39, 40)):
        sub_ids, sub_w = ref_group_router(x[rows], weight, bias, *_route_args(TINY))
        assert torch.equal(sub_ids, ids[rows]) and torch.equal(sub_w, w[rows])


def _tiny_scores_case(t, e, h, seed):
    """Tokens whose chosen experts' scores sigmoid(logit) are ~1e-20 (logits near -46): the
    renormalisation's epsilon is of the size of the sum, so the weights sum to ~0.5, not 1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    unit = x / x.norm(dim=-1, keepdim=True)
    logits = -46.0 + 0.3 * torch.randn(e, generator=gen)
    # one direction for every token (the rows of x are near-parallel): logit_e = x . w_e
    x = unit[:1].expand(t, h) * (1.0 + 0.01 * torch.arange(t, dtype=torch.float32)[:, None])
    weight = logits[:, None] * unit[:1] + 1e-3 * torch.randn(e, h, generator=gen)
    return x.contiguous(), weight, 0.05 * torch.randn(e, generator=gen)


@pytest.mark.parametrize("device", [pytest.param("cpu", id="reference"),
                                    pytest.param(KERNEL_DEVICE, id="triton",
                                                 marks=pytest.mark.kernel)])
def test_renormalisation_adds_epsilon_to_the_sum(device):
    """w = s / (sum(s) + 1e-20) as BeamTopKRouter: where the chosen scores sum to ~1e-20 the
    weights sum to ~1/2 (w / sum(w) would give 1); transformers' bits on the reference, the
    router-weights tolerance on the kernels (the reference's FP64 logit dots: ULPs)."""
    x, weight, bias = _tiny_scores_case(5, TINY.num_experts, TINY.hidden_size, 3)
    _, want_w, want_ids = _transformers_router(TINY, weight, bias)(x)
    total = want_w.sum(-1)
    assert ((total > 0.2) & (total < 0.8)).all(), total
    ids, w = torch.ops.beam.group_router(x.to(device), weight.to(device), bias.to(device),
                                         *_route_args(TINY))
    assert torch.equal(ids.cpu().long(), want_ids)
    if not _runs_kernels(device):
        torch.testing.assert_close(w, want_w, **tol("router-logits-fp32-gemm", torch.float32))
    else:
        torch.testing.assert_close(w.cpu(), want_w, **tol("router-weights", torch.float32))


def _runs_kernels(device: str) -> bool:
    from plugins.registry import triton_interpreted

    return device == "cuda" or triton_interpreted()


# (T, E, H, n_group, topk_group, k, renormalize, split): the tiny router, Beam's grouping at
# a small hidden size, groups that are not powers of two, batch 1 with the channels split over
# 3 programs (H not a multiple of the split), and many tokens (the GEMM path).
CASES = [
    (1, 16, 64, 4, 2, 4, True, 1),
    (1, 256, 100, 8, 4, 8, True, 3),
    (7, 256, 96, 8, 4, 8, True, 1),
    (37, 256, 160, 8, 4, 8, True, 1),
    (5, 72, 48, 6, 3, 5, False, 2),
]


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,e,h,n_group,topk_group,k,renorm,split", CASES)
def test_group_router_kernel_matches_reference(t, e, h, n_group, topk_group, k, renorm, split,
                                               dtype, monkeypatch):
    for kind in ("few", "many"):  # 32-channel chunks, so that every split gets some channels
        monkeypatch.setitem(ROUTER_CONFIG, kind, dict(ROUTER_CONFIG[kind], SPLIT=split,
                                                      BLOCK_H=32))
    x, weight, bias = _router_case(t, e, h, seed=t + e)
    x = x.to(dtype)
    args = (n_group, topk_group, k, renorm)
    want_ids, want_w = ref_group_router(x, weight, bias, *args)
    dev = KERNEL_DEVICE
    ids, w = torch.ops.beam.group_router(x.to(dev), weight.to(dev), bias.to(dev), *args)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, **tol("router-weights", torch.float32))


def _lowest_id_first(x, weight, bias, n_group, topk_group, k):
    """The routing rule with ties broken toward the lower group / expert id (torch.topk, which
    the reference uses, leaves the order of equal values open)."""
    biased = torch.sigmoid(x.float() @ weight.t()) + bias
    epg = weight.shape[0] // n_group
    ids = []
    for row in biased.tolist():
        groups = [sorted(row[g * epg:(g + 1) * epg], reverse=True) for g in range(n_group)]
        score = [grp[0] + grp[1] for grp in groups]
        kept = sorted(range(n_group), key=lambda g: (-score[g], g))[:topk_group]
        cand = [e for g in kept for e in range(g * epg, (g + 1) * epg)]
        ids.append(sorted(cand, key=lambda e: (-row[e], e))[:k])
    return torch.tensor(ids, dtype=torch.int32)


@pytest.mark.kernel
@pytest.mark.parametrize("copies", [2, 8])
def test_group_router_kernel_breaks_ties_toward_the_lower_id(copies):
    """Experts in runs of `copies` identical weight rows and biases score equal (with 8, whole
    groups do, and the k-th place falls inside a run): the kernel's packed (score, id) keys
    pick the lowest ids among equals, groups and experts alike."""
    e, h, n_group, topk_group, k = 64, 48, 8, 3, 6
    x, weight, bias = _router_case(3, e // copies, h, seed=copies)
    weight = weight.repeat_interleave(copies, dim=0)
    bias = bias.repeat_interleave(copies)
    dev = KERNEL_DEVICE
    ids, w = torch.ops.beam.group_router(x.to(dev), weight.to(dev), bias.to(dev), n_group,
                                         topk_group, k, True)
    want = _lowest_id_first(x, weight, bias, n_group, topk_group, k)
    assert torch.equal(ids.cpu(), want)
    scores = torch.sigmoid(x @ weight.t()).gather(1, want.long())
    want_w = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(w.cpu(), want_w, **tol("router-weights", torch.float32))


@pytest.mark.kernel
@pytest.mark.parametrize("t,e,h", [(1, 256, 5120), (3, 64, 1000)])
def test_router_logits_with_preloaded_weights_are_bit_equal(t, e, h):
    """The decode chain's form of the logits GEMV (PRELOAD: each program's weight tile read
    before the wait) sums exactly what the plain form sums: the same bits, at the shipped
    batch-1 shape and at one whose channels leave splits empty."""
    import triton

    from plugins.group_router import _router_logits_kernel, logits_launch_params

    x, weight, _ = _router_case(t, e, h, seed=e + h)
    dev = KERNEL_DEVICE
    x, weight = x.to(torch.bfloat16).to(dev), weight.to(dev)
    p = logits_launch_params(t)
    assert triton.cdiv(h, p["SPLIT"]) <= p["BLOCK_H"]  # one channel block a program
    grid = (triton.cdiv(e, p["BLOCK_E"]), triton.cdiv(t, p["BLOCK_T"]), p["SPLIT"])
    got = {}
    unread = torch.zeros(1, device=dev)
    select = dict(NG=8, EPG=e // 8, TOPK_GROUP=4, K=8, RENORM=True, NG_P2=8, EPG_P2=e // 8,
                  K_P2=8)
    for preload in (False, True):
        logits = torch.full((p["SPLIT"], t, e), float("nan"), device=dev)
        _router_logits_kernel[grid](x, weight, logits, unread, unread, unread, unread, t, e,
                                    h, x.stride(0), PDL=False, PRELOAD=preload,
                                    FOLD_SELECT=False, **select, **p)
        got[preload] = logits.cpu()
    assert torch.equal(got[True].view(torch.int32), got[False].view(torch.int32))
    torch.testing.assert_close(got[True].sum(0), x.float().cpu() @ weight.cpu().t(),
                               **tol("router-weights", torch.float32))


@pytest.mark.kernel
@pytest.mark.parametrize("t", [1, 3, 8])
def test_router_selection_folded_into_the_logits_gemv_gives_the_same_bits(t):
    """The decode chain's "select" fold (the logits GEMV's last program selects; few tokens)
    gives the two-kernel router's ids and weights bit for bit, and its tickets are back at
    zero after every call."""
    from plugins import _pdl
    from _moe_testdata import sync_counters_all_zero

    x, weight, bias = _router_case(t, 256, 640, seed=11 + t)
    dev = KERNEL_DEVICE
    x, weight, bias = x.to(torch.bfloat16).to(dev), weight.to(dev), bias.to(dev)
    got = {}
    try:
        for fold in (("select",), ()):
            _pdl.set_decode_chain(fold)
            got[fold] = [a.cpu() for a in torch.ops.beam.group_router(x, weight, bias, 8, 4, 8,
                                                                       True)]
            assert sync_counters_all_zero()
    finally:
        _pdl.set_decode_chain(True)
    (ids, w), (want_ids, want_w) = got[("select",)], got[()]
    assert torch.equal(ids, want_ids)
    assert torch.equal(w.view(torch.int32), want_w.view(torch.int32))
    assert torch.equal(ids, ref_group_router(x.cpu(), weight.cpu(), bias.cpu(), 8, 4, 8,
                                             True)[0])
