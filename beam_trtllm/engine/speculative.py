"""Speculative decoding with a DFlash2 drafter inside the engine (docs/SPECULATIVE.md).

Per step, for every running request that decodes with drafts on:
1. the target verifies [anchor, d_1..d_n] in one forward (a verify chunk: scheduler.py,
   batch.py) and captures its residual stream at the drafter's `target_layer_ids`;
2. `beam_trtllm.spec.verify` accepts a prefix of the drafts (greedy: exact match; sampled:
   lossless rejection sampling) and adds the correction or bonus token;
3. the drafter's context K/V of the tokens whose target states are now final (a prefill
   chunk's, or the anchor and the accepted drafts) is written into its paged cache, which uses
   the target's block ids, so prefix reuse and KV transfer carry it along;
4. the drafter drafts the next block from the new anchor; with adaptive verification the
   acceptance estimator and the measured step costs choose how many of them to verify.

Requests whose logits are shaped by penalties, logit bias or a grammar, prefill-only requests
and requests near their length limit decode without drafts (their outputs are unchanged).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .request import Chunk, Request, State
from .types import EngineError

from .draft_build import DRAFT_DIR  # noqa: F401  (an engine dir's drafter)


@dataclass(frozen=True)
class SpecConfig:
    """`tokens`: drafts verified per step (at most the drafter's block size - 1; 0 = off);
    `adaptive`: let the acceptance estimator and the step costs choose fewer; `draft`: a
    drafter checkpoint dir (None: the engine dir's `draft/`)."""

    tokens: int | None = None
    adaptive: bool = False
    draft: str | Path | None = None
    compile: bool = True  # CUDA: torch.compile the draft step before capturing it (draft_graphs.py)

    @classmethod
    def from_json(cls, raw, where: str) -> "SpecConfig | None":
        """The `speculative:` block of a graph YAML (None/false: off)."""
        if raw in (None, False):
            return None
        if raw is True:
            return cls()
        if not isinstance(raw, dict):
            raise EngineError(f"{where}: speculative must be a mapping, true or false")
        extra = sorted(set(raw) - {"tokens", "adaptive", "draft", "compile"})
        if extra:
            raise EngineError(f"{where}: speculative has an unknown field {extra[0]!r} "
                              "(fields: draft, tokens, adaptive, compile)")
        tokens = raw.get("tokens")
        if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
            raise EngineError(f"{where}: speculative.tokens must be an integer >= 1, got {tokens!r}")
        for key in ("adaptive", "compile"):
            if not isinstance(raw.get(key, False), bool):
                raise EngineError(f"{where}: speculative.{key} must be true or false")
        return cls(tokens, raw.get("adaptive", False), raw.get("draft"), raw.get("compile", True))


def find_draft_dir(engine_dir: Path, spec: SpecConfig) -> Path:
    path = Path(spec.draft) if spec.draft is not None else engine_dir / DRAFT_DIR
    if not (path / "config.json").is_file():
        where = "speculative.draft" if spec.draft is not None else f"engine dir {engine_dir}"
        raise EngineError(f"{where}: no drafter at {path} (config.json missing); build with "
                          "`beam-trt build --draft DIR` or name a DFlash2 checkpoint dir")
    return path


def dir_draft_tokens(engine_dir: Path, spec: "SpecConfig | None") -> int:
    """Draft tokens of the drafter an engine dir's speculative decoding would load (0: none)."""
    from ..draft.config import DraftConfig

    try:
        path = find_draft_dir(Path(engine_dir), spec or SpecConfig())
    except EngineError:  # no drafter: drafts off, one row a sequence
        return 0
    return DraftConfig.from_dir(path).num_draft_tokens


class SpecDecoder:
    """The drafter, its KV, the verifier and the adaptive budget of one engine."""

    def __init__(self, engine, drafter, num_tokens: int, adaptive: bool,
                 use_cuda_graphs: bool = True, compile: bool = True):
        from ..draft import DraftKV

        self.engine, self.drafter = engine, drafter
        self.dcfg = drafter.cfg
        block = self.dcfg.num_draft_tokens
        if not 1 <= num_tokens <= block:
            raise EngineError(f"speculative tokens {num_tokens}: the drafter drafts {block} "
                              f"per step (its block_size {self.dcfg.block_size} counts the anchor)")
        self.num_tokens, self.block = num_tokens, block
        # the context K/V of every target row, in the decode and verify graphs: compiled, its
        # ~60 small kernels fuse (0.13 ms of a 0.34 ms batch-1 verify graph, H200 2026-12-04)
        cuda_compile = engine.device.type == "cuda" and compile
        self._context_kv = torch.compile(drafter.context_kv, dynamic=True) if cuda_compile \
            else drafter.context_kv
        self.layers = tuple(self.dcfg.target_layer_ids)
        plan = engine.kv_plan
        self.kv = DraftKV(self.dcfg, plan.num_blocks, plan.block_size, engine.device,
                          engine.model.act_dtype)
        self.estimator = self.budget = self.graph_budget = None
        # the verify graphs' draft counts: adaptive verification picks among them (GraphBudget)
        self.verify_counts = (num_tokens,)
        if adaptive:
            from ..spec.adaptive import AcceptanceEstimator

            self.estimator = AcceptanceEstimator(num_tokens)
            assert AcceptanceEstimator.REFIT_INTERVAL % self.OBSERVE_EVERY == 0
            self.verify_counts = tuple(sorted({n for n in (1, 2, 4) if n < num_tokens}
                                              | {num_tokens}))
        self._observed = [[], [], [], 0]  # feature blocks, drafts, accepted, steps not folded
        self.host_seconds, self._timed, self._mark = 0.0, None, None  # (_time_host)
        self.stats = {"spec_verify_steps": 0, "spec_drafted_tokens": 0,
                      "spec_accepted_tokens": 0, "spec_chained_verifies": 0}
        self.graphs = None
        if engine.device.type == "cuda" and use_cuda_graphs and engine.options.cuda_graph_batch_sizes:
            self.graphs = self.make_graphs(engine.options.cuda_graph_batch_sizes, compile=compile)

    def make_graphs(self, sizes, capture: bool = True, compile: bool = False):
        """The draft step's CUDA graphs (draft_graphs.py); capture=False: run eagerly."""
        from .draft_graphs import DraftGraphs
        from .plan import cdiv

        eng = self.engine
        width = cdiv(eng.options.max_seq_len + self.block + 1, eng.kv_plan.block_size)
        return DraftGraphs(self.drafter, self.kv, tuple(sizes), width, eng.device, capture, compile,
                           self._features if self.estimator is not None else None)

    def _features(self, cand_scores: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
        """The estimator's features of the drafts that verification may take."""
        return self.estimator.features(cand_scores[:, :self.num_tokens], temps)

    def summary(self) -> str:
        """'; drafts: mean acceptance length 3.2 (...)' for a CLI status line."""
        st = self.stats
        steps = st["spec_verify_steps"]
        if not steps:
            return "; drafts: no verify steps"
        mean = (st["spec_accepted_tokens"] + steps) / steps
        return (f"; drafts: {st['spec_accepted_tokens']}/{st['spec_drafted_tokens']} accepted, "
                f"mean acceptance length {mean:.2f} over {steps} verify steps")

    # ------------------------------------------------------------------ eligibility
    def eligible(self, req: Request) -> bool:
        p = req.sampling
        return not (req.prefill_only or p.shapes_logits or p.structural_tag)

    # ------------------------------------------------------------------ context K/V
    def context_slots(self, chunks: list[Chunk]) -> list[int]:
        """Per token row of the step: the drafter-cache slot its context K/V goes to once
        final (-1: a prefix-cached position, whose K/V the shared block holds already)."""
        bs = self.engine.kv_plan.block_size
        slots = []
        for c in chunks:
            req = c.request
            for p in range(c.start, c.start + c.n):
                slots.append(-1 if p < req.full_cached
                             else req.block_ids[p // bs] * bs + p % bs)
        return slots

    def write_context(self, chunks: list[Chunk], hidden: torch.Tensor, slots: list[int]) -> None:
        """Context K/V of every row of the step (`slots`: context_slots). A verify chunk's
        rejected rows are written too: their positions are at or past the next anchor's, so
        the next draft block overwrites them before any query reads them (and the block of a
        request that stops drafting is never read), which keeps this step free of the
        verification's outcome: the CUDA-graph steps do it inside the graph (`in_graph`)."""
        if all(s < 0 for s in slots):
            return
        dev = self.engine.device
        positions = [p for c in chunks for p in range(c.start, c.start + c.n)]
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        self.in_graph(hidden, pos, torch.tensor(slots, dtype=torch.int64, device=dev))

    def in_graph(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Device-only: the drafter's context K/V of `hidden` rows into its cache at `slots`
        (-1: the scratch slot). Captured by the target's decode and verify graphs."""
        k, v = self._context_kv(hidden, positions)
        self.kv.write(slots, k, v)

    # ------------------------------------------------------------------ drafting
    def propose(self, reqs: list[Request]) -> None:
        """Draft the next block for each request (its last output token is the anchor)."""
        sched = self.engine.scheduler
        go, rooms = [], []
        for req in reqs:
            req.drafts, req.draft_cands, req.draft_feats = [], None, None
            room = min(req.sampling.max_tokens - len(req.output_ids),
                       req.max_total - req.num_tokens) - 1
            if req.state != State.RUNNING or room < 1 or not self.eligible(req):
                continue
            # the drafter writes its block's K/V at P0..P0+N: blocks must exist there
            if sched.ensure_blocks(req, req.num_tokens + self.block):
                go.append(req)
                rooms.append(room)
        if not go:
            return
        anchors = [r.output_ids[-1] for r in go]
        starts = [r.num_tokens - 1 for r in go]
        temps = [float(r.sampling.temperature) for r in go]
        sampled = any(t > 0 for t in temps)
        uniforms = None
        if sampled:
            from ..spec.verify import draft_uniforms

            uniforms = draft_uniforms([r.sampling for r in go], [len(r.output_ids) for r in go],
                                      self.block, self.engine.generator, self.engine.device)
        packed = None  # the graph's drafts and features in one tensor (draft_graphs.py)
        if self.graphs is not None and len(go) <= self.graphs.max_batch:
            out, packed = self.graphs.run(go, anchors, starts, temps, uniforms)
            temps_dev = self.graphs.buf["temps"][:len(go)]
        else:
            out, temps_dev = self._draft_eager(go, anchors, starts, temps, uniforms)
        counts, tokens, feats = self._admit(out, temps_dev, rooms, packed)
        if sampled:  # (a graph's outputs are its static buffers: the next replay overwrites them)
            cand_ids, cand_scores = out.cand_ids.clone(), out.cand_scores.clone()
        for b, r in enumerate(go):
            r.drafts = tokens[b][:counts[b]]
            if sampled:
                r.draft_cands = (cand_ids[b], cand_scores[b])
            if feats is not None:
                r.draft_feats = feats[b]
            self.stats["spec_drafted_tokens"] += counts[b]

    def _draft_eager(self, go, anchors, starts, temps, uniforms):
        """The draft step without a graph (the CPU, or more requests than the largest graph)."""
        dev = self.engine.device
        table = torch.zeros(len(go), max(len(r.block_ids) for r in go), dtype=torch.int32)
        for b, r in enumerate(go):
            table[b, :len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
        temps_t = torch.tensor(temps, dtype=torch.float32, device=dev)
        out = self.drafter.draft(self.kv, torch.tensor(anchors, device=dev),  # (int64)
                                 torch.tensor(starts, device=dev), table.to(dev), uniforms, temps_t)
        return out, temps_t

    def _admit(self, out, temps: torch.Tensor, rooms: list[int], packed=None):
        """-> (drafts to verify per request, the drafts as host lists, the estimator's
        features on the host or None). Fixed: `num_tokens` (and the room left); adaptive: the
        estimator's survival-ranked prefix the budget admits. One device read either way
        (`packed`: the graph's drafts and features, else packed here)."""
        n = [min(self.num_tokens, room) for room in rooms]
        if self.estimator is None:
            return n, out.tokens.tolist(), None
        if packed is None:  # token ids are exact in float64: drafts and features in one read
            packed = torch.cat([out.tokens.double(), self._features(out.cand_scores,
                                                                    temps).double()], 1)
        both = packed.cpu()
        tokens = both[:, :self.block].long().tolist()
        feats = both[:, self.block:].float()
        scores = self.estimator.survival_scores(feats.numpy())
        scores[np.arange(scores.shape[1]) >= np.array(n)[:, None]] = 0.0  # past each room
        if self._graph_step(len(rooms)):
            if self.graph_budget is None:
                self.graph_budget = self._profile_graphs()
            self._time_host(len(rooms))
            count = self.graph_budget.choose(scores, self.host_seconds)
            self._timed = (len(rooms), count)
            return [min(count, k) for k in n], tokens, feats
        self._timed = None
        if self.budget is None:
            self.budget = self._profile()
        # the next step: every running request emits a token and feeds one non-draft token
        # (its anchor; prefill chunks of new requests are not known yet)
        running = max(len(self.engine.scheduler.running), len(rooms))
        admitted = self.budget.choose(scores, running, running)
        return [min(a, k) for a, k in zip(admitted, n)], tokens, feats

    def _graph_step(self, r: int) -> bool:
        """Whether the next verify step of r requests replays captured graphs."""
        vg = self.engine.verify_graphs
        return bool(vg) and self.graphs is not None and self.graphs.capture and \
            r <= min(self.graphs.max_batch, *(g.max_batch for g in vg.values()))

    def _time_host(self, r: int) -> None:
        """Fold the last graph step's host time in: its wall time from one draft choice to
        the next, less its graphs' measured cost (counted only when exactly one engine step,
        a graph step, ran in between)."""
        now, st = time.perf_counter(), self.engine.stats
        mark = (now, st["steps"], st["graph_steps"])
        if self._timed is not None and self._mark is not None:
            t0, steps, graphs = self._mark
            if mark[1] - steps == 1 and mark[2] - graphs == 1:
                spent = now - t0 - self.graph_budget.step_cost(*self._timed)
                self.host_seconds = 0.9 * self.host_seconds + 0.1 * max(spent, 0.0)
        self._mark = mark

    def _profile_graphs(self):
        """Median replay seconds of every captured draft and verify graph (padding rows)."""
        from ..spec.adaptive import GraphBudget, median_seconds

        dev, self._mark = self.engine.device, None
        sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
        draft = {b: median_seconds(self.graphs.replay_padding, b, 5, time.perf_counter, sync)
                 for b in self.graphs.sizes}
        verify = {(b, n): median_seconds(g.replay_padding, b, 5, time.perf_counter, sync)
                  for n, g in self.engine.verify_graphs.items() for b in self.graphs.sizes
                  if b <= g.max_batch}
        return GraphBudget(draft, verify)

    def _profile(self):
        """Measured draft and verify step costs (spec §8), before the first adaptive step."""
        from ..spec.adaptive import DraftBudget, profile_costs

        eng = self.engine
        sync = (lambda: torch.cuda.synchronize(eng.device)) if eng.device.type == "cuda" \
            else (lambda: None)
        draft_cost, verify_cost = profile_costs(
            self._dummy_draft, self._dummy_verify,
            sizes=_sizes(eng.options.max_batch, eng.options.max_num_tokens), sync=sync)
        return DraftBudget(draft_cost, verify_cost)

    def _dummy_draft(self, r: int) -> None:
        """A draft step of r requests that touches no live cache: at negative positions every
        slot it writes or reads is the drafter cache's scratch slot (DraftKV.slots_of)."""
        dev, c = self.engine.device, self.dcfg
        table = torch.zeros((r, 1), dtype=torch.int32, device=dev)
        start = torch.full((r,), -(c.block_size + c.sliding_window), dtype=torch.int64, device=dev)
        self.drafter.draft(self.kv, torch.zeros(r, dtype=torch.int64, device=dev), start, table,
                           None, torch.zeros(r, dtype=torch.float32, device=dev))

    def _dummy_verify(self, t: int) -> None:
        self.engine.model_cost_probe(t)

    # ------------------------------------------------------------------ verification
    def verify(self, chunks: list[Chunk], logits: list[torch.Tensor], indices: list[int]):
        """logits[i]: [1 + len(drafts), V] rows of verify chunk i -> VerifyResult."""
        from ..spec.verify import VerifyResult

        params = [c.request.sampling for c in chunks]
        num = [len(c.drafts) for c in chunks]
        if all(p.temperature == 0 for p in params):
            # greedy: one argmax over every row and one read; the drafts are on the host
            flat = logits[0] if len(logits) == 1 else torch.cat(logits)
            argmax, row, accepted, tokens = flat.argmax(-1).tolist(), 0, [], []
            for c in chunks:
                m = len(c.drafts)
                top = argmax[row:row + m + 1]
                a = next((j for j in range(m) if c.drafts[j] != top[j]), m)
                accepted.append(a)
                tokens.append(list(c.drafts[:a]) + [top[a]])
                row += m + 1
            res = VerifyResult(accepted, tokens)
        else:
            res = self._verify_sampled(chunks, logits, params, indices)
        self.stats["spec_verify_steps"] += len(chunks)
        self.stats["spec_accepted_tokens"] += sum(res.num_accepted)
        if self.estimator is not None:
            self._observe(torch.stack([c.request.draft_feats for c in chunks]).numpy(), num,
                          res.num_accepted)
        return res

    OBSERVE_EVERY = 10  # verify steps folded into the estimator at once (divides REFIT_INTERVAL)

    def _observe(self, feats, num: list[int], accepted: list[int]) -> None:
        """Buffer a step's observations (feats [R, n] on the host); fold them in every
        OBSERVE_EVERY steps (the same statistics: the fit only moves at a refit)."""
        buf = self._observed
        buf[0].append(np.asarray(feats, dtype=np.float32))
        buf[1].extend(num)
        buf[2].extend(accepted)
        buf[3] += 1
        if buf[3] >= self.OBSERVE_EVERY:
            self.estimator.observe(torch.from_numpy(np.concatenate(buf[0])), buf[1], buf[2],
                                   steps=buf[3])
            self._observed = [[], [], [], 0]

    def _verify_sampled(self, chunks, logits, params, indices):
        """spec.verify over [R, N+1, V] targets: rejection sampling for the sampled rows."""
        from ..spec.verify import uniform_source, verify

        n = max(len(c.drafts) for c in chunks)
        vocab, dev = logits[0].shape[-1], logits[0].device
        target = torch.full((len(chunks), n + 1, vocab), float("-inf"), device=dev)
        drafts = torch.zeros(len(chunks), n, dtype=torch.int64)
        k = next(c.request.draft_cands[0].shape[-1] for c in chunks if c.request.draft_cands)
        cand_ids = torch.zeros(len(chunks), n, k, dtype=torch.int64, device=dev)
        cand_scores = torch.zeros(len(chunks), n, k, dtype=torch.float32, device=dev)
        for b, (c, rows) in enumerate(zip(chunks, logits)):
            m = len(c.drafts)
            target[b, :m + 1] = rows
            drafts[b, :m] = torch.tensor(c.drafts, dtype=torch.int64)
            if c.request.draft_cands is not None:
                ids, scores = c.request.draft_cands
                cand_ids[b, :m], cand_scores[b, :m] = ids[:m], scores[:m].float()
        return verify(target, drafts.to(dev), [len(c.drafts) for c in chunks], cand_ids,
                      cand_scores, params, uniform_source(params, indices, self.engine.generator,
                                                          dev))


def _sizes(max_batch: int, max_tokens: int) -> tuple[list[int], list[int]]:
    return (sorted({1, 2, 4, 8, 16, 32, 64, 128, max_batch} & set(range(1, max_batch + 1))),
            sorted({t for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, max_tokens) if t <= max_tokens}))

