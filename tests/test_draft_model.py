"""The DFlash2 drafter's forward (beam_trtllm/draft/) against plain PyTorch and its formulas
(shared/research/dflash2.md §3-§6); its checkpoints are test_draft_checkpoint.py's."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from conftest import tol
from draft_helpers import (CFG, KV_BLOCK, drafter, forbid_host_reads, random_weights,
                           target_tables, with_context)

from beam_trtllm.draft import DFlash2Drafter, DraftKV, init_draft_weights
from beam_trtllm.draft import layers as L

def plain_prenorm(w, embed, ids, starts, states):
    """Plain pre-norm layers (what an identity conv reduces DFlash2 to), written directly:
    r += o(attn(norm r)), r += mlp(norm r), non-causal window attention over the context keys
    [0, P0) and the block's keys. Returns the final normed states [R, B, H]."""
    c, eps = CFG, CFG.rms_norm_eps
    nh, nkv, d, b = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.block_size

    def norm(x, wt):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * wt

    def rot(x, pos):  # x [T, heads, d]
        inv = 1.0 / c.rope_theta ** (torch.arange(0, d, 2).float() / d)
        ang = pos[:, None].float() * inv
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    out = []
    for r, p0 in enumerate(starts):
        ctx = norm(states[r] @ w["fc.weight"].T, w["hidden_norm.weight"])
        res = embed[ids[r]]
        qpos, cpos = p0 + torch.arange(b), torch.arange(p0)
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            x = norm(res, w[p + "input_layernorm.weight"])

            def kv(inp, pos):
                k = (inp @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, d)
                k = rot(norm(k, w[p + "self_attn.k_norm.weight"]), pos)
                return k, (inp @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, d)
            kc, vc = kv(ctx, cpos)
            kb, vb = kv(x, qpos)
            keys, vals, kpos = torch.cat([kc, kb]), torch.cat([vc, vb]), torch.cat([cpos, qpos])
            q = rot(norm((x @ w[p + "self_attn.q_proj.weight"].T).view(b, nh, d),
                         w[p + "self_attn.q_norm.weight"]), qpos)
            heads = []
            for h in range(nh):
                s = q[:, h] @ keys[:, h // (nh // nkv)].T / math.sqrt(d)
                s = s.masked_fill((qpos[:, None] - kpos[None]).abs() >= c.sliding_window,
                                  float("-inf"))
                heads.append(s.softmax(-1) @ vals[:, h // (nh // nkv)])
            res = res + torch.cat(heads, -1) @ w[p + "self_attn.o_proj.weight"].T
            y = norm(res, w[p + "post_attention_layernorm.weight"])
            act = F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)
            res = res + act @ w[p + "mlp.down_proj.weight"].T
        out.append(norm(res, w["norm.weight"]))
    return torch.stack(out)


def block_ids(anchors):
    return torch.tensor([[a] + [CFG.mask_token_id] * CFG.num_draft_tokens for a in anchors])


STARTS = [37, 5, 1]  # more context than the window, less, almost none


def test_identity_conv_makes_each_layer_a_plain_prenorm_layer():
    w = random_weights(CFG, 3)
    ident = init_draft_weights(CFG)
    for i in range(CFG.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            for part in (".base_kernel", ".kernel_projection.weight"):
                w[f"layers.{i}.{conv}{part}"] = ident[f"layers.{i}.{conv}{part}"]
    model = drafter(w)
    kv, table, states = with_context(model, STARTS)
    ids = block_ids([3, 250, 17])
    got = model.block_hidden(kv, ids, torch.tensor(STARTS), table)
    want = plain_prenorm(w, model.embed, ids, STARTS, states)
    torch.testing.assert_close(got, want, **tol("fp32-reorder", torch.float32))


def test_grouped_conv_is_the_spec_formula_and_never_crosses_a_block_start():
    gen = torch.Generator().manual_seed(4)
    r, b, h, taps, g = 3, CFG.block_size, CFG.hidden_size, 4, CFG.conv_group_size
    x = torch.randn(r, b, h, generator=gen)
    base = torch.randn(taps, h, generator=gen)
    delta = torch.randn(r, b, taps, h // g, generator=gen)
    got = L.grouped_conv(x, base, delta, g)
    flat_x, flat_d = x.reshape(r * b, h), delta.reshape(r * b, taps, -1)
    want = torch.zeros(r * b, h, dtype=torch.float64)
    for t in range(r * b):  # rows laid out in per-request blocks; pos(t) = t mod B
        for tau in range(taps):
            if t % b >= tau:
                for c in range(h):
                    coeff = base[tau, c].double() + flat_d[t, tau, c // g].double()
                    want[t, c] += coeff * flat_x[t - tau, c].double()
    torch.testing.assert_close(got.reshape(r * b, h).double(), want,
                               **tol("fp32-reorder", torch.float32))
    # through the whole drafter: another request's block changes, this one's rows do not
    model = drafter()
    kv, table, _ = with_context(model, STARTS)
    ids = block_ids([3, 250, 17])
    first = model.block_hidden(kv, ids, torch.tensor(STARTS), table)
    ids[0, -1], ids[2, 0] = 123, 321  # the rows just before / at request 1's block edges
    second = model.block_hidden(kv, ids, torch.tensor(STARTS), table)
    assert torch.equal(first[1], second[1])
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[2], second[2])


def test_attention_is_non_causal_within_the_block():
    model = drafter()
    kv, table, _ = with_context(model, STARTS)
    ids = block_ids([3, 250, 17])
    first = model.block_hidden(kv, ids, torch.tensor(STARTS), table)
    ids[0, 4] = 77  # a later row: the conv looks back only, so rows 0-3 see it by attention
    second = model.block_hidden(kv, ids, torch.tensor(STARTS), table)
    for row in range(4):
        assert (first[0, row] - second[0, row]).abs().max() > 1e-4, row
    assert torch.equal(first[1:], second[1:])


def test_context_kv_is_what_the_block_path_writes_for_the_same_state():
    """Layer 0 with input_layernorm = hidden_norm and an identity input conv: a block row
    whose embedding is W_fc x has u' = c(x), so its K/V written at P0+s must be context_kv's
    for x at P0+s."""
    w = random_weights(CFG, 5)
    w["layers.0.input_layernorm.weight"] = w["hidden_norm.weight"].clone()
    w["layers.0.attention_conv.kernel_projection.weight"].zero_()
    w["layers.0.attention_conv.base_kernel"][0] = init_draft_weights(CFG)[
        "layers.0.attention_conv.base_kernel"][0]
    gen = torch.Generator().manual_seed(6)
    x = 2.0 * torch.randn(2, 3 * CFG.hidden_size, generator=gen)  # anchor's, the mask's
    embed, head = target_tables()
    embed[[11, CFG.mask_token_id]] = x @ w["fc.weight"].T
    model = DFlash2Drafter(CFG, w, embed, head, "cpu", torch.float32)
    kv, table, _ = with_context(model, [9])
    p0 = 9
    model.draft(kv, torch.tensor([11]), torch.tensor([p0]), table, None, torch.zeros(1))
    pos = p0 + torch.arange(CFG.block_size)
    k, v = model.context_kv(x[[0] + [1] * CFG.num_draft_tokens], pos)
    assert k.shape == v.shape == (2, CFG.block_size, 2, 16)
    got_k, got_v = kv.read_layer(0, DraftKV.slots_of(table, pos[None], KV_BLOCK)[0])
    torch.testing.assert_close(got_k, k[0], **tol("fp32-reorder", torch.float32))
    torch.testing.assert_close(got_v, v[0], **tol("fp32-reorder", torch.float32))
    assert (got_k - model.context_kv(x[[0] * CFG.block_size], pos)[0][0]).abs()[1:].max() > 1e-3


# ---------------------------------------------------------------------------- head and walk
def brute_lattice(model, h, anchors):
    """S[r, s, p, i] in FP64 by loops: candidates from the full logits, the unary softcap,
    and each edge's score from the codebooks."""
    w, c = model.w, CFG
    logits = (h.double() @ model.lm_head.double().T)
    cand = logits.argsort(dim=-1, descending=True, stable=True)[..., :c.selector_top_k]
    r_, n, k = cand.shape
    proj = h.double() @ w["candidate_selector.hidden_projection.weight"].double().T
    a_cb = w["candidate_selector.predecessor_codebook"].double()
    b_cb = w["candidate_selector.successor_codebook"].double()
    s_ = torch.zeros(r_, n, k, k, dtype=torch.float64)
    for r in range(r_):
        for s in range(n):
            for p in range(k):
                pred = int(anchors[r]) if s == 0 else int(cand[r, s - 1, p])
                for i in range(k):
                    z = logits[r, s, cand[r, s, i]]
                    unary = c.final_logit_softcapping * math.tanh(z / c.final_logit_softcapping)
                    edge = (a_cb[pred] * proj[r, s] * b_cb[cand[r, s, i]]).sum()
                    s_[r, s, p, i] = unary + float(edge)
    return cand, s_


TIE = tol("fp32-reorder", torch.float32)  # FP32 scores against the FP64 lattice


def test_greedy_walk_is_the_argmax_path_of_the_lattice():
    model = drafter(seed=7)
    kv, table, _ = with_context(model, STARTS)
    anchors, starts = torch.tensor([3, 250, 17]), torch.tensor(STARTS)
    out = model.draft(kv, anchors, starts, table, None, torch.zeros(3))
    h = model.block_hidden(kv, block_ids(anchors.tolist()), starts, table)[:, 1:]
    cand, lattice = brute_lattice(model, h, anchors)
    assert torch.equal(out.cand_ids, cand)
    for r in range(3):
        prev = 0
        for s in range(CFG.num_draft_tokens):
            row = lattice[r, s, prev]
            pick = int((out.cand_ids[r, s] == out.tokens[r, s]).nonzero())
            slack = TIE["atol"] + TIE["rtol"] * float(row.max().abs())
            assert row[pick] >= row.max() - slack, (r, s)  # the argmax, up to FP32 near-ties
            torch.testing.assert_close(out.cand_scores[r, s].double(), row,
                                       **tol("fp32-reorder", torch.float32))
            prev = pick
    assert len(set(out.tokens.flatten().tolist())) > 3  # not a degenerate walk


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs (bins with expectation < 5 merged)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def test_sampled_walk_frequencies_match_softmax_of_the_rows():
    """4000 identical requests, seeded uniforms: the first pick follows softmax(S[1, .]/T);
    given the most frequent first pick i, the second follows softmax(S[2, i]/T); greedy rows
    (T = 0) of the same batch take the argmax."""
    model = drafter(seed=8)
    n_req, temp = 4000, 1.3
    kv, table, _ = with_context(model, [20])
    uniforms = torch.rand(n_req, CFG.num_draft_tokens, generator=torch.Generator().manual_seed(9))
    out = model.draft(kv, torch.full((n_req,), 42), torch.full((n_req,), 20),
                      table.expand(n_req, -1), uniforms, torch.full((n_req,), temp))
    picks = (out.cand_ids == out.tokens[..., None]).int().argmax(-1)  # [R, N]
    row1 = out.cand_scores[0, 0]
    assert torch.equal(out.cand_scores[:, 0], row1.expand(n_req, -1))
    q1 = torch.softmax(row1 / temp, -1)
    assert q1.max() < 0.9  # a test with power: several candidates are likely
    assert chi_square_p(torch.bincount(picks[:, 0], minlength=CFG.selector_top_k), q1) > 1e-3
    first = int(torch.bincount(picks[:, 0]).argmax())
    rows = picks[:, 0] == first
    row2 = out.cand_scores[rows, 1]
    assert torch.equal(row2, row2[:1].expand_as(row2))
    counts = torch.bincount(picks[rows, 1], minlength=CFG.selector_top_k)
    assert chi_square_p(counts, torch.softmax(row2[0] / temp, -1)) > 1e-3
    mixed = model.draft(kv, torch.full((2,), 42), torch.full((2,), 20), table.expand(2, -1),
                        torch.rand(2, CFG.num_draft_tokens), torch.tensor([0.0, temp]))
    greedy = model.draft(kv, torch.full((1,), 42), torch.full((1,), 20), table, None,
                         torch.zeros(1))
    assert torch.equal(mixed.tokens[0], greedy.tokens[0])


def test_draft_has_fixed_shapes_and_no_host_syncs(monkeypatch):
    """What CUDA-graph capture needs: the same shapes for the same R whatever the data, and no
    device value read on the host (.item, .tolist, bool / int / float of a tensor, nonzero:
    each raises here while `draft` runs)."""
    model = drafter(seed=10)
    kv, table, _ = with_context(model, STARTS)
    gen = torch.Generator().manual_seed(11)
    calls = [(torch.tensor([3, 250, 17]), torch.tensor(STARTS), None, torch.zeros(3)),
             (torch.tensor([9, 9, 400]), torch.tensor([30, 2, 12]),
              torch.rand(3, CFG.num_draft_tokens, generator=gen), torch.tensor([0.7, 0.0, 2.0]))]
    # each call on its own copy of the cache: a call writes its block's K/V, which another
    # call's keys may cover (the engine overwrites them with context K/V before they count)
    expected = [model.draft(copy.deepcopy(kv), *c[:2], table, *c[2:]) for c in calls]
    copies = [copy.deepcopy(kv) for _ in calls]

    forbid_host_reads(monkeypatch)
    got = [model.draft(kv_copy, *c[:2], table, *c[2:]) for kv_copy, c in zip(copies, calls)]
    monkeypatch.undo()
    for a, b in zip(expected, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert a.tokens.shape == (3, 5) and a.cand_ids.shape == a.cand_scores.shape == (3, 5, 7)
        assert a.cand_scores.dtype == torch.float32 and a.tokens.dtype == torch.int64
    assert not torch.equal(expected[0].tokens, expected[1].tokens)


def test_bf16_draft_tracks_fp32():
    """The BF16 path (the GPU's dtype) rounds where the engines round; its states stay within
    a few BF16 steps of FP32's and its top candidates agree."""
    w = random_weights(CFG, 12)
    embed, head = target_tables()
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        model = DFlash2Drafter(CFG, w, embed, head, "cpu", dtype)
        kv, table, _ = with_context(model, STARTS)
        h = model.block_hidden(kv, block_ids([3, 250, 17]), torch.tensor(STARTS), table)
        outs.append((h.float(), model.draft(kv, torch.tensor([3, 250, 17]),
                                            torch.tensor(STARTS), table, None, torch.zeros(3))))
    (h32, d32), (h16, d16) = outs
    torch.testing.assert_close(h16, h32, **tol("draft-bf16-vs-fp32", torch.bfloat16))
    assert (d32.cand_ids[..., 0] == d16.cand_ids[..., 0]).float().mean() > 0.8
