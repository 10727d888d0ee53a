"""Chained speculative steps: the next verify step is launched before this one's tokens reach
the host (overlap.py does the same for plain decode steps).

A speculative step run one at a time waits on the host twice: for the verified tokens (to
accept the drafts) and for the next drafts (to fill the next verify step). On the H200 the
trained tiny spent more of its step there than on the GPU (docs/BENCHMARKS.md). When every
running request is a greedy verify chunk with the same draft count, the engine keeps the loop
on the device: after the verify graph it takes the argmax of every row, accepts the longest
matching prefix of the drafts, writes the correction token and its position into the draft
graph's inputs, replays the draft graph and builds the next verify step's rows from its
drafts (DecodeGraphs.fill_device). The host launches the step after next, then lands this
one: the argmax rows and accepted counts (one pinned copy behind an event) give the same
tokens, commits and outputs as `Engine._verify`.

The tokens are those of the step-by-step path: the same graphs replay the same inputs, the
acceptance is the same rule (greedy: a draft is kept while it equals the target's argmax).
With adaptive verification the host picks each step's draft count (GraphBudget) before the
drafts it verifies have landed: from the estimator's scores of the step before's drafts, and
with the host time the GPU does not hide. The estimator learns from every landed step.

A request that ends or is aborted mid-chain keeps its rows, as padding rows from the next
launch on (they write no cache: its freed blocks are not handed out before the chain ends,
since a chain allocates nothing). The chain ends, landing what is in flight, when a request
arrives, none is left, or one would need a new KV block (blocks for CHAIN_AHEAD more positions are taken at
the start); the host then drafts the next step itself, as after any plain step, and the
drafts are those the device would have made. Near its length limit a request's chained steps
still verify every draft; the tokens past the limit are cut as they land. Sampled rows,
logprobs and grammars run step by step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .request import Chunk, Request, State

# positions of KV blocks taken ahead for a chain (a chain runs until they are used up)
CHAIN_AHEAD = 256


@dataclass
class ChainStep:
    """A launched verify step whose tokens have not reached the host. The next step's device
    inputs are in ChainGraphs' static buffers (the drafts) and the draft graph's (its anchors
    and P0s: beam::spec_accept wrote them)."""

    reqs: list[Request]
    count: int                 # drafts each request verifies
    host: torch.Tensor         # [B, 1 + count + 1 (+ f)] float64 host: argmax rows, accepted,
    ready: torch.cuda.Event | None  # (adaptive) the next drafts' estimator features
    feats: np.ndarray | None = None  # (adaptive) this step's drafts' features [B, f], host


class SpecChainMixin:
    def _init_chain(self) -> None:
        self._chain: ChainStep | None = None
        self._chain_bufs, self._chain_next = None, 0
        self._chain_mark, self._chain_host_s = None, 0.0
        # rows of the chain whose request goes on (1) or ended (0: padding rows from then on)
        self._chain_live = torch.ones(self.options.max_batch, dtype=torch.int64,
                                      device=self.device)
        self._chain_dead: set[int] = set()
        self.stats["spec_chained_steps"] = 0
        self._chain_graphs = None
        if self._chain_ready(budget=False):  # captured at load (the CPU tests' eager graphs:
            self._chain_graphs_now()          # at their first chain)

    def _chain_graphs_now(self):
        """The chained steps' graphs (chain_graphs.py) over the current verify and draft graphs."""
        from .chain_graphs import ChainGraphs

        cg, spec = self._chain_graphs, self.spec
        if cg is None or cg.draft is not spec.graphs or cg.verify is not self.verify_graphs:
            f = spec.num_tokens if spec.estimator is not None else 0
            cg = self._chain_graphs = ChainGraphs(self.verify_graphs, spec.graphs,
                                                  self._chain_live, f, self.device)
        return cg

    def _chain_ready(self, budget: bool = True) -> bool:
        """Drafts on, overlap on, the verify and draft graphs (captured, or their eager
        buffers on the CPU); adaptive: the draft graph's features and (`budget`) the graphs'
        measured costs."""
        spec = self.spec
        if spec is None or not self.overlap or spec.graphs is None or not self.verify_graphs:
            return False
        return spec.estimator is None or (spec.graphs.features is not None
                                          and (spec.graph_budget is not None or not budget))

    def _chain_fits(self, req: Request, ahead: int = 0) -> bool:
        """The request can take two more chained steps: greedy, drafts allowed, no logprobs,
        and KV blocks (and block-table room) for the positions those steps and their drafts
        may write. Its length limit needs no check: tokens past it are cut when they land,
        and they are the tokens a step verifying fewer drafts would give."""
        p, n = req.sampling, self.spec.num_tokens
        if (req.state != State.RUNNING or p.temperature != 0 or p.logprobs is not None
                or not self.spec.eligible(req) or req.pending_first is not None):
            return False
        reach = req.num_tokens + 2 * (1 + n) + self.spec.block
        limit = min(g.width for g in self.verify_graphs.values()) * self.kv_plan.block_size
        if reach > limit:
            return False
        if ahead:
            want = min(req.num_tokens + ahead, req.max_total + reach - req.num_tokens, limit)
            self.scheduler.ensure_blocks(req, max(reach, want))
        return len(req.block_ids) * self.kv_plan.block_size >= reach

    def _chainable(self, chunks: list[Chunk]) -> bool:
        """A scheduled step can start a chain: every running request a verify chunk, all with
        one captured draft count."""
        if not self._chain_ready() or self.scheduler.waiting:
            return False
        count = len(chunks[0].drafts)
        if count not in self.verify_graphs or len(chunks) != len(self.scheduler.running):
            return False
        if len(chunks) > min(self.spec.graphs.max_batch,
                             *(g.max_batch for g in self.verify_graphs.values())):
            return False
        return all(len(c.drafts) == count and c.n == 1 + count and c.start >= c.request.full_cached
                   and self._chain_fits(c.request, CHAIN_AHEAD) for c in chunks)

    def _chain_continues(self, step: ChainStep) -> bool:
        """Every running request is in the chain and fits; a request that ended keeps its
        rows as padding (the chain's rows never move), so the others go on."""
        sched = self.scheduler
        live = [r for r in step.reqs if r.state == State.RUNNING]
        return (bool(live) and not sched.waiting and len(live) == len(sched.running)
                and all(self._chain_fits(r) for r in live))

    def _chained_step(self, chunks: list[Chunk] | None):
        """Launch `chunks` (None: a chained step is in flight), launch the step after it where
        the chain goes on, then land the first; where the chain ends, draft on the host."""
        current = self._chain if chunks is None else self._chain_start(chunks)
        after = None
        if self._chain_continues(current):
            after = self._chain_launch(current, self._chain_count(current))
        self._chain = after
        outputs, next_feats = self._chain_land(current, timed=chunks is None)
        if after is not None:
            after.feats = next_feats
            if not any(r.state == State.RUNNING for r in after.reqs):
                self._chain = after = None  # every request it computes for has ended
        if after is None:  # the host drafts the next step, as after a plain verify step
            self._chain_mark = None
            self.spec.propose([r for r in current.reqs if r.state == State.RUNNING])
        return outputs

    def _chain_start(self, chunks: list[Chunk]) -> ChainStep:
        """The chain's first step: its rows filled from the host as any verify step's; the
        other verify graphs' rows of these requests too (their tables, rings)."""
        reqs, b, count = [c.request for c in chunks], len(chunks), len(chunks[0].drafts)
        chain = self._chain_graphs_now()
        self.spec.graphs.prepare(reqs)  # the draft graph's rows: these requests, in this order
        self._chain_live[:b].fill_(1)
        self._chain_live[b:].fill_(0)  # the graphs' rows past the chain's: padding
        self._chain_dead = set()
        logits = self._forward(chunks)[0]
        for n, g in self.verify_graphs.items():  # (after the forward's fill of `count`'s rows)
            if n != count:
                g.take_rows(self.verify_graphs[count], b)
        feats = None
        if self.spec.estimator is not None:
            feats = torch.stack([c.request.draft_feats for c in chunks]).numpy()
        return self._chain_ship(reqs, count, chain.accept(logits, count, b), feats)

    def _chain_count(self, step: ChainStep) -> int:
        """The next step's draft count: fixed, or the budget's choice from the scores of
        `step`'s drafts (the latest the host has) and the host time not hidden."""
        spec = self.spec
        if spec.estimator is None:
            return spec.num_tokens
        live = [b for b, r in enumerate(step.reqs) if r.state == State.RUNNING]
        scores = spec.estimator.survival_scores(step.feats[live])
        return spec.graph_budget.choose(scores, self._chain_host_s)

    def _chain_launch(self, prev: ChainStep, count: int) -> ChainStep:
        b = len(prev.reqs)
        for row, req in enumerate(prev.reqs):  # ended since: its rows turn to padding
            if req.state != State.RUNNING and row not in self._chain_dead:
                self._chain_live[row].fill_(0)
                self._chain_dead.add(row)
        self.stats["graph_steps"] += 1
        self.stats["spec_chained_steps"] += 1
        return self._chain_ship(prev.reqs, count, self._chain_graphs.replay(b, count))

    def _chain_ship(self, reqs, count: int, out: torch.Tensor, feats=None) -> ChainStep:
        """One copy of a step's outcome (out: ChainGraphs.accept's) to the host, behind an
        event."""
        host = self._chain_host_buf(out.shape)
        host.copy_(out, non_blocking=self.device.type == "cuda")
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return ChainStep(reqs, count, host, ready, feats)

    def _chain_host_buf(self, shape) -> torch.Tensor:
        """Two pinned host buffers, used in turn (at most two steps are in flight)."""
        if self._chain_bufs is None:
            pin = self.device.type == "cuda"
            size = self.options.max_batch * (self.spec.block + 2 + self.spec.block)
            self._chain_bufs = [torch.zeros(size, dtype=torch.float64, pin_memory=pin)
                                for _ in range(2)]
        buf = self._chain_bufs[self._chain_next]
        self._chain_next ^= 1
        return buf[:shape[0] * shape[1]].view(shape)

    def _chain_land(self, step: ChainStep, timed: bool):
        """The step's tokens on the host: per live request the accepted drafts and the
        correction token, emitted and committed as `_verify` does. -> (outputs, the next
        drafts' features or None)."""
        if step.ready is not None:
            step.ready.synchronize()
        q, spec = 1 + step.count, self.spec
        host = step.host.numpy()
        self._chain_time(step, timed)
        top, accepted = host[:, :q].astype(np.int64).tolist(), host[:, q].astype(np.int64)
        live, outputs = [], []
        for b, (req, row, a) in enumerate(zip(step.reqs, top, accepted.tolist())):
            if req.state != State.RUNNING:  # ended (a stop, an abort) while this step ran
                continue
            live.append(b)
            chunk = Chunk(req, req.num_tokens - 1, q, tuple(row[:step.count]))
            # as counted step by step, where a step near the length limit verifies fewer
            room = min(req.sampling.max_tokens - len(req.output_ids),
                       req.max_total - req.num_tokens) - 1
            spec.stats["spec_verify_steps"] += 1
            spec.stats["spec_chained_verifies"] += 1
            spec.stats["spec_drafted_tokens"] += min(step.count, room)
            spec.stats["spec_accepted_tokens"] += min(a, room)
            self._emit_verified(chunk, row[:a + 1], a, None, outputs)
        if spec.estimator is None:
            return outputs, None
        if live:
            spec._observe(step.feats[live], [step.count] * len(live), accepted[live].tolist())
        return outputs, host[:, q + 1:].astype(np.float32)

    def _chain_time(self, step: ChainStep, timed: bool) -> None:
        """Adaptive: fold in the host time a chained step took beyond its graphs' GPU time
        (from one landing to the next, both chained)."""
        if self.spec.estimator is None:
            return
        now = time.perf_counter()
        if timed and self._chain_mark is not None:
            gpu = self.spec.graph_budget.step_cost(len(step.reqs), step.count)
            spent = max(now - self._chain_mark - gpu, 0.0)
            self._chain_host_s = 0.9 * self._chain_host_s + 0.1 * spent
        self._chain_mark = now
