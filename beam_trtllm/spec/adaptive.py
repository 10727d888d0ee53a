"""Adaptive verification: verify only the drafts worth their cost (vLLM 0.33's
`acceptance_estimator.py` and `adaptive_verification.py`; docs/SPECULATIVE.md).

- `AcceptanceEstimator`: p_k = sigmoid(w * f + b_k), the chance that draft position k is
  accepted given the earlier ones were, from one feature of the drafter's distribution,
  f = logit(max q) over the walk's realized candidate scores. One shared slope w, one
  intercept b_k per position, fitted online by damped Newton (IRLS) steps every
  REFIT_INTERVAL verify steps.
- `DraftBudget`: from survival scores s_{r,k} = prod_{j<=k} p_j and measured step costs,
  the number of drafts B* that maximizes expected tokens per second, and which requests
  keep how many (the global top B* slots, a prefix of each request's drafts).
- `GraphBudget`: the same rule where CUDA graphs run the steps (the cost is the captured
  graph's, so the choice is one draft count per step).
- `profile_costs`: the two cost curves, median seconds of a few timed replays per size.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .verify import SpecError


class AcceptanceEstimator:
    """Per-position acceptance probabilities from logit(max q), refitted online."""

    REFIT_INTERVAL = 100         # verify steps between refits (statistics reset after each)
    DAMPING_OBSERVATIONS = 50.0  # a step moves a parameter by n / (n + 50) of Newton's step
    RIDGE = 1e-3                 # lambda on the diagonal of the Newton system
    MAX_LOG_ODDS = 40.0          # a one-hot row has feature +inf: clamp
    # vLLM's cold start: the median fit across five production drafters; log-loss is flat near
    # the optimum, so one start serves all and a refit or two replaces it
    COLD_SLOPE = 0.5
    COLD_INTERCEPT = -0.2

    def __init__(self, num_positions: int, device="cpu"):
        if num_positions < 1:
            raise SpecError(f"AcceptanceEstimator: num_positions must be >= 1, got {num_positions}")
        self.num_positions = num_positions
        self.device = torch.device(device)
        self.slope = torch.tensor(self.COLD_SLOPE, dtype=torch.float64, device=self.device)
        self.intercepts = torch.full((num_positions,), self.COLD_INTERCEPT,
                                     dtype=torch.float64, device=self.device)
        # rows: a_k = sum w f^2, b_k = sum w f, c_k = sum w, g0_k = sum (y-p) f,
        # g1_k = sum (y-p), n_k = observations; w = p (1 - p)
        self.stats = torch.zeros(6, num_positions, dtype=torch.float64, device=self.device)
        self.steps_since_refit = 0
        self.refits = 0
        self._host_fit = None  # survival_scores' copy of the fit (keyed by the tensors)

    def features(self, cand_scores: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """cand_scores [R, N, k] (pre-temperature), temperature [R] -> f [R, N] fp32:
        f = m* - log sum_{z != m*} e^(z - m*) over the row / T (T = 0 rows as they are)."""
        if cand_scores.dim() != 3 or temperature.shape != cand_scores.shape[:1]:
            raise SpecError(f"AcceptanceEstimator.features: cand_scores must be [R, N, k] and "
                            f"temperature [R], got {tuple(cand_scores.shape)} and "
                            f"{tuple(temperature.shape)}")
        t = temperature.to(cand_scores.device, torch.float32)
        t = torch.where(t > 0, t, torch.ones_like(t))
        z = cand_scores.float() / t[:, None, None]
        top = z.argmax(-1, keepdim=True)
        # shifted by m*, the numerator is e^0 = 1; the rest's log-sum-exp (ties included) is
        # taken directly rather than as log(total - 1), which cancels for confident rows
        rest = (z - z.gather(-1, top)).scatter(-1, top, float("-inf"))
        return (-torch.logsumexp(rest, -1)).clamp(-self.MAX_LOG_ODDS, self.MAX_LOG_ODDS)

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """features [R, N] -> p_k [R, N] fp32 on the features' device."""
        n = self._positions(features)
        logit = self.slope * features.to(self.device, torch.float64) + self.intercepts[:n]
        return torch.sigmoid(logit).to(features.device, torch.float32)

    def survival_scores(self, features: np.ndarray) -> np.ndarray:
        """features [R, N] on the host -> survival scores s_k = prod_{j<=k} p_j [R, N] float64:
        `predict` in numpy with the fit cached (a chained step chooses its draft count from
        these each step: torch's per-op overhead was ~0.1 ms of it on the host)."""
        f = np.asarray(features, dtype=np.float64)
        n = self._positions(f)
        fit = self._host_fit
        if fit is None or fit[0] is not self.slope or fit[1] is not self.intercepts:
            fit = self._host_fit = (self.slope, self.intercepts, float(self.slope),
                                    self.intercepts.cpu().numpy())
        slope, intercepts = fit[2:]
        p = 1.0 / (1.0 + np.exp(-(slope * f + intercepts[:n])))
        return np.cumprod(p.astype(np.float32).astype(np.float64), axis=1)

    def observe(self, features: torch.Tensor, num_drafts: Sequence[int],
                num_accepted: Sequence[int], steps: int = 1) -> None:
        """Fold `steps` verify steps in (their rows concatenated): row r verified
        num_drafts[r] drafts (features[r, :num_drafts[r]] their features at draft time) and
        accepted num_accepted[r]. The parameters change only at a refit, so folding several
        steps at once is the same as one by one while no refit falls between them."""
        n = self._positions(features)
        if len(num_drafts) != features.shape[0] or len(num_accepted) != features.shape[0]:
            raise SpecError(f"AcceptanceEstimator.observe: {features.shape[0]} feature rows but "
                            f"{len(num_drafts)} num_drafts and {len(num_accepted)} num_accepted")
        observed, label = observed_labels(num_drafts, num_accepted, n, self.device)
        f = torch.where(observed, features.to(self.device, torch.float64), 0.0)
        p = torch.sigmoid(self.slope * f + self.intercepts[:n])
        w = torch.where(observed, p * (1 - p), 0.0)
        resid = torch.where(observed, label.double() - p, 0.0)
        self.stats[:, :n] += torch.stack([w * f * f, w * f, w, resid * f, resid,
                                          observed.double()]).sum(1)
        self.steps_since_refit += steps
        if self.steps_since_refit >= self.REFIT_INTERVAL:
            self.refit()

    def refit(self) -> None:
        """One damped Newton step on the accumulated statistics (the arrowhead system
        [[a+l, b^T], [b, diag(c)+l]] [dw, db] = [sum g0, g1]), then reset them."""
        a_k, b, c, g0_k, g1, n = self.stats
        c = c + self.RIDGE
        a = a_k.sum() + self.RIDGE
        step_w = (g0_k.sum() - (b * g1 / c).sum()) / (a - (b * b / c).sum())
        total = n.sum()
        step_w = step_w * total / (total + self.DAMPING_OBSERVATIONS)
        # a NaN step, or one that would make the slope negative, is dropped
        bad = torch.isnan(step_w) | (self.slope + step_w < 0)
        step_w = torch.where(bad, torch.zeros_like(step_w), step_w)
        self.slope = self.slope + step_w
        step_b = (g1 - b * step_w) / c * (n / (n + self.DAMPING_OBSERVATIONS))
        self.intercepts = self.intercepts + torch.where(torch.isnan(step_b), 0.0, step_b)
        self.stats.zero_()
        self.steps_since_refit = 0
        self.refits += 1

    def _positions(self, features) -> int:
        """N of features [R, N] (a tensor or an array), checked against the positions."""
        if features.ndim != 2 or features.shape[1] > self.num_positions:
            raise SpecError(f"AcceptanceEstimator: features must be [R, N] with N <= "
                            f"{self.num_positions}, got {tuple(features.shape)}")
        return features.shape[1]


def observed_labels(num_drafts: Sequence[int], num_accepted: Sequence[int], num_positions: int,
                    device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(observed, label) [R, N] bool: with A accepted of D drafts, positions k < A are observed
    accepted (label 1), position A is observed rejected when A < D, later ones unobserved."""
    for r, (d, a) in enumerate(zip(num_drafts, num_accepted)):
        if not 0 <= a <= d <= num_positions:
            raise SpecError(f"AcceptanceEstimator.observe: request row {r} accepted {a} of {d} "
                            f"drafts (at most {num_positions} positions)")
    k = torch.arange(num_positions, device=device)
    acc = torch.tensor(list(num_accepted), dtype=torch.long, device=device)[:, None]
    drafted = torch.tensor(list(num_drafts), dtype=torch.long, device=device)[:, None]
    return (k <= acc) & (k < drafted), k < acc


def survival(confidences: torch.Tensor, num_drafts: Sequence[int]) -> list[list[float]]:
    """Per-position acceptance probabilities [R, N] -> each request's survival scores
    s_k = prod_{j<=k} p_j over its first num_drafts[r] slots (DraftBudget.choose's input)."""
    rows = confidences.double().cumprod(-1).tolist()
    return [row[:nd] for row, nd in zip(rows, num_drafts)]


class CostCurve:
    """A step cost measured at a few sizes, as a function of any size: made monotone (a
    running max), a step function up to `graph_limit` (a CUDA graph pads to the next captured
    size), linear between the measured points above it (nothing pads there; the first point
    above is not blended with the last one below, since leaving the graphs is a real jump),
    and extended past the last point along the last two points' slope; never below `floor`."""

    def __init__(self, points: dict[int, float], graph_limit: int = 0, floor: float = 0.0,
                 name: str = "cost"):
        if not points:
            raise SpecError(f"{name}: no measured sizes")
        for size, cost in points.items():
            if int(size) != size or size < 0 or not np.isfinite(cost) or cost < 0:
                raise SpecError(f"{name}[{size!r}] = {cost!r}: sizes must be integers >= 0 and "
                                f"costs finite seconds >= 0")
        xs = sorted(points)
        self.xs = np.asarray(xs, dtype=np.float64)
        self.ys = np.maximum.accumulate(np.asarray([points[x] for x in xs], dtype=np.float64))
        self.graph_limit, self.floor = graph_limit, floor

    def __call__(self, sizes) -> np.ndarray:
        x = np.atleast_1d(np.asarray(sizes, dtype=np.float64))
        xs, ys = self.xs, self.ys
        out = ys[np.minimum(np.searchsorted(xs, x, side="left"), len(xs) - 1)]
        smooth, above = x > self.graph_limit, xs > self.graph_limit
        if smooth.any() and above.any():
            out[smooth] = np.interp(x[smooth], xs[above], ys[above])
        if len(xs) > 1:
            after = x > xs[-1]
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            out[after] = ys[-1] + slope * (x[after] - xs[-1])
        return np.maximum(out, self.floor)


class DraftBudget:
    """B* = argmax_B (N_s + sum_{j<B} s_(j)) / (C_draft[R] + C_verify[T_nd + B]) over the
    sorted survival scores s_(0) >= s_(1) >= ..., and the admission of the top B* slots."""

    def __init__(self, draft_cost: dict[int, float], verify_cost: dict[int, float], *,
                 draft_graph_limit: int = 0, verify_graph_limit: int = 0,
                 max_drafts: int | None = None):
        """draft_cost: seconds of a draft step by request count; verify_cost: seconds of a
        target step by token count; *_graph_limit: the largest CUDA-graph size of each (0:
        none); max_drafts: a cap on B (the verify step's logits budget), None: none."""
        self.draft_cost = CostCurve(draft_cost, draft_graph_limit, 0.0, "draft_cost")
        self.verify_cost = CostCurve(verify_cost, verify_graph_limit, 1e-6, "verify_cost")
        self.max_drafts = max_drafts

    def choose(self, survival, num_sampling: int, non_draft_tokens: int) -> list[int]:
        """survival [R, N]: request r's survival score per draft slot (non-increasing; an
        array with 0 past each request's room, or ragged rows); num_sampling: requests that
        emit a token this step; non_draft_tokens: the step's other tokens -> drafts admitted
        per request (each a prefix of its slots). A 0 slot never raises the rate, so the
        padding is never admitted."""
        s = survival_array(survival)
        rows, cols = np.indices(s.shape)
        # best first; ties go to the earlier slot, so a request's admitted slots stay a prefix
        order = np.lexsort((rows.ravel(), cols.ravel(), -s.ravel()))
        positive = int((s > 0).sum())  # (sorted first)
        if self.max_drafts is not None:
            positive = min(positive, max(0, self.max_drafts))
        order = order[:positive]
        gain = num_sampling + np.concatenate([[0.0], np.cumsum(s.ravel()[order])])
        cost = (self.draft_cost([s.shape[0]])[0]
                + self.verify_cost(non_draft_tokens + np.arange(len(order) + 1)))
        best = int(np.argmax(gain / cost))
        return np.bincount(rows.ravel()[order[:best]], minlength=s.shape[0]).tolist()


class GraphBudget:
    """The budget rule for CUDA-graph steps. A captured verify graph runs b sequences x (1 + n)
    rows whatever drafts fill them (the rest is padding), so its cost depends on the step's
    batch size and the largest draft count, not on the number of drafts: the choice is one
    count n among the captured ones, n* = argmax_n (R + sum_r sum_{k<n} s_{r,k}) /
    (C_draft[b] + C_verify[b, n] + h), h the host's time per step (measured online)."""

    def __init__(self, draft_cost: dict[int, float], verify_cost: dict[tuple[int, int], float]):
        """draft_cost[b]: seconds of the draft graph of batch size b; verify_cost[b, n]: of the
        verify graph of batch size b and n drafts per sequence."""
        if not draft_cost or not verify_cost:
            raise SpecError("GraphBudget: no measured graph costs")
        self.draft_cost, self.verify_cost = dict(draft_cost), dict(verify_cost)
        self.sizes = sorted(draft_cost)
        self.counts = sorted({n for _, n in verify_cost})
        for b in self.sizes:
            for n in self.counts:
                if (b, n) not in self.verify_cost:
                    raise SpecError(f"GraphBudget: no verify cost for batch {b}, {n} drafts")
        self._costs: dict[int, np.ndarray] = {}

    def step_cost(self, batch: int, n: int) -> float:
        """The GPU seconds of a step of `batch` requests with at most n drafts each."""
        b = next(s for s in self.sizes if s >= batch)
        return self.draft_cost[b] + self.verify_cost[b, min(c for c in self.counts if c >= n)]

    def choose(self, survival, host_seconds: float = 0.0) -> int:
        """survival [R, N]: request r's survival scores, 0 past its room (an array; or ragged
        rows, its room already cut) -> n* (ties: the fewest drafts)."""
        s = survival_array(survival)
        r = s.shape[0]
        if r not in self._costs:  # per batch size: the step cost of each count
            self._costs[r] = np.array([self.step_cost(r, n) for n in self.counts])
        # sums[n]: the expected drafts accepted over all requests when each verifies n
        sums = np.concatenate([[0.0], s.sum(0).cumsum()])
        gain = r + sums[np.minimum(self.counts, s.shape[1])]
        return self.counts[int(np.argmax(gain / (self._costs[r] + host_seconds)))]


def survival_array(survival) -> np.ndarray:
    """Survival scores as a float64 [R, N] array (ragged rows padded with 0: the padding
    passes the check, since 0 is below any score), checked: probabilities, non-increasing
    along a request."""
    if isinstance(survival, np.ndarray):
        s = survival.astype(np.float64, copy=False)
    else:
        s = np.zeros((len(survival), max((len(row) for row in survival), default=0)))
        for r, row in enumerate(survival):
            s[r, :len(row)] = row
    if s.ndim != 2:
        raise SpecError(f"survival must be [R, N], got shape {s.shape}")
    bad = (s < 0) | (s > 1) | np.isnan(s)
    bad[:, 1:] |= s[:, 1:] > s[:, :-1]
    if bad.any():
        r, j = (int(x) for x in np.argwhere(bad)[0])
        raise SpecError(f"adaptive verification: survival[{r}][{j}] = {float(s[r, j])!r}: "
                        f"scores are probabilities, non-increasing along a request")
    return s


def profile_sizes(capture_sizes: Sequence[int], max_size: int) -> list[int]:
    """The sizes to profile: the CUDA-graph capture sizes plus tail sizes past the largest
    (1.5x it, then doubling up to max_size), where real steps run without graphs."""
    sizes = {int(s) for s in capture_sizes if 0 < s <= max_size}
    size = max(sizes, default=0)
    if size:
        sizes.add(min(size + size // 2, max_size))
    size = size or 1
    sizes.add(size)
    while size < max_size:
        size = min(size * 2, max_size)
        sizes.add(size)
    return sorted(sizes)


def profile_costs(run_draft: Callable[[int], None], run_verify: Callable[[int], None],
                  sizes, replays: int = 5, clock: Callable[[], float] = time.perf_counter,
                  sync: Callable[[], None] = lambda: None,
                  progress: Callable[[str], None] = lambda msg: None
                  ) -> tuple[dict[int, float], dict[int, float]]:
    """(draft_cost, verify_cost) for DraftBudget: run_draft(R) drafts for R requests,
    run_verify(T) runs a target step of T tokens. `sizes`: the sizes of both curves, or a
    pair (request counts, token counts). Each size takes the median of `replays` timed runs,
    each between two `sync()` calls (torch.cuda.synchronize on a GPU)."""
    if replays < 1:
        raise SpecError(f"profile_costs: replays must be >= 1, got {replays}")
    sizes = list(sizes)
    pair = len(sizes) == 2 and all(isinstance(s, (list, tuple)) for s in sizes)
    draft_sizes, verify_sizes = (list(sizes[0]), list(sizes[1])) if pair else (sizes, sizes)
    curves = []
    for what, run, points in (("draft", run_draft, draft_sizes),
                              ("verify", run_verify, verify_sizes)):
        if not points or any(not isinstance(x, int) or x < 1 for x in points):
            raise SpecError(f"profile_costs: {what} sizes must be integers >= 1, got {points!r}")
        curve = {}
        for i, size in enumerate(points):
            curve[size] = median_seconds(run, size, replays, clock, sync)
            progress(f"[{i + 1}/{len(points)}] {what} cost at {size}: {curve[size] * 1e3:.3f} ms")
        curves.append(curve)
    return curves[0], curves[1]


def median_seconds(run: Callable[[int], None], size: int, replays: int,
                    clock: Callable[[], float], sync: Callable[[], None]) -> float:
    times = []
    for _ in range(replays):
        sync()
        start = clock()
        run(size)
        sync()
        times.append(clock() - start)
    return statistics.median(times)
