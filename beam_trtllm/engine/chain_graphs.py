"""One CUDA graph per chained speculative step (spec_chain.py), by batch size and draft count.

A chained step is: beam::verify_rows (the verify rows from the last drafts), the target's
verify forward, the argmax of every row, beam::spec_accept (the next anchors and P0s into the
draft step's inputs), the draft step, and the copies of its drafts and features. Launched one
by one, that was eight host launches a step: ~0.28 ms of the host's ~0.46 ms a step at batch
1 on an H200, where the GPU's step took ~0.45 ms (with adaptive verification's choice on
top, the host was the limit; docs/BENCHMARKS.md). Here the whole step is one graph: the verify forward's and the draft step's bodies are captured again,
into the verify graphs' memory pool (only their intermediates live there, and the steps never
run at once, so the pool is shared rather than grown).

Everything one step hands the next lives in static buffers outside the graphs: the draft
step's inputs (anchors, P0s), `drafts` (the next verify step's drafts), `live` (the chain's
rows: 0 turns a row into padding) and `out` per draft count (what the host reads: each row's
argmax, the accepted count, the next drafts' estimator features). So a graph of one draft
count can follow one of another (adaptive verification), and the chain's first step, which
the host fills, hands over through the same buffers (`accept`).

Without capture (the CPU) the same function runs eagerly: the tests check it against the
step-by-step path.
"""

from __future__ import annotations

import torch


class ChainGraphs:
    def __init__(self, verify_graphs: dict, draft_graphs, live: torch.Tensor, num_features: int,
                 device: torch.device):
        """verify_graphs: {draft count: DecodeGraphs of 1 + count rows a sequence};
        draft_graphs: the drafter's DraftGraphs; live [max_batch] int64: the chain's rows;
        num_features: the estimator's features per request (0: fixed verification)."""
        self.verify, self.draft, self.live, self.f = verify_graphs, draft_graphs, live, num_features
        self.block = draft_graphs.drafter.cfg.num_draft_tokens
        b = draft_graphs.max_batch
        self.drafts = torch.zeros(b, self.block, dtype=torch.int64, device=device)
        self.out = {n: torch.zeros(b, 2 + n + num_features, dtype=torch.float64, device=device)
                    for n in verify_graphs}
        self.device = device
        self.capture = draft_graphs.capture and all(g.capture for g in verify_graphs.values())
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        if self.capture:
            self._capture_all()

    def accept(self, logits: torch.Tensor, count: int, b: int, replay_draft: bool = True):
        """After a verify step of b sequences x (1 + count) rows (logits: its rows): accept
        on the device, draft the next block -> out [min(b, the draft graphs' largest size),
        2 + count + f] (a static buffer).
        replay_draft: the draft graph's replay (a host-launched step) or its body (a capture)."""
        # a verify graph may be wider than the largest draft graph (batch-invariant mode: one
        # verify size, max_batch); its rows past that are padding (live 0), left out here
        g, q, r = self.verify[count], 1 + count, min(b, self.draft.max_batch)
        ids = g.buf["input_ids"][:r * q].view(r, q)
        start = g.buf["positions"][:r * q:q]
        d, out = self.draft.buf, self.out[count][:r]
        torch.ops.beam.spec_accept(logits[:r * q].argmax(-1), ids, start, self.live,
                                   d["anchors"], d["start"], out, self.draft.pad_start)
        if replay_draft:
            tokens, packed = self.draft.replay_rows(r)
        else:
            drafted, packed = self.draft._call(self.draft.size_for(r))
            tokens = drafted.tokens
        self.drafts[:r].copy_(tokens[:r])
        if self.f:  # the next drafts' features (the estimator's inputs) ride along
            out[:r, q + 1:].copy_(packed[:r, self.block:])
        return out

    def _step(self, count: int, b: int) -> torch.Tensor:
        """A chained step of graph size b: the verify rows from the static drafts, the
        forward, the acceptance and the next drafts."""
        g, d = self.verify[count], self.draft.buf
        # the draft graph's rows (a wider verify graph's rows past them keep the padding of
        # the host's fill at the chain's start)
        g.fill_device(d["anchors"][:b], d["start"][:b], self.drafts[:b], self.live)
        return self.accept(g.forward_body(b), count, b, replay_draft=False)

    def replay(self, r: int, count: int) -> torch.Tensor:
        """The chained step of r live-or-padding rows (the chain's first r) -> out [r, ...]."""
        b = self.verify[count].size_for(r)
        if not self.capture:
            return self._step(count, b)[:r]
        self.graphs[b, count].replay()
        return self.out[count][:r]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Every (size, count), largest first, over padding rows only (live 0: they write
        scratch slots), warmed up twice on the capture stream first."""
        self.live.zero_()
        self.draft.buf["start"].fill_(self.draft.pad_start)
        stream = torch.cuda.Stream(self.device)
        now = torch.cuda.current_stream(self.device)
        for count, g in self.verify.items():
            g.pad_all()
            for b in sorted(g.sizes, reverse=True):
                stream.wait_stream(now)
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._step(count, b)
                now.wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=g.pool, stream=stream):
                    self._step(count, b)
                self.graphs[b, count] = graph
        torch.cuda.synchronize(self.device)
        self.live.fill_(1)
