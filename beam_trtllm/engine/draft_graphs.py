"""CUDA graphs of the drafter's draft step (speculative.py), one per batch size.

`DFlash2Drafter.draft` is capturable (fixed shapes per batch size, no host reads). Its inputs
live in static buffers sized for the largest batch; a step with R requests replays the
smallest captured size b >= R. The b - R padding rows start at a negative position, so every
slot they write or read is the drafter cache's scratch slot (DraftKV.slots_of), and their
outputs are dropped. The walk always gets uniforms (a greedy row, temperature 0, ignores
them), so one graph serves greedy and sampled rows together.

With `compile`, the captured function is `torch.compile` of the draft step (with the features,
if any): inductor fuses the drafter's ~500 small kernels (norms, the grouped convs, RoPE, the
walk), 0.84 -> 0.29 ms a draft step at batch 1 on an H200 (2026-12-02; 0.18 ms on 2026-12-04,
its KV writes a mutating op), for about 20 s of compilation per batch size at load. Drafts
need not match the eager ones bit for bit: verification keeps the output the target's.

With `features` (adaptive verification), the graph also computes the acceptance estimator's
features of the drafts and packs them with the drafts into one float64 tensor, the one the
host reads: no eager launches for them after the replay.
"""

from __future__ import annotations

import torch

from ..draft.model import DraftOutput
from .host_buffers import HostTable, Staging


class DraftGraphs:
    def __init__(self, drafter, kv, sizes: tuple[int, ...], table_width: int,
                 device: torch.device, capture: bool = True, compile: bool = False,
                 features=None):
        self.drafter, self.kv, self.device = drafter, kv, device
        # features(cand_scores [b, N, k], temps [b]) -> [b, n]: packed after the drafts
        self.features = features
        # one compiled function for the drafts and their features: eager, the features' ~20
        # small kernels took 0.038 ms of a 0.343 ms draft step at batch 1 (H200, 2026-12-04)
        self.fn = torch.compile(self._step, dynamic=False) if compile else self._step
        self.sizes = tuple(sorted(sizes))
        self.max_batch = self.sizes[-1]
        n, b = drafter.cfg.num_draft_tokens, self.max_batch
        self.pad_start = -(drafter.cfg.block_size + drafter.cfg.sliding_window)
        self.buf = {
            "anchors": torch.zeros(b, dtype=torch.int64, device=device),
            "start": torch.full((b,), self.pad_start, dtype=torch.int64, device=device),
            "table": torch.zeros(b, table_width, dtype=torch.int32, device=device),
            "uniforms": torch.full((b, n), 0.5, dtype=torch.float32, device=device),
            "temps": torch.zeros(b, dtype=torch.float32, device=device),
        }
        self.stage = self.table = None  # host staging of run()'s inputs (host_buffers.py)
        self.capture = capture
        self.graphs: dict[int, tuple] = {}
        if capture:
            self._capture_all()

    def _call(self, b: int) -> tuple[DraftOutput, torch.Tensor | None]:
        """(the drafts, [b, N + n] float64 drafts then features, or None without features)."""
        v = {k: t[:b] for k, t in self.buf.items()}
        return self.fn(v["anchors"], v["start"], v["table"], v["uniforms"], v["temps"])

    def _step(self, anchors, start, table, uniforms, temps):
        out = self.drafter.draft(self.kv, anchors, start, table, uniforms, temps)
        if self.features is None:
            return out, None
        feats = self.features(out.cand_scores, temps)
        return out, torch.cat([out.tokens.double(), feats.double()], 1)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for b in sorted(self.sizes, reverse=True):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._call(b)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outs = self._call(b)
            self.graphs[b] = (graph, outs)
        torch.cuda.synchronize(self.device)

    def replay_padding(self, b: int) -> None:
        """Replay graph b with every row at the padding start (scratch slots only): its cost."""
        self.buf["start"][:b].fill_(self.pad_start)
        self.graphs[b][0].replay()

    def size_for(self, r: int) -> int | None:
        return next((s for s in self.sizes if s >= r), None)

    def run(self, reqs, anchors: list[int], starts: list[int], temps: list[float],
            uniforms: torch.Tensor | None) -> tuple[DraftOutput, torch.Tensor | None]:
        """The drafts of R = len(reqs) requests (R <= max_batch): anchors, P0s and temperatures
        as host lists (staged in pinned memory, host_buffers.py), each request's block table
        row from `req.block_ids`, uniforms [R, N] on the device or None (greedy rows). Also
        the packed drafts and features [R, N + n] (on the device), None without features."""
        r = len(reqs)
        b = self._stage(reqs, anchors, starts, temps)
        if uniforms is not None:
            self.buf["uniforms"][:r].copy_(uniforms)
        out, packed = self._replay(b)
        return DraftOutput(*(t[:r] for t in out)), (packed[:r] if packed is not None else None)

    def prepare(self, reqs) -> None:
        """Stage the requests' block tables in rows 0..R-1 (the rest padding) for greedy
        `replay_rows` steps of them in that order (spec_chain.py)."""
        self._stage(reqs, [0] * len(reqs), [self.pad_start] * len(reqs), [0.0] * len(reqs))

    def replay_rows(self, r: int):
        """Greedy drafts [R, N] of the R requests `prepare` staged, from the anchors and P0s
        already in the static buffers (beam::spec_accept writes them on the device), and the
        packed drafts and features [R, N + n] as `run`'s (None without features)."""
        out, packed = self._replay(self.size_for(r))
        return out.tokens[:r], (packed[:r] if packed is not None else None)

    def _replay(self, b: int):
        """Graph b over the static buffers as they are (captured: a replay) -> `_call`'s."""
        if not self.capture:
            return self._call(b)
        graph, outs = self.graphs[b]
        graph.replay()
        return outs

    def _stage(self, reqs, anchors, starts, temps) -> int:
        """run()'s host inputs into the static buffers (pinned staging) -> the graph size."""
        r = len(reqs)
        b = self.size_for(r)
        if self.stage is None:
            self.stage = Staging({k: self.buf[k] for k in ("anchors", "start", "table", "temps")},
                                 self.device)
            self.table = HostTable(self.stage.host["table"])
        stage = self.stage
        stage.wait()
        h = stage.np
        h["anchors"][:b] = 0
        h["anchors"][:r] = anchors
        h["start"][:b] = self.pad_start
        h["start"][:r] = starts
        h["temps"][:b] = 0.0
        h["temps"][:r] = temps
        for row, req in enumerate(reqs):
            self.table.set(row, req)
        stage.copy(b)
        return b
