"""CUDA graphs for decode steps (and, with speculative decoding, verify steps).

A decode step (every sequence feeds one token) is captured once per batch size in
`cuda_graph_batch_sizes` (largest first, one shared memory pool), over static input buffers
sized for `max_batch`. A step with n sequences replays the smallest captured size b >= n; the
b - n padding rows feed token 0 at position 0 with no cache reads (q_start 0), write nowhere
(slot -1) and point their ring at the KV cache's scratch row, so they cannot disturb a live
sequence; their logits are dropped. The block table is `max_seq_len / block_size` wide so
any sequence fits. Graph replay removes the CPU launch cost of the ~10 kernels per layer,
which at batch 1 would otherwise exceed the GPU time of a MoE layer.

A verify step (`tokens_per_seq` q = 1 + the draft tokens) feeds q tokens per sequence, each
row attending as a one-token sequence at its own position (batch.py: what a decode step
there computes): a sequence with fewer drafts is padded at its end with rows that write no
cache (slot -1) and whose logits are dropped, so one graph per batch size serves any mix of
draft counts.

With `capture=False` the same buffers and padding run eagerly; the CPU tests use that to
check the padding rules bit for bit against the unpadded step.
"""

from __future__ import annotations

import torch

from ..config import BeamConfig
from .model import BeamModel, StepInputs
from .plan import BuildOptions, KVPlan, cdiv
from .request import Chunk


class DecodeGraphs:
    def __init__(self, model: BeamModel, options: BuildOptions, kv_plan: KVPlan, cfg: BeamConfig,
                 device: torch.device, capture: bool = True, sizes: tuple[int, ...] | None = None,
                 capture_layers: tuple[int, ...] = (), ring_len: int | None = None,
                 tokens_per_seq: int = 1, after=None):
        self.model, self.cfg, self.device = model, cfg, device
        self.block_size, self.window = kv_plan.block_size, ring_len or cfg.sliding_window
        self.capture_layers = capture_layers  # a drafter's target layers: their states too
        # after(hidden, positions, slots): device work on the captured states inside the graph
        # (the drafter's context K/V, speculative.py); run() then returns no states
        self.after = after
        self.sizes = tuple(sorted(sizes or options.cuda_graph_batch_sizes))
        self.max_batch = self.sizes[-1]
        self.width = cdiv(options.max_seq_len, kv_plan.block_size)
        self.scratch_row = kv_plan.max_seqs
        self.q = q = tokens_per_seq
        b = self.max_batch

        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        n = b * q  # every row is a one-token sequence (a verify chunk's rows too, batch.py)
        self.buf = {
            "input_ids": zeros(n, dtype=torch.int64), "positions": zeros(n, dtype=torch.int64),
            "q_start": zeros(n), "hist_sliding": zeros(n), "block_table": zeros(n, self.width),
            "ring_index": zeros(n, 1), "slot_full": zeros(n, dtype=torch.int64),
            "slot_sliding": zeros(n, dtype=torch.int64),
        }
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hist_full = zeros(n)
        self.empty = zeros(0, dtype=torch.int64)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.capture = capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        if capture:
            self._capture_all()

    def _forward(self, s: StepInputs):
        out = self.model.forward(s, self.capture_layers)
        if self.after is None or not self.capture_layers:
            return out
        self.after(out[1], s.positions, s.slot_full)
        return out[0], None

    def inputs(self, b: int) -> StepInputs:
        n = b * self.q
        v = {k: t[:n] for k, t in self.buf.items()}
        return StepInputs(cu_seqlens=self.cu_seqlens[:n + 1], hist_full=self.hist_full[:n],
                          write_rows=self.empty, write_slots=self.empty, restore_rows=self.empty,
                          restore_slots=self.empty, logits_rows=self.rows[:n], **v)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self._fill([])  # every row is padding while capturing
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for b in sorted(self.sizes, reverse=True):
            inputs = self.inputs(b)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile/autotune the kernels outside the capture
                    self._forward(inputs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):  # (the warm-up's stream:
                # per-stream buffers such as the MoE ops' counters exist for it already)
                out = self._forward(inputs)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)

    def _fill(self, chunks: list[Chunk]) -> None:
        bs, ring, q = self.block_size, self.window, self.q
        host = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in self.buf.items()
                if k != "block_table"}
        host["block_table"] = self._host_table(chunks)
        host["ring_index"][:] = self.scratch_row
        host["slot_full"][:] = -1
        host["slot_sliding"][:] = -1
        for i, c in enumerate(chunks):
            req, p = c.request, c.start
            tokens = c.token_ids
            rows = slice(i * q, (i + 1) * q)
            host["input_ids"][i * q:i * q + len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            host["positions"][rows] = torch.arange(p, p + q)
            host["q_start"][rows] = torch.arange(p, p + q, dtype=torch.int32)
            host["hist_sliding"][rows] = req.hist_start
            host["ring_index"][rows] = req.ring_row
            for t, pos in enumerate(range(p, p + len(tokens))):  # padding rows write nothing
                host["slot_full"][i * q + t] = req.block_ids[pos // bs] * bs + pos % bs
                host["slot_sliding"][i * q + t] = req.ring_row * ring + pos % ring
        for k, t in self.buf.items():
            t.copy_(host[k], non_blocking=True)

    def _host_table(self, chunks: list[Chunk]) -> torch.Tensor:
        """The block table on the host, a row rewritten only when its request or block count
        changed (a 1M-token sequence's table is 32K entries: rebuilding it every step cost
        more than the step's GPU time). Padded rows read no cache, whatever their row holds."""
        if not hasattr(self, "_table"):
            self._table = torch.zeros(self.buf["block_table"].shape, dtype=torch.int32)
            self._rows: list = [(None, -1, 0)] * self._table.shape[0]  # (request, preemptions, len)
        for i, c in enumerate(chunks):
            req, n = c.request, len(c.request.block_ids)
            for row in range(i * self.q, (i + 1) * self.q):  # a sequence's rows share its table
                held, preempts, have = self._rows[row]
                lo = have if held is req and preempts == req.num_preemptions and have <= n else 0
                if lo == 0 and held is not None:  # another request (or its blocks were dropped)
                    self._table[row].zero_()
                if lo < n:  # a request's blocks only grow while it runs: write the new ones
                    self._table[row, lo:n] = torch.tensor(req.block_ids[lo:], dtype=torch.int32)
                self._rows[row] = (req, req.num_preemptions, n)
        return self._table

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def run(self, chunks: list[Chunk]):
        """(logits of the sampling rows: one per decode chunk, 1 + len(drafts) per verify
        chunk, in chunk order; the captured target states [sum of c.n, n * H] or None)."""
        b = self.size_for(len(chunks))
        self._fill(chunks)
        if self.capture:
            graph, out = self.graphs[b]
            graph.replay()
        else:
            out = self._forward(self.inputs(b))
        logits, hidden = out if self.capture_layers else (out, None)
        if self.q == 1:
            n = len(chunks)
            keep = [i for i, c in enumerate(chunks) if c.samples]
            return (logits[:n][keep] if len(keep) < n else logits[:n]), \
                (hidden[:n] if hidden is not None else None)
        keep = torch.tensor([i * self.q + t for i, c in enumerate(chunks) if c.samples
                             for t in range(c.n - len(c.drafts) - 1, c.n)],
                            dtype=torch.int64, device=logits.device)
        if hidden is not None:
            rows = [i * self.q + t for i, c in enumerate(chunks) for t in range(c.n)]
            hidden = hidden.index_select(0, torch.tensor(rows, dtype=torch.int64,
                                                         device=logits.device))
        return logits.index_select(0, keep), hidden
