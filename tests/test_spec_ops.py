"""The spec's per-op formulas (plugins/_reference.py) against hand-written checks and against
transformers' own functions: what every beam:: op's reference builds on."""

import itertools
import math

import torch

from beam_trtllm.config import PRESETS
from conftest import tol
from plugins._reference import (apply_rope, attention_mask, residual_add, rms_norm, route,
                                ssmax_scale)

TINY = PRESETS["tiny"]


def test_rms_norm_by_hand():
    x = torch.tensor([[3.0, 4.0]])
    w = torch.tensor([2.0, 0.5])
    rms = math.sqrt((9 + 16) / 2 + 1e-6)
    assert torch.allclose(rms_norm(x, w, 1e-6), torch.tensor([[3 / rms * 2, 4 / rms * 0.5]]))


def test_rms_norm_is_transformers_bit_for_bit():
    from transformers.models.beam.modeling_beam import BeamRMSNorm

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        norm = BeamRMSNorm(80, 1e-6).to(dtype)
        norm.weight.data = (1 + 0.1 * torch.randn(80, generator=gen)).to(dtype)
        x = (3 * torch.randn(7, 80, generator=gen)).to(dtype)
        assert torch.equal(rms_norm(x, norm.weight, 1e-6), norm(x))


def test_sliding_mask_admits_exactly_window_keys_including_query():
    pos = torch.arange(40)[None]
    visible = attention_mask(pos, pos, window=8)[0]
    for p in range(40):
        assert visible[p].nonzero().flatten().tolist() == list(range(max(0, p - 7), p + 1))
    full = attention_mask(pos, pos, window=None)[0]
    assert full[30].nonzero().flatten().tolist() == list(range(31))


def test_ssmax_uses_p_plus_1_and_fixed_constants():
    from transformers.models.beam.modeling_beam import compute_attention_scaling

    assert math.isclose(float(ssmax_scale(torch.tensor(2047))), 2**0.1, rel_tol=1e-6)
    assert math.isclose(float(ssmax_scale(torch.tensor(0))), (1 + 1 / 2048) ** 0.1, rel_tol=1e-6)
    assert math.isclose(float(ssmax_scale(torch.tensor(6143))), 4**0.1, rel_tol=1e-6)
    pos = torch.tensor([0, 1, 2047, 4095, 131071, 1048575])
    assert torch.equal(ssmax_scale(pos), compute_attention_scaling(pos[None])[0, 0, :, 0])


def test_rope_by_hand_rotate_half():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 4)
    out = apply_rope(x, torch.tensor([1]), theta=10000.0).flatten()
    f0, f1 = 1.0, 10000 ** (-2 / 4)  # inv_freq for pairs (0, 2) and (1, 3)
    want = [1 * math.cos(f0) - 3 * math.sin(f0), 2 * math.cos(f1) - 4 * math.sin(f1),
            3 * math.cos(f0) + 1 * math.sin(f0), 4 * math.cos(f1) + 2 * math.sin(f1)]
    assert torch.allclose(out, torch.tensor(want), atol=1e-6)


def test_rope_is_transformers_bit_for_bit_up_to_1m_positions():
    """FP32 angles p * inv_freq, as transformers takes them (so they drift at 1M positions
    exactly as the canonical model's do)."""
    from transformers.models.beam.modeling_beam import BeamRotaryEmbedding, apply_rotary_pos_emb

    from beam_trtllm.hf_model import hf_config

    cfg = PRESETS["beam-1.0-501b"]
    rotary = BeamRotaryEmbedding(hf_config(cfg))
    pos = torch.tensor([0, 1, 511, 2048, 65535, 1048575])
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(len(pos), 3, cfg.head_dim, generator=gen).to(dtype)  # [T, heads, D]
        cos, sin = rotary(q, pos[None], "sliding_attention")
        want, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)
        assert torch.equal(apply_rope(q, pos, cfg.rope_theta), want[0].transpose(0, 1))


def _brute_force_route(s, bias, cfg):
    """Try every subset of topk_group groups; keep the best by summed group score."""
    sb = [float(a) + float(b) for a, b in zip(s, bias)]
    size = cfg.experts_per_group
    group_score = [sum(sorted(sb[g * size:(g + 1) * size])[-2:]) for g in range(cfg.n_group)]
    best = max(itertools.combinations(range(cfg.n_group), cfg.topk_group),
               key=lambda groups: sum(group_score[g] for g in groups))
    pool = [e for g in best for e in range(g * size, (g + 1) * size)]
    chosen = sorted(pool, key=lambda e: sb[e], reverse=True)[: cfg.num_experts_per_tok]
    total = sum(float(s[e]) for e in chosen)
    return {e: float(s[e]) / total for e in chosen}  # no routed scale: it scales the sum


def test_router_matches_brute_force_over_group_subsets():
    for cfg in (TINY, PRESETS["beam-1.0-501b"]):
        gen = torch.Generator().manual_seed(1)
        n = 64 if cfg is TINY else 8
        x = torch.randn(n, cfg.hidden_size, generator=gen)
        w = torch.randn(cfg.num_experts, cfg.hidden_size, generator=gen) / cfg.hidden_size**0.5
        bias = 0.1 * torch.randn(cfg.num_experts, generator=gen)
        ids, weights = route(x, w, bias, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok)
        assert ids.shape == (n, cfg.num_experts_per_tok) and weights.dtype == torch.float32
        s = torch.sigmoid(x.double() @ w.double().t())
        for t in range(n):
            want = _brute_force_route(s[t], bias, cfg)
            got = dict(zip(ids[t].tolist(), weights[t].tolist()))
            assert set(got) == set(want)
            for e in want:
                assert math.isclose(got[e], want[e], rel_tol=1e-5)


def test_router_is_transformers():
    """Ids exact; weights within the ULPs of transformers' FP32 logit GEMM (route's dots are
    FP64, rounded once, so its rows do not depend on the batch)."""
    from transformers.models.beam.modeling_beam import BeamTopKRouter

    from beam_trtllm.hf_model import hf_config

    router = BeamTopKRouter(hf_config(TINY))
    gen = torch.Generator().manual_seed(2)
    router.weight.data = torch.randn(router.weight.shape, generator=gen) / 8
    router.e_score_correction_bias.copy_(0.05 * torch.randn(TINY.num_experts, generator=gen))
    x = torch.randn(50, TINY.hidden_size, generator=gen).bfloat16()
    _, w_hf, ids_hf = router(x)
    ids, w = route(x, router.weight, router.e_score_correction_bias, TINY.n_group,
                   TINY.topk_group, TINY.num_experts_per_tok)
    assert torch.equal(ids, ids_hf)
    torch.testing.assert_close(w, w_hf, **tol("router-logits-fp32-gemm", torch.float32))


def test_residual_keeps_unit_variance_and_weights_sublayers_equally():
    cfg = PRESETS["beam-1.0-501b"]
    assert cfg.residual_coeffs(0) == (math.sqrt(1 / 2), 1 / math.sqrt(2))
    assert cfg.residual_coeffs(1) == (math.sqrt(2 / 3), 1 / math.sqrt(3))
    gen = torch.Generator().manual_seed(0)
    h0 = torch.randn(200_000, generator=gen, dtype=torch.float64)
    h, total = h0.clone(), h0.clone()
    for k in range(2 * cfg.num_hidden_layers):
        y = torch.randn(200_000, generator=gen, dtype=torch.float64)
        h = residual_add(h, y, *cfg.residual_coeffs(k))
        total += y
        assert abs(float(h.var()) - 1.0) < 0.02, k
    # closed form: after K sublayers h = (embedding + sum of outputs) / sqrt(K + 1)
    assert torch.allclose(h, total / math.sqrt(2 * cfg.num_hidden_layers + 1), atol=1e-9)


def test_residual_is_transformers_bit_for_bit_in_bf16():
    from transformers.models.beam.modeling_beam import depth_scaled_residual_add

    gen = torch.Generator().manual_seed(3)
    h = torch.randn(9, 64, generator=gen).bfloat16()
    y = torch.randn(9, 64, generator=gen).bfloat16()
    for k in (0, 1, 7, 103):
        a, b = TINY.residual_coeffs(k)
        assert torch.equal(residual_add(h, y, a, b), depth_scaled_residual_add(y, h, k + 2))
