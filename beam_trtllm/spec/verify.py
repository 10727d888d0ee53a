"""Verification of a drafted block: greedy exact match and lossless rejection sampling.

The target's verify forward over [anchor, d_1..d_N] gives logits [R, N+1, V]; row j is the
target's distribution p_j of the token after the anchor and the first j drafts. A greedy row
(temperature 0) accepts d_{j+1} while it is argmax p_j and then emits argmax p_j: the
correction at the first mismatch, the bonus argmax p_N when all N match. A sampled row tests
d_{j+1} against p_j (the request's filtered probabilities: temperature, top-k, top-p, min-p)
and q_{j+1} (the drafter's distribution, softmax(scores / T) over its k candidates, zero
elsewhere): accept iff U * q(d) < p(d), i.e. U < p(d) / q(d); at the first rejection the token
is drawn from max(p_j - q_{j+1}, 0), normalized; after N acceptances the bonus is drawn from
p_N. Each emitted token is then distributed exactly as p (Leviathan et al. 2023, Theorem 1).

Randomness comes from `uniforms(row, index, n)`: n U(0,1) values for the token at output
offset `index` of request `row` in this step. Verify takes the first value of that stream for
the acceptance test of draft index+1 and values 1..V for the exponential race that draws the
token at that offset, so the two are independent. `uniform_source` keys a seeded request's
streams by (seed, output index, salt), as the sampler keys its noise: its tokens depend on
its own seed and position only, whatever else is in the batch.

This package imports nothing from beam_trtllm.engine (the engine imports it), so the filter
rule of `engine.sampler.filtered_probs` is restated here over [n, V] at once (`target_probs`);
tests/test_spec_verify.py checks that the two agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

Uniforms = Callable[[int, int, int], torch.Tensor]

# Salts of the seeded streams: verify's draws and the drafter's walk must never share one.
VERIFY_SALT = 0x5EC1
DRAFT_SALT = 0xD4AF
_MASK64 = (1 << 64) - 1
_TINY = torch.finfo(torch.float32).tiny


class SpecError(ValueError):
    """A verify input that does not fit (names the tensor or the request row)."""


class RequestSampling(Protocol):
    """What verification reads of a request's SamplingParams (beam_trtllm.engine.types)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None


class VerifyResult(NamedTuple):
    num_accepted: list[int]          # per request, 0..num_drafts[r]
    tokens: list[list[int]]          # per request: accepted drafts + the correction or bonus


def target_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 min_p: float = 0.0) -> torch.Tensor:
    """logits [n, V] -> probabilities [n, V], each row exactly as engine.sampler.filtered_probs
    filters one: temperature, min-p, top-k (ties at the k-th value stay), top-p (the crossing
    token stays)."""
    scaled = logits.float() / temperature
    sorted_logits, order = scaled.sort(-1, descending=True)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if min_p > 0:
        keep &= sorted_logits >= sorted_logits[:, :1] + math.log(min_p)
    if top_k > 0:
        kth = min(top_k, sorted_logits.shape[-1]) - 1
        keep[:, top_k:] = False
        # the sampler ORs the tie rule in after min-p, so it also re-admits what min-p dropped
        keep |= sorted_logits >= sorted_logits[:, kth:kth + 1]
    if top_p < 1.0:
        probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(-1)
        keep &= (probs.cumsum(-1) - probs) < top_p
    masked = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.empty_like(masked).scatter_(-1, order, masked.softmax(-1))


def proposal_probs(cand_ids: torch.Tensor, cand_scores: torch.Tensor, temperature: float,
                   vocab_size: int) -> torch.Tensor:
    """The drafter's q [n, V]: softmax(cand_scores / T) [n, k] scattered onto cand_ids [n, k]
    (a repeated id gets the sum of its candidates' mass, which is what the walk draws)."""
    q_rows = (cand_scores.float() / temperature).softmax(-1)
    out = torch.zeros(cand_ids.shape[0], vocab_size, device=q_rows.device)
    return out.scatter_add_(1, cand_ids.long(), q_rows)


def verify(target_logits: torch.Tensor, drafts: torch.Tensor, num_drafts: Sequence[int],
           cand_ids: torch.Tensor, cand_scores: torch.Tensor,
           params: Sequence[RequestSampling], uniforms: Uniforms) -> VerifyResult:
    """target_logits [R, N+1, V] fp32 (shaped: bias, penalties, grammar applied), drafts
    [R, N] int64, num_drafts[r]: row r verifies drafts[r, :num_drafts[r]], cand_ids /
    cand_scores [R, N, k]: the walk's candidates and realized (pre-temperature) scores,
    params[r]: request r's sampling parameters -> accepted counts and emitted tokens."""
    rows, n, vocab = _check(target_logits, drafts, num_drafts, cand_ids, cand_scores, params)
    argmax = target_logits.argmax(-1)                                    # [R, N+1], one pass
    host = torch.cat([drafts.to(argmax), argmax], 1).tolist()            # one sync
    _check_draft_ids(host, num_drafts, vocab)
    sampled = [r for r in range(rows) if params[r].temperature > 0]
    if sampled:
        _check_candidate_ids(cand_ids[sampled], vocab)
    accepted = [_greedy_accepted(host[r][:num_drafts[r]], host[r][n:]) for r in range(rows)]
    last = [host[r][n + accepted[r]] for r in range(rows)]
    drawn = []
    for r in sampled:
        accepted[r], token = _sample_row(target_logits[r], drafts[r], cand_ids[r],
                                         cand_scores[r], num_drafts[r], params[r], uniforms, r)
        drawn.append(token)
    for r, token in zip(sampled, torch.stack(drawn).tolist() if drawn else []):
        last[r] = token                                                  # one more sync
    tokens = [host[r][:accepted[r]] + [last[r]] for r in range(rows)]
    return VerifyResult(accepted, tokens)


def _greedy_accepted(row_drafts: list[int], row_argmax: list[int]) -> int:
    for j, d in enumerate(row_drafts):
        if d != row_argmax[j]:
            return j
    return len(row_drafts)


def _sample_row(logits: torch.Tensor, drafts: torch.Tensor, cand_ids: torch.Tensor,
                cand_scores: torch.Tensor, nd: int, p: RequestSampling, uniforms: Uniforms,
                row: int) -> tuple[int, torch.Tensor]:
    """One sampled request -> (accepted drafts, the token emitted after them, a 0-d tensor
    left on the device until the batch's tokens are read together)."""
    vocab = logits.shape[-1]
    probs = target_probs(logits[:nd + 1], p.temperature, p.top_k, p.top_p, p.min_p)
    q = None
    num_accepted = 0
    if nd:
        q = proposal_probs(cand_ids[:nd], cand_scores[:nd], p.temperature, vocab)
        d = drafts[:nd, None].long()
        p_d, q_d = probs[:nd].gather(1, d)[:, 0], q.gather(1, d)[:, 0]
        u = torch.cat([uniforms(row, j, 1) for j in range(nd)]).to(p_d)
        # U * q(d) < p(d): U < p/q, and a draft of q-mass 0 (underflow) is kept iff p(d) > 0
        num_accepted = int((u * q_d < p_d).int().cumprod(0).sum())
    if num_accepted < nd:
        weights = (probs[num_accepted] - q[num_accepted]).clamp_min(0)
        # p == q up to rounding leaves no residual mass; the rejection then had probability
        # ~0 and p itself is the right law for the token
        weights = torch.where(weights.sum() > 0, weights, probs[num_accepted])
    else:
        weights = probs[nd]
    noise = -torch.log(uniforms(row, num_accepted, vocab + 1)[1:].to(weights))
    return num_accepted, (weights / noise).argmax()


def _check(target_logits, drafts, num_drafts, cand_ids, cand_scores, params):
    if target_logits.dim() != 3:
        raise SpecError(f"verify: target_logits must be [R, N+1, V], got "
                        f"{tuple(target_logits.shape)}")
    rows, n1, vocab = target_logits.shape
    n = n1 - 1
    if tuple(drafts.shape) != (rows, n):
        raise SpecError(f"verify: drafts must be [R, N] = [{rows}, {n}] (target_logits "
                        f"{tuple(target_logits.shape)}), got {tuple(drafts.shape)}")
    if cand_ids.dim() != 3 or tuple(cand_ids.shape[:2]) != (rows, n):
        raise SpecError(f"verify: cand_ids must be [R, N, k] with R, N = {rows}, {n}, "
                        f"got {tuple(cand_ids.shape)}")
    if cand_scores.shape != cand_ids.shape:
        raise SpecError(f"verify: cand_scores {tuple(cand_scores.shape)} must match cand_ids "
                        f"{tuple(cand_ids.shape)}")
    if len(num_drafts) != rows or len(params) != rows:
        raise SpecError(f"verify: {rows} rows but {len(num_drafts)} num_drafts and "
                        f"{len(params)} params")
    for r, nd in enumerate(num_drafts):
        if not 0 <= nd <= n:
            raise SpecError(f"verify: num_drafts[{r}] = {nd} is outside 0..{n}")
    return rows, n, vocab


def _check_draft_ids(host: list[list[int]], num_drafts: Sequence[int], vocab: int) -> None:
    for r, nd in enumerate(num_drafts):
        for j, d in enumerate(host[r][:nd]):
            if not 0 <= d < vocab:
                raise SpecError(f"verify: drafts[{r}, {j}] = {d} is not a token id (vocab {vocab})")


def _check_candidate_ids(cand_ids: torch.Tensor, vocab: int) -> None:
    if cand_ids.numel():
        low, high = (int(x) for x in cand_ids.aminmax())
        if low < 0 or high >= vocab:
            raise SpecError(f"verify: cand_ids of sampled rows span {low}..{high}, outside the "
                            f"vocabulary 0..{vocab - 1}")


def stream_seed(seed: int, index: int, salt: int) -> int:
    """The generator seed of a seeded request's stream at output `index` (splitmix64 mixing,
    so neighbouring seeds and indices give unrelated streams)."""
    x = int(seed) & _MASK64
    for part in (int(index), int(salt)):
        x = _mix64(x ^ ((part * 0x9E3779B97F4A7C15) & _MASK64))
    return x & ((1 << 63) - 1)


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _seeded_uniforms(seed: int, index: int, salt: int, n: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(stream_seed(seed, index, salt))
    return torch.rand(n, generator=g).clamp_(min=_TINY).to(device)


def uniform_source(params: Sequence[RequestSampling], indices: Sequence[int],
                   generator: torch.Generator | None = None, device="cpu",
                   salt: int = VERIFY_SALT) -> Uniforms:
    """`uniforms(row, index, n)` for verify: n values in (0, 1) for the token at output index
    indices[row] + index of request `row` (`indices[row]`: tokens it generated before this
    step). A seeded request's values are a pure function of (seed, output index, salt); an
    unseeded one's come from `generator` (the engine's, on `device`)."""

    def uniforms(row: int, index: int, n: int) -> torch.Tensor:
        seed = params[row].seed
        if seed is None:
            return torch.rand(n, generator=generator, device=device).clamp_(min=_TINY)
        return _seeded_uniforms(seed, indices[row] + index, salt, n, device)

    return uniforms


def draft_uniforms(params: Sequence[RequestSampling], indices: Sequence[int], num_slots: int,
                   generator: torch.Generator | None = None, device="cpu") -> torch.Tensor:
    """The drafter's walk uniforms [R, N]: slot s of row r drafts the token at output index
    indices[r] + s; seeded rows take the first value of that index's DRAFT_SALT stream,
    unseeded rows one batched draw from `generator`, greedy rows ignore theirs."""
    out = torch.rand(len(params), num_slots, generator=generator, device=device).clamp_(min=_TINY)
    for r, p in enumerate(params):
        if p.seed is not None and p.temperature > 0 and num_slots:
            out[r] = torch.cat([_seeded_uniforms(p.seed, indices[r] + s, DRAFT_SALT, 1, "cpu")
                                for s in range(num_slots)]).to(device)
    return out
