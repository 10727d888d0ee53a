"""Verification of drafted blocks (beam_trtllm/spec/verify.py): greedy exact match, lossless
rejection sampling (chi-square against the target's distribution), the uniform streams."""

from __future__ import annotations

import pytest
import torch

from beam_trtllm.engine.sampler import filtered_probs, sample
from beam_trtllm.engine.types import SamplingParams
from beam_trtllm.spec import (DRAFT_SALT, VERIFY_SALT, SpecError, draft_uniforms, proposal_probs,
                              stream_seed, target_probs, uniform_source, verify)

# A fixed-seed statistical test: its p-value is one fixed number; below 1e-3 means the emitted
# distribution is not the target's (a wrong residual or ratio moves it to ~0 at these sizes).
P_VALUE_FLOOR = 1e-3


@pytest.fixture
def one_thread():
    # the CPU is shared: each of the thousands of tiny per-row ops would wake an OpenMP team,
    # which costs milliseconds when the other core is busy
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; bins expecting < 5 are pooled."""
    counts, expected = counts.double(), probs.double() * counts.sum()
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    rest_obs, rest_exp = counts[~big].sum(), expected[~big].sum()
    if rest_exp >= 5:
        obs, exp = torch.cat([obs, rest_obs[None]]), torch.cat([exp, rest_exp[None]])
    elif rest_exp > 0:  # too small to stand alone: fold into the smallest bin
        i = exp.argmin()
        obs[i] += rest_obs
        exp[i] += rest_exp
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def p_value(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def assert_distribution(counts: torch.Tensor, probs: torch.Tensor, what: str) -> float:
    assert counts[probs == 0].sum() == 0, f"{what}: a token the target cannot emit was emitted"
    stat, dof = chi_square(counts, probs)
    p = p_value(stat, dof)
    assert p > P_VALUE_FLOOR, f"{what}: chi2 {stat:.1f}, dof {dof}, p {p:.2e}"
    return p


def params_for(variant: dict, rows: int) -> list[SamplingParams]:
    return [SamplingParams(**variant, seed=1000 + r) for r in range(rows)]


V, K, N = 50, 8, 2
VARIANTS = {
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=1.0, top_k=12),
    "top_p_min_p": dict(temperature=1.3, top_p=0.85, min_p=0.02),
    "one_hot_q": dict(temperature=1.0, top_k=12),
}


def scenario(name: str, rows: int, seed: int = 0):
    """A fixed context: target logits at realistic magnitudes whose next rows depend on the
    drafted tokens, and a drafter with k=8 candidates per position (4 in the target's head, 4
    in its tail, zero-probability under top-k) whose second row depends on its first draw."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(N + 1, V, generator=g) * 2.0
    moves = torch.randn(V, V, generator=g)                  # a draft's effect on the next row
    order = base[0].argsort(descending=True)
    cand0 = order[torch.tensor([0, 2, 5, 9, 20, 30, 40, 49])]
    # the drafter roughly knows the target, but is overconfident about its tail candidates
    tail_boost = torch.tensor([0.0] * 4 + [3.0] * 4)
    scores0 = base[0, cand0] + tail_boost + 0.5 * torch.randn(K, generator=g)
    if name == "one_hot_q":                                 # the walk's row is one-hot on cand0[0]
        scores0 = torch.full((K,), float("-inf"))
        scores0[0] = 0.0
    head1 = base[1].argsort(descending=True)[:4]
    cand1 = torch.cat([head1, torch.randperm(V, generator=g)[:K]])
    cand1 = torch.cat([head1, cand1[4:][~torch.isin(cand1[4:], head1)][:4]])
    scores1 = (base[1] + moves)[:, cand1] + tail_boost + 0.5 * torch.randn(V, K, generator=g)
    temperature = VARIANTS[name]["temperature"]
    pick0 = torch.multinomial((scores0 / temperature).softmax(-1), rows, True, generator=g)
    d1 = cand0[pick0]
    pick1 = torch.multinomial((scores1[d1] / temperature).softmax(-1), 1, generator=g)[:, 0]
    drafts = torch.stack([d1, cand1[pick1]], 1)
    logits = torch.stack([base[0].expand(rows, V), base[1] + moves[d1],
                          base[2] + moves[drafts[:, 1]]], 1)
    cand_ids = torch.stack([cand0.expand(rows, K), cand1.expand(rows, K)], 1)
    cand_scores = torch.stack([scores0.expand(rows, K), scores1[d1]], 1)
    return logits, drafts, cand_ids, cand_scores, base, moves


@pytest.mark.parametrize("name", list(VARIANTS))
def test_sampled_verify_emits_the_targets_distribution(name, one_thread):
    rows = 5000
    logits, drafts, cand_ids, cand_scores, base, moves = scenario(name, rows)
    params = params_for(VARIANTS[name], rows)
    out = verify(logits, drafts, [N] * rows, cand_ids, cand_scores, params,
                 uniform_source(params, [0] * rows))
    f = VARIANTS[name]
    filt = (f["temperature"], f.get("top_k", 0), f.get("top_p", 1.0), f.get("min_p", 0.0))

    p0 = target_probs(base[:1], *filt)[0]
    first = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=V)
    assert_distribution(first, p0, "first token")

    # the second token, given the first draft was accepted: grouped by that draft
    stats, dofs, seen = 0.0, 0, 0
    for d1 in drafts[:, 0].unique().tolist():
        rows_d1 = [r for r in range(rows) if out.num_accepted[r] >= 1 and out.tokens[r][0] == d1]
        if len(rows_d1) < 50:
            continue
        p1 = target_probs((base[1] + moves[d1])[None], *filt)[0]
        second = torch.bincount(torch.tensor([out.tokens[r][1] for r in rows_d1]), minlength=V)
        assert second[p1 == 0].sum() == 0
        s, d = chi_square(second, p1)
        stats, dofs, seen = stats + s, dofs + d, seen + len(rows_d1)
    assert seen > 1000, f"only {seen} rows accepted their first draft"
    assert p_value(stats, dofs) > P_VALUE_FLOOR, \
        f"second token: chi2 {stats:.1f}, dof {dofs}, p {p_value(stats, dofs):.2e} over {seen} rows"
    assert all(len(t) == a + 1 for t, a in zip(out.tokens, out.num_accepted))


def test_a_draft_the_target_cannot_emit_is_always_rejected(one_thread):
    rows = 3000
    logits = torch.randn(rows, 2, V, generator=torch.Generator().manual_seed(3)) * 2.0
    logits[:] = logits[0]
    p0 = target_probs(logits[0, :1], 1.0, 5, 1.0)[0]
    outside = int((p0 == 0).nonzero()[0])                   # q is one-hot on a zero-p token
    others = [i for i in range(V) if i != outside][:3]
    cand_ids = torch.tensor([outside] + others).expand(rows, 1, 4)
    cand_scores = torch.tensor([0.0, -30.0, -30.0, -30.0]).expand(rows, 1, 4)
    params = params_for(dict(temperature=1.0, top_k=5), rows)
    out = verify(logits, torch.full((rows, 1), outside), [1] * rows, cand_ids, cand_scores, params,
                 uniform_source(params, [7] * rows))
    assert out.num_accepted == [0] * rows
    counts = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=V)
    assert_distribution(counts, p0, "always rejected")


def test_no_drafts_is_plain_sampling(one_thread):
    rows = 3000
    logits = (torch.randn(V, generator=torch.Generator().manual_seed(4)) * 2.0).expand(rows, 1, V)
    params = params_for(dict(temperature=0.7, top_p=0.9), rows)
    empty = torch.zeros(rows, 0, 8, dtype=torch.long)
    out = verify(logits, torch.zeros(rows, 0, dtype=torch.long), [0] * rows, empty, empty.float(),
                 params, uniform_source(params, [0] * rows))
    counts = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=V)
    assert out.num_accepted == [0] * rows
    assert_distribution(counts, filtered_probs(logits[0, 0], 0.7, 0, 0.9), "no drafts")


def test_rejection_draws_from_the_residual():
    # p = (.5, .5, 0, ...), q one-hot on token 0: accept with p/q = .5; on rejection the
    # residual max(p - q, 0) is one-hot on token 1
    logits = torch.full((1, 2, 6), float("-inf"))
    logits[0, :, :2] = 0.0
    cand_ids, cand_scores = torch.tensor([[[0, 3]]]), torch.tensor([[[0.0, float("-inf")]]])
    for u in (0.2, 0.7):
        out = verify(logits, torch.tensor([[0]]), [1], cand_ids, cand_scores,
                     [SamplingParams(temperature=1.0)], lambda r, j, n: torch.full((n,), u))
        assert (out.num_accepted, out.tokens[0][0]) == (([1], 0) if u < 0.5 else ([0], 1))


def greedy_logits(argmax: list[list[int]], vocab: int = 37) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(len(argmax), len(argmax[0]), vocab, generator=g) * 3
    for r, row in enumerate(argmax):
        for j, t in enumerate(row):
            logits[r, j, t] = logits[r, j].max() + 1.0
    return logits


def greedy_verify(logits, drafts, num_drafts, k=4):
    rows, n = drafts.shape
    cand = torch.zeros(rows, n, k, dtype=torch.long)
    return verify(logits, drafts, num_drafts, cand, cand.float(), [SamplingParams()] * rows,
                  lambda *a: pytest.fail("greedy rows draw no randomness"))


def test_greedy_accepts_while_drafts_match_the_argmax():
    argmax = [[3, 9, 1, 4, 4, 30], [7, 7, 2, 0, 5, 6], [1, 2, 3, 4, 5, 36]]
    logits = greedy_logits(argmax)
    drafts = torch.tensor([[3, 9, 1, 4, 4], [8, 7, 2, 0, 5], [1, 2, 9, -1, -1]])
    out = greedy_verify(logits, drafts, [5, 5, 3])
    # all five accepted + the bonus; the first rejected -> the correction; the third rejected
    assert out.num_accepted == [5, 0, 2]
    assert out.tokens == [[3, 9, 1, 4, 4, 30], [7], [1, 2, 3]]
    # fewer drafts verified than the block holds: the rest is never looked at
    out = greedy_verify(logits, drafts, [2, 0, 1])
    assert out.num_accepted == [2, 0, 1] and out.tokens == [[3, 9, 1], [7], [1, 2]]


def test_greedy_without_drafts_is_plain_decoding_and_ties_take_the_lower_id():
    logits = torch.randn(4, 3, 37, generator=torch.Generator().manual_seed(6)) * 3
    logits[1, 0, 5] = logits[1, 0, 11] = logits[1, 0].max() + 1
    plain, _ = sample(logits[:, 0].clone(), [SamplingParams()] * 4, [0] * 4)
    out = greedy_verify(logits, torch.full((4, 2), -1), [0] * 4)
    assert out.tokens == [[t] for t in plain] and out.num_accepted == [0] * 4
    assert out.tokens[1] == [5]


def test_greedy_rows_are_unaffected_by_sampled_rows_in_the_batch():
    argmax = [[3, 9, 1], [2, 2, 2], [4, 0, 8]]
    logits = greedy_logits(argmax, vocab=23)
    drafts = torch.tensor([[3, 9], [2, 5], [4, 1]])
    cand = torch.tensor([[0, 1, 2], [3, 4, 5]]).expand(3, 2, 3)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams()]
    out = verify(logits, drafts, [2, 2, 2], cand, torch.zeros(3, 2, 3), params,
                 uniform_source(params, [0, 0, 0]))
    assert (out.tokens[0], out.tokens[2]) == ([3, 9, 1], [4, 0])
    assert out.num_accepted[1] <= 1 and len(out.tokens[1]) == out.num_accepted[1] + 1


def test_target_probs_is_the_samplers_filter():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 41, generator=g) * 3
    logits[3, :6] = 2.5                                     # ties at the k-th value
    for temperature, top_k, top_p, min_p in [(1.0, 0, 1.0, 0.0), (0.6, 5, 1.0, 0.0),
                                             (1.4, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.05),
                                             (0.9, 7, 0.9, 0.3), (1.0, 60, 0.5, 0.0),
                                             (2.0, 1, 1.0, 0.0)]:
        got = target_probs(logits, temperature, top_k, top_p, min_p)
        want = torch.stack([filtered_probs(row, temperature, top_k, top_p, min_p)
                            for row in logits])
        assert torch.equal(got, want), (temperature, top_k, top_p, min_p)


def test_proposal_probs_scatters_the_candidates_softmax():
    ids = torch.tensor([[4, 1, 4], [0, 2, 3]])
    scores = torch.tensor([[1.0, 0.0, -1.0], [2.0, 2.0, float("-inf")]])
    q = proposal_probs(ids, scores, 0.5, 6)
    s = (scores / 0.5).softmax(-1)
    want = torch.zeros(2, 6)
    want[0, 4], want[0, 1] = s[0, 0] + s[0, 2], s[0, 1]     # a repeated id gets both masses
    want[1, :3] = torch.tensor([s[1, 0], 0.0, s[1, 1]])
    assert torch.equal(q, want)


def test_a_seeded_request_draws_the_same_whatever_its_batch():
    p = SamplingParams(temperature=1.0, seed=77)
    other = SamplingParams(temperature=0.5)
    alone = uniform_source([p], [12])
    batch = uniform_source([other, other, p], [0, 3, 12], torch.Generator().manual_seed(1))
    assert torch.equal(alone(0, 2, 9), batch(2, 2, 9))
    # one stream per output index: the accept value is the first of the token's noise
    assert torch.equal(alone(0, 1, 1), alone(0, 1, 51)[:1])
    assert torch.equal(uniform_source([p], [10])(0, 4, 5), alone(0, 2, 5))
    assert not torch.equal(alone(0, 0, 5), alone(0, 1, 5))
    u = alone(0, 0, 10_000)
    assert u.min() > 0 and u.max() < 1
    assert not torch.equal(uniform_source([p], [12], salt=DRAFT_SALT)(0, 0, 5), alone(0, 0, 5))
    # unseeded rows come from the engine's generator
    a = uniform_source([other], [0], torch.Generator().manual_seed(3))(0, 0, 4)
    b = uniform_source([other], [9], torch.Generator().manual_seed(3))(0, 5, 4)
    assert torch.equal(a, b)


def test_a_seeded_request_verifies_the_same_whatever_its_batch():
    logits, drafts, cand_ids, cand_scores, _, _ = scenario("temperature", 3)
    p = SamplingParams(temperature=0.8, seed=5)
    others = [SamplingParams(temperature=1.0), SamplingParams()]
    for index in range(20):
        alone = verify(logits[:1], drafts[:1], [2], cand_ids[:1], cand_scores[:1], [p],
                       uniform_source([p], [index]))
        engine_generator = torch.Generator().manual_seed(index)
        batch = verify(logits.flip(0), drafts.flip(0), [1, 2, 2], cand_ids.flip(0),
                       cand_scores.flip(0), others + [p],
                       uniform_source(others + [p], [4, 0, index], engine_generator))
        assert (batch.num_accepted[2], batch.tokens[2]) == (alone.num_accepted[0], alone.tokens[0])


def test_draft_uniforms_are_keyed_like_the_verify_streams():
    ps = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.0),
          SamplingParams()]
    u = draft_uniforms(ps, [4, 0, 0], 5, torch.Generator().manual_seed(0))
    assert u.shape == (3, 5) and u.min() > 0 and u.max() < 1
    want = [uniform_source(ps[:1], [4], salt=DRAFT_SALT)(0, s, 1) for s in range(5)]
    assert torch.equal(u[0], torch.cat(want))
    assert torch.equal(draft_uniforms(ps[:1], [4], 5)[0], u[0])
    assert stream_seed(3, 4, DRAFT_SALT) != stream_seed(3, 4, VERIFY_SALT)
    assert draft_uniforms(ps, [0, 0, 0], 0).shape == (3, 0)


def test_bad_inputs_are_refused_by_name():
    logits = torch.zeros(2, 3, 10)
    drafts = torch.zeros(2, 2, dtype=torch.long)
    cand = torch.zeros(2, 2, 4, dtype=torch.long)
    ps = [SamplingParams()] * 2
    src = uniform_source(ps, [0, 0])
    cases = [((logits[0], drafts, [2, 2], cand, cand.float(), ps), "target_logits"),
             ((logits, drafts[:, :1], [1, 1], cand, cand.float(), ps), "drafts"),
             ((logits, drafts, [2, 2], cand[:1], cand[:1].float(), ps), "cand_ids"),
             ((logits, drafts, [2, 2], cand, cand[..., :3].float(), ps), "cand_scores"),
             ((logits, drafts, [2, 3], cand, cand.float(), ps), r"num_drafts\[1\]"),
             ((logits, drafts, [2], cand, cand.float(), ps), "num_drafts"),
             ((logits, torch.tensor([[0, 12], [0, 0]]), [2, 2], cand, cand.float(), ps),
              r"drafts\[0, 1\] = 12"),
             ((logits, drafts, [2, 2], cand + 10, cand.float(),
               [SamplingParams(temperature=1.0)] * 2), "cand_ids")]
    for args, match in cases:
        with pytest.raises(SpecError, match=match):
            verify(*args, src)
