"""Adaptive verification (beam_trtllm/spec/adaptive.py): the acceptance estimator's feature,
labels and online fit; the draft budget's cost curves and admission; cost profiling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from beam_trtllm.spec import (AcceptanceEstimator, CostCurve, DraftBudget, GraphBudget, SpecError,
                              observed_labels, profile_costs, profile_sizes, survival)
from conftest import tol


def test_feature_is_the_log_odds_of_the_walks_top_candidate():
    est = AcceptanceEstimator(3)
    scores = torch.tensor([[[2.0, 0.0, 0.0], [1.0, 1.0, 0.0], [100.0, 0.0, -5.0]],
                           [[2.0, 0.0, 0.0], [3.0, -1.0, float("-inf")], [0.5, 0.5, 0.5]]])
    f = est.features(scores, torch.tensor([0.0, 2.0]))
    want = torch.tensor([[2 - math.log(2), -math.log(1 + math.exp(-1)), 40.0],     # T = 0: as is
                         [1 - math.log(2), 2.0, -math.log(2)]])                  # / T = 2
    torch.testing.assert_close(f, want, **tol("fp32-math", torch.float32))
    # the same as log(q / (1 - q)) of the row's softmax, where that does not cancel
    q = (scores[1] / 2).softmax(-1).max(-1).values
    torch.testing.assert_close(f[1], (q / (1 - q)).log(), **tol("fp32-reorder", torch.float32))
    assert est.features(torch.zeros(1, 2, 1), torch.ones(1)).tolist() == [[40.0, 40.0]]  # k = 1


def test_cold_start_prediction():
    est = AcceptanceEstimator(4)
    f = torch.tensor([[0.0, 2.0, -1.0], [5.0, 0.5, 0.0]])
    torch.testing.assert_close(est.predict(f), torch.sigmoid(0.5 * f - 0.2),
                               **tol("fp32-math", torch.float32))


def test_labels_the_accepted_and_the_first_rejected_draft():
    observed, label = observed_labels([3, 3, 0, 2, 3], [0, 3, 0, 1, 2], 3)
    assert observed.tolist() == [[True, False, False],   # rejected at 0: one observation, label 0
                                 [True, True, True],     # all accepted: no rejected draft to see
                                 [False, False, False],  # no drafts
                                 [True, True, False],    # accepted 1 of 2: 0 -> 1, 1 -> 0
                                 [True, True, True]]
    assert label.tolist() == [[False] * 3, [True] * 3, [False] * 3, [True, False, False],
                              [True, True, False]]
    with pytest.raises(SpecError, match="row 1 accepted 3 of 2"):
        observed_labels([2, 2], [0, 3], 3)


def test_observe_accumulates_and_refits_every_interval():
    est = AcceptanceEstimator(3)
    # unobserved slots may hold anything, NaN included
    f = torch.tensor([[1.0, 2.0, 3.0], [0.5, float("nan"), 9.0]])
    for step in range(est.REFIT_INTERVAL - 1):
        est.observe(f, [3, 1], [1, 0])
    assert est.refits == 0 and est.stats[5].tolist() == [2 * 99.0, 99.0, 0.0]
    assert not est.stats.isnan().any()
    est.observe(f, [3, 1], [1, 0])
    assert est.refits == 1 and est.stats.abs().sum() == 0 and est.steps_since_refit == 0
    assert est.slope.item() != 0.5 and not est.intercepts.isnan().any()


def test_refit_is_the_ridge_newton_step():
    # with the damping off, one refit must solve (X^T W X + l I) d = X^T (y - p) for the
    # design rows x = [f, e_k]: compared with a dense solve
    g = torch.Generator().manual_seed(0)
    est = AcceptanceEstimator(3)
    est.DAMPING_OBSERVATIONS = 0.0
    f = torch.randn(60, 3, generator=g) * 2
    drafts = torch.randint(0, 4, (60,), generator=g)
    ok = torch.rand(60, 3, generator=g) < torch.sigmoid(2.0 * f + 0.5)  # steeper than w = 0.5
    accepted = (ok & (torch.arange(3) < drafts[:, None])).int().cumprod(1).sum(1).tolist()
    drafts = drafts.tolist()
    est.observe(f, drafts, accepted)
    observed, label = observed_labels(drafts, accepted, 3)
    rows = observed.nonzero()
    x = torch.zeros(len(rows), 4, dtype=torch.float64)
    x[:, 0] = f[rows[:, 0], rows[:, 1]].double()
    x[torch.arange(len(rows)), 1 + rows[:, 1]] = 1.0
    p = torch.sigmoid(x @ torch.tensor([0.5, -0.2, -0.2, -0.2], dtype=torch.float64))
    y = label[rows[:, 0], rows[:, 1]].double()
    hessian = x.T @ (x * (p * (1 - p))[:, None]) + 1e-3 * torch.eye(4, dtype=torch.float64)
    step = torch.linalg.solve(hessian, x.T @ (y - p))
    est.refit()
    got = torch.cat([est.slope[None] - 0.5, est.intercepts + 0.2])
    assert got[0] > 0  # a step that is kept (one making w < 0 is dropped: the next test)
    torch.testing.assert_close(got, step, **tol("fp32-reorder", torch.float32))


def simulate(est: AcceptanceEstimator, slope: float, intercepts: torch.Tensor, steps: int,
             rows: int, seed: int) -> None:
    """Verify steps drawn from a known model: draft k is accepted with sigmoid(w f + b_k)
    once drafts 0..k-1 were, and the chain stops at the first rejection."""
    g = torch.Generator().manual_seed(seed)
    n = len(intercepts)
    for _ in range(steps):
        f = 0.5 + 1.5 * torch.randn(rows, n, generator=g)
        drafts = torch.randint(2, n + 1, (rows,), generator=g)
        ok = torch.rand(rows, n, generator=g) < torch.sigmoid(slope * f + intercepts)
        ok &= torch.arange(n) < drafts[:, None]
        est.observe(f, drafts.tolist(), ok.int().cumprod(1).sum(1).tolist())


def test_online_fit_recovers_a_known_logistic_model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 1,500 small steps: no OpenMP team per op on the shared CPU
    try:
        est = AcceptanceEstimator(4)
        truth = torch.tensor([1.5, 0.8, 0.2, -0.4])
        simulate(est, 1.3, truth, steps=1500, rows=256, seed=0)
    finally:
        torch.set_num_threads(threads)
    assert est.refits == 15
    torch.testing.assert_close(est.slope.float(), torch.tensor(1.3),
                               **tol("logistic-refit-slope", torch.float64))
    torch.testing.assert_close(est.intercepts.float(), truth,
                               **tol("logistic-refit-intercept", torch.float64))


def test_the_slope_never_goes_negative():
    est = AcceptanceEstimator(2)
    for round_ in range(5):   # acceptance that falls with confidence: the fit wants w < 0
        simulate(est, -2.0, torch.tensor([0.5, 0.0]), steps=100, rows=64, seed=round_)
        assert est.slope.item() >= 0
    before = (est.slope.clone(), est.intercepts.clone())
    est.refit()               # no observations: no step, and no NaN
    assert torch.equal(est.slope, before[0]) and torch.equal(est.intercepts, before[1])


def test_estimator_refuses_bad_shapes():
    est = AcceptanceEstimator(2)
    with pytest.raises(SpecError, match="N <= 2"):
        est.predict(torch.zeros(1, 3))
    with pytest.raises(SpecError, match="temperature"):
        est.features(torch.zeros(2, 2, 4), torch.zeros(3))
    with pytest.raises(SpecError, match="num_drafts"):
        est.observe(torch.zeros(2, 2), [1], [0, 0])


def test_cost_curves_are_monotone_steps_then_interpolated_then_extrapolated():
    assert CostCurve({1: 1.0, 2: 0.8, 4: 1.5}).ys.tolist() == [1.0, 1.0, 1.5]
    points = {1: 1.0, 2: 2.0, 4: 4.0, 8: 6.0, 16: 10.0}
    graphs = CostCurve(points, graph_limit=4)
    # <= 4: pads to the next measured size; 5: past the graphs, not blended with 4's cost;
    # 12: between 8 and 16; 20: along the 8 -> 16 slope
    assert graphs([0, 1, 3, 4, 5, 12, 16, 20]).tolist() == [1, 1, 4, 4, 6, 8, 10, 12]
    assert CostCurve(points)([0, 3, 6, 24]).tolist() == [1, 3, 5, 14]         # no graphs
    assert CostCurve(points, graph_limit=16)([9, 20]).tolist() == [10, 12]
    assert CostCurve({8: 2.0})([1, 8, 100]).tolist() == [2, 2, 2]
    assert CostCurve({1: 0.0, 2: 0.0}, floor=1e-6)([1, 5]).tolist() == [1e-6, 1e-6]
    for bad in ({}, {1: -1.0}, {1.5: 1.0}, {1: float("nan")}):
        with pytest.raises(SpecError, match="verify_cost"):
            CostCurve(bad, name="verify_cost")


def test_budget_hand_checked():
    # sorted survival .9 .8 .5 .1; gain 2 + prefix sums; cost .5 + verify(2 + B), linear from
    # 1.0 at 2 tokens to 2.0 at 6: B = 0..4 -> 1.333 1.657 1.850 1.867 1.720, so B* = 3
    budget = DraftBudget({2: 0.5}, {2: 1.0, 6: 2.0})
    assert budget.choose([[0.9, 0.5], [0.8, 0.1]], num_sampling=2, non_draft_tokens=2) == [2, 1]
    # the engine's form: one [R, N] array, 0 past a request's room (never admitted)
    assert budget.choose(np.array([[0.9, 0.5, 0.0], [0.8, 0.1, 0.0]]), 2, 2) == [2, 1]


def test_budget_admits_nothing_when_verify_is_dear_and_everything_when_it_is_cheap():
    dear = DraftBudget({1: 0.1}, {1: 1.0, 2: 5.0})
    assert dear.choose([[0.9, 0.8, 0.7]], 1, 1) == [0]
    cheap = DraftBudget({3: 0.1}, {1: 1.0, 64: 1.0})
    assert cheap.choose([[0.9, 0.8, 0.7], [0.3, 0.01], []], 3, 3) == [3, 2, 0]


def test_budget_keeps_a_prefix_of_each_request_on_ties_and_under_a_cap():
    budget = DraftBudget({2: 0.0}, {1: 1.0, 100: 1.0}, max_drafts=3)
    assert budget.choose([[1.0, 1.0, 1.0], [1.0, 1.0]], 2, 2) == [2, 1]
    with pytest.raises(SpecError, match=r"survival\[0\]\[1\]"):
        budget.choose([[0.5, 0.6]], 1, 1)


def test_survival_is_the_running_product_over_the_verified_slots():
    conf = torch.tensor([[0.9, 0.5, 0.5], [0.8, 0.5, 1.0]])
    got = survival(conf, [2, 1])
    assert len(got[0]) == 2 and len(got[1]) == 1
    assert got[0] == pytest.approx([0.9, 0.45]) and got[1] == pytest.approx([0.8])


def test_profile_costs_takes_the_median_of_synchronized_replays():
    now, syncs, lines = [0.0], [0], []
    calls = {"draft": 0, "verify": 0}

    def runner(name, per_unit):
        def run(size):
            calls[name] += 1
            now[0] += per_unit * size + (1.0 if calls[name] % 5 == 2 else 0.0)  # one slow replay
        return run

    def sync():
        syncs[0] += 1

    draft, verify = profile_costs(runner("draft", 1e-3), runner("verify", 2e-4), ([1, 8], [16, 64]),
                                  clock=lambda: now[0], sync=sync, progress=lines.append)
    assert draft == pytest.approx({1: 1e-3, 8: 8e-3})
    assert verify == pytest.approx({16: 3.2e-3, 64: 1.28e-2})
    assert syncs[0] == 2 * 5 * 4 and len(lines) == 4 and "verify cost at 64" in lines[-1]
    # real work on the real clock feeds a budget
    x = torch.randn(64, 64)
    draft, verify = profile_costs(lambda r: x[:r] @ x, lambda t: x[:t] @ x, [1, 64], replays=3)
    assert all(v > 0 for v in [*draft.values(), *verify.values()])
    assert DraftBudget(draft, verify).choose([[0.5]], 1, 1) in ([0], [1])
    assert profile_costs(lambda r: None, lambda t: None, [2, 4], replays=1)[0].keys() == {2, 4}
    with pytest.raises(SpecError, match="verify sizes"):
        profile_costs(lambda r: None, lambda t: None, ([1], [0]))


def test_profile_sizes_add_the_tail_past_the_graphs():
    assert profile_sizes([1, 2, 4, 8], 64) == [1, 2, 4, 8, 12, 16, 32, 64]
    assert profile_sizes([], 10) == [1, 2, 4, 8, 10]
    assert profile_sizes([1, 2, 512], 100) == [1, 2, 3, 4, 8, 16, 32, 64, 100]


def test_graph_budget_picks_the_count_of_the_best_rate():
    """Graph steps cost their captured graph's time: with survival 0.9, 0.8, 0.1, 0.05 and a
    verify graph that costs 1 + n/2 ms, n = 2 wins (1 + 1.7 tokens / 2.5 ms beats n = 1's
    1.9 / 2, n = 4's 2.85 / 3.5); a large host time per step makes every step dearer alike,
    so more drafts pay: n = 4."""
    draft = {1: 1e-3, 8: 1e-3}
    verify = {(b, n): (0.5 + n / 2) * 1e-3 for b in (1, 8) for n in (1, 2, 4)}
    budget = GraphBudget(draft, verify)
    row = [0.9, 0.8, 0.1, 0.05]
    assert budget.step_cost(1, 3) == pytest.approx(1e-3 + 2.5e-3)  # padded to the n = 4 graph
    assert budget.choose([row]) == 2
    assert budget.choose([row], host_seconds=20e-3) == 4
    assert budget.choose([row[:1], row]) == 1  # one request has room for one draft only
    assert GraphBudget(draft, {k: 1e-3 for k in verify}).choose([row]) == 4  # flat: all
    # the engine's form: an [R, N] array, 0 past each request's room
    padded = np.array([[0.9, 0, 0, 0], row])
    assert budget.choose(padded) == budget.choose([row[:1], row]) == 1
    assert budget.choose(np.array([row])) == 2
    with pytest.raises(SpecError, match=r"survival\[1\]\[2\] = 0.9"):
        budget.choose(np.array([row, [0.9, 0.5, 0.9, 0.1]]))


def test_graph_budget_refuses_a_missing_graph_cost():
    with pytest.raises(SpecError, match="batch 8, 2 drafts"):
        GraphBudget({1: 1e-3, 8: 1e-3}, {(1, 1): 1e-3, (1, 2): 1e-3, (8, 1): 1e-3})
    with pytest.raises(SpecError, match="survival"):
        GraphBudget({1: 1e-3}, {(1, 1): 1e-3}).choose([[0.5, 0.9]])


def test_observing_several_steps_at_once_is_observing_them_in_turn():
    """The engine folds ten verify steps in one call: between refits the statistics and the
    refit that follows are the same as folding the steps one by one."""
    gen = torch.Generator().manual_seed(5)
    steps = [(torch.randn(3, 4, generator=gen) * 2, [4, 2, 3], [1, 2, 0]) for _ in range(20)]
    one, batched = AcceptanceEstimator(4), AcceptanceEstimator(4)
    one.REFIT_INTERVAL = batched.REFIT_INTERVAL = 20
    for f, n, a in steps:
        one.observe(f, n, a)
    for lo in (0, 10):
        chunk = steps[lo:lo + 10]
        batched.observe(torch.cat([f for f, _, _ in chunk]), sum((n for _, n, _ in chunk), []),
                        sum((a for _, _, a in chunk), []), steps=10)
    assert one.refits == batched.refits == 1
    torch.testing.assert_close(batched.slope, one.slope, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(batched.intercepts, one.intercepts, rtol=1e-12, atol=1e-12)


def test_host_survival_scores_are_the_running_product_of_predict_and_follow_refits():
    """survival_scores (numpy, the chained steps' choice) is predict's running product, also
    after the fit moves."""
    est = AcceptanceEstimator(5)
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        f = torch.randn(6, 5, generator=gen, dtype=torch.float32) * 4
        want = est.predict(f).double().cumprod(dim=1).numpy()
        np.testing.assert_allclose(est.survival_scores(f.numpy()), want,
                                   **tol("survival-host", torch.float64))
        acc = torch.randint(0, 6, (6,), generator=gen).tolist()
        est.observe(f, [5] * 6, acc, steps=AcceptanceEstimator.REFIT_INTERVAL)
    assert est.refits == 3
    with pytest.raises(SpecError, match="features must be"):
        est.survival_scores(np.zeros((2, 6)))
