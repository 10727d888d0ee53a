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

`rows` (the engine's batch-invariant mode): every step, of any batch and any draft count, runs
exactly that many rows (the rest padding), so every kernel sees one shape and picks one launch
shape, one split of the attention's keys, one GEMM algorithm: a row's logits then depend on
that row's inputs alone.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import BeamConfig
from .host_buffers import HostTable, Staging
from .model import BeamModel, StepInputs
from .plan import BuildOptions, KVPlan, cdiv
from .request import Chunk


class DecodeGraphs:
    def __init__(self, model: BeamModel, options: BuildOptions, kv_plan: KVPlan, cfg: BeamConfig,
                 device: torch.device, capture: bool = True, sizes: tuple[int, ...] | None = None,
                 capture_layers: tuple[int, ...] = (), ring_len: int | None = None,
                 tokens_per_seq: int = 1, after=None, rows: int | None = None):
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
        if rows is not None and rows < self.max_batch * q:
            raise ValueError(f"rows={rows} < {self.max_batch} sequences x {q} tokens")
        self.fixed_rows = rows

        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        # every row is a one-token sequence (a verify chunk's rows too, batch.py)
        n = self.rows_of(self.max_batch)
        self.buf = {
            "input_ids": zeros(n, dtype=torch.int64), "positions": zeros(n, dtype=torch.int64),
            "q_start": zeros(n), "hist_sliding": zeros(n), "block_table": zeros(n, self.width),
            "ring_index": zeros(n, 1), "slot_full": zeros(n, dtype=torch.int64),
            "slot_sliding": zeros(n, dtype=torch.int64),
        }
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hist_full = zeros(n)
        self.empty = zeros(0, dtype=torch.int64)
        self._row_maps: dict[tuple[int, int], torch.Tensor] = {}  # take_rows
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.stage = self.table = self.index = None  # host staging (host_buffers.py)
        self.capture, self.pool = capture, None  # (the graphs' memory pool: chain_graphs.py)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        if capture:
            self._capture_all()

    def _forward(self, s: StepInputs):
        out = self.model.forward(s, self.capture_layers)
        if self.after is None or not self.capture_layers:
            return out
        self.after(out[1], s.positions, s.slot_full)
        return out[0], None

    def rows_of(self, b: int) -> int:
        """Rows of a step replaying size b: b sequences x q tokens, or the fixed count."""
        return self.fixed_rows or b * self.q

    def inputs(self, b: int) -> StepInputs:
        n = self.rows_of(b)
        v = {k: t[:n] for k, t in self.buf.items()}
        return StepInputs(cu_seqlens=self.cu_seqlens[:n + 1], hist_full=self.hist_full[:n],
                          write_rows=self.empty, write_slots=self.empty, restore_rows=self.empty,
                          restore_slots=self.empty, logits_rows=self.rows[:n], **v)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self.pad_all()  # every row is padding while capturing
        pool = self.pool = torch.cuda.graph_pool_handle()
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

    def forward_body(self, b: int) -> torch.Tensor:
        """Size b's forward as its graph captured it, run (or captured) in place -> the logits
        of every row (a capture that contains the whole step, chain_graphs.py)."""
        out = self._forward(self.inputs(b))
        return out[0] if self.capture_layers else out

    def take_rows(self, src: "DecodeGraphs", b: int) -> None:
        """The block tables, rings and sliding starts of b sequences from another verify
        graph's rows (src: those sequences in the same order, another q), on the device: a
        chain's other draft counts (spec_chain.py; a host fill each cost ~0.2 ms there)."""
        n, key = b * self.q, (src.q, b)
        if key not in self._row_maps:
            self._row_maps[key] = torch.arange(n, device=self.device) // self.q * src.q
        for name in ("block_table", "ring_index", "hist_sliding"):
            torch.index_select(src.buf[name], 0, self._row_maps[key], out=self.buf[name][:n])

    def pad_all(self) -> None:
        """Every row of the static buffers a padding row."""
        self._fill([])

    def _fill(self, chunks: list[Chunk], b: int | None = None) -> None:
        """The static buffers' first b * q rows: the chunks' rows, then padding (host_buffers.py:
        filled in pinned host memory, one non-blocking copy per buffer)."""
        if self.stage is None:
            self.stage = Staging(self.buf, self.device)
            self.table = HostTable(self.stage.host["block_table"])
        stage, q = self.stage, self.q
        n = self.rows_of(b or self.max_batch)
        stage.wait()
        h = stage.np
        for k in ("input_ids", "positions", "q_start", "hist_sliding"):
            h[k][:n] = 0
        h["ring_index"][:n] = self.scratch_row
        h["slot_full"][:n] = -1
        h["slot_sliding"][:n] = -1
        if q == 1 and all(c.n == 1 for c in chunks):  # plain decode: one list a buffer
            self._fill_decode(chunks, h)
        else:
            self._fill_rows(chunks, h)
        stage.copy(n)

    def _fill_rows(self, chunks: list[Chunk], h: dict) -> None:
        """`_fill`'s rows, a sequence's q rows at a time (verify steps, padded sequences)."""
        bs, ring, q = self.block_size, self.window, self.q
        for i, c in enumerate(chunks):
            req, p, tokens = c.request, c.start, c.token_ids
            lo, m = i * q, len(tokens)  # rows past m pad the sequence: they write nothing
            h["input_ids"][lo:lo + m] = tokens
            h["positions"][lo:lo + q] = np.arange(p, p + q)
            h["q_start"][lo:lo + q] = h["positions"][lo:lo + q]
            h["hist_sliding"][lo:lo + q] = req.hist_start
            h["ring_index"][lo:lo + q] = req.ring_row
            blocks = req.block_ids
            h["slot_full"][lo:lo + m] = [blocks[x // bs] * bs + x % bs for x in range(p, p + m)]
            h["slot_sliding"][lo:lo + m] = [req.ring_row * ring + x % ring for x in range(p, p + m)]
            self.table.set(lo, req, q)  # a sequence's rows share its table

    def _fill_decode(self, chunks: list[Chunk], h: dict) -> None:
        """`_fill`'s rows for one token a sequence, each buffer written once from a list (the
        row-by-row slices cost ~12 us a sequence of host time at batch 32)."""
        bs, ring, m = self.block_size, self.window, len(chunks)
        reqs = [c.request for c in chunks]
        pos = [c.start for c in chunks]
        h["input_ids"][:m] = [c.token_ids[0] for c in chunks]
        h["positions"][:m] = pos
        h["q_start"][:m] = pos
        h["hist_sliding"][:m] = [r.hist_start for r in reqs]
        h["ring_index"][:m, 0] = [r.ring_row for r in reqs]
        h["slot_full"][:m] = [r.block_ids[p // bs] * bs + p % bs for r, p in zip(reqs, pos)]
        h["slot_sliding"][:m] = [r.ring_row * ring + p % ring for r, p in zip(reqs, pos)]
        for i, r in enumerate(reqs):
            self.table.set(i, r)

    def fill_device(self, anchors: torch.Tensor, start: torch.Tensor, drafts: torch.Tensor,
                    live: torch.Tensor) -> None:
        """The first B * q rows from device tensors (a chained verify step, spec_chain.py):
        each sequence's known token anchors [B] at position start [B], then its q - 1 drafts
        (drafts [B, >= q - 1]); a sequence whose live[b] is 0 (its request ended) gets padding
        rows. What `_fill_rows` writes for full verify chunks, in one launch
        (beam::verify_rows); the rows' block tables, rings and sliding starts stay as the last
        host fill left them (the same requests, in the same rows, blocks allocated ahead)."""
        buf = self.buf
        torch.ops.beam.verify_rows(anchors, start, drafts, live, buf["block_table"],
                                   buf["ring_index"],
                                   buf["input_ids"], buf["positions"], buf["q_start"],
                                   buf["slot_full"], buf["slot_sliding"], self.q,
                                   self.block_size, self.window)

    def replay(self, b: int):
        """Size b's forward over the buffers as they are (captured: a replay) -> (the logits
        of every row, the captured target states or None); on CUDA the graph's static
        outputs, which the next replay overwrites."""
        if self.capture:
            graph, out = self.graphs[b]
            graph.replay()
        else:
            out = self._forward(self.inputs(b))
        return out if self.capture_layers else (out, None)

    def replay_padding(self, b: int) -> None:
        """Replay the graph a step of b sequences replays, over padding rows only (they touch
        no live cache): its cost."""
        b = self.size_for(b)
        self._fill([], b)
        self.graphs[b][0].replay()

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def run(self, chunks: list[Chunk], input_ids: torch.Tensor | None = None):
        """(logits of the sampling rows: one per decode chunk, 1 + len(drafts) per verify
        chunk, in chunk order; the captured target states [sum of c.n, n * H] or None).
        `input_ids` [len(chunks)]: the decode chunks' tokens, on the device (pending chunks)."""
        b = self.size_for(len(chunks))
        self._fill(chunks, b)
        if input_ids is not None:  # (after the fill's copy: stream order keeps these)
            self.buf["input_ids"][:len(chunks)].copy_(input_ids)
        logits, hidden = self.replay(b)
        if self.q == 1:
            n = len(chunks)
            keep = [i for i, c in enumerate(chunks) if c.samples]
            return self._take(logits, keep), (hidden[:n] if hidden is not None else None)
        keep = [i * self.q + t for i, c in enumerate(chunks) if c.samples
                for t in range(c.n - len(c.drafts) - 1, c.n)]
        if hidden is not None:
            hidden = self._take(hidden, [i * self.q + t for i, c in enumerate(chunks)
                                         for t in range(c.n)])
        return self._take(logits, keep), hidden

    def _take(self, t: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """t's rows `rows`: a view when they are 0..k-1 (every sequence verified all q rows),
        else an index_select through a pinned index buffer (no synchronizing copy)."""
        if rows == list(range(len(rows))):
            return t[:len(rows)]
        if self.index is None:
            self.index = Staging({"rows": torch.zeros(self.max_batch * self.q, dtype=torch.int64,
                                                      device=self.device)}, self.device)
        self.index.wait()
        self.index.np["rows"][:len(rows)] = rows
        self.index.copy(len(rows))
        return t.index_select(0, self.index.dev["rows"][:len(rows)])
