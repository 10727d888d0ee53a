"""CUDA graphs for decode steps.

A decode step (every sequence feeds one token) is captured once per batch size in
`cuda_graph_batch_sizes` (largest first, one shared memory pool), over static input buffers
sized for `max_batch`. A step with n sequences replays the smallest captured size b >= n; the
b - n padding rows feed token 0 at position 0 with no cache reads (q_start 0), write nowhere
(slot -1) and point their ring at the KV cache's scratch row, so they cannot disturb a live
sequence; their logits are dropped. The block table is `max_seq_len / block_size` wide so
any sequence fits. Graph replay removes the CPU launch cost of the ~10 kernels per layer,
which at batch 1 would otherwise exceed the GPU time of a MoE layer.

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
                 device: torch.device, capture: bool = True, sizes: tuple[int, ...] | None = None):
        self.model, self.cfg, self.device = model, cfg, device
        self.block_size, self.window = kv_plan.block_size, cfg.sliding_window
        self.sizes = tuple(sorted(sizes or options.cuda_graph_batch_sizes))
        self.max_batch = self.sizes[-1]
        self.width = cdiv(options.max_seq_len, kv_plan.block_size)
        self.scratch_row = kv_plan.max_seqs
        b = self.max_batch

        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.buf = {
            "input_ids": zeros(b, dtype=torch.int64), "positions": zeros(b, dtype=torch.int64),
            "q_start": zeros(b), "hist_sliding": zeros(b), "block_table": zeros(b, self.width),
            "ring_index": zeros(b, 1), "slot_full": zeros(b, dtype=torch.int64),
            "slot_sliding": zeros(b, dtype=torch.int64),
        }
        self.cu_seqlens = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.hist_full = zeros(b)
        self.empty = zeros(0, dtype=torch.int64)
        self.rows = torch.arange(b, dtype=torch.int64, device=device)
        self.capture = capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        if capture:
            self._capture_all()

    def inputs(self, b: int) -> StepInputs:
        v = {k: t[:b] for k, t in self.buf.items()}
        return StepInputs(cu_seqlens=self.cu_seqlens[:b + 1], hist_full=self.hist_full[:b],
                          write_rows=self.empty, write_slots=self.empty, restore_rows=self.empty,
                          restore_slots=self.empty, logits_rows=self.rows[:b], **v)

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
                    self.model.forward(inputs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):  # (the warm-up's stream:
                # per-stream buffers such as the MoE ops' counters exist for it already)
                out = self.model.forward(inputs)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)

    def _fill(self, chunks: list[Chunk]) -> None:
        bs, w = self.block_size, self.window
        host = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in self.buf.items()}
        host["ring_index"][:] = self.scratch_row
        host["slot_full"][:] = -1
        host["slot_sliding"][:] = -1
        for i, c in enumerate(chunks):
            req, p = c.request, c.start
            host["input_ids"][i] = req.all_ids[p]
            host["positions"][i] = p
            host["q_start"][i] = p
            host["hist_sliding"][i] = req.hist_start
            host["block_table"][i, :len(req.block_ids)] = torch.tensor(req.block_ids, dtype=torch.int32)
            host["ring_index"][i] = req.ring_row
            host["slot_full"][i] = req.block_ids[p // bs] * bs + p % bs
            host["slot_sliding"][i] = req.ring_row * w + p % w
        for k, t in self.buf.items():
            t.copy_(host[k], non_blocking=True)

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def run(self, chunks: list[Chunk]) -> torch.Tensor:
        """Logits [S, V] of the chunks that sample (all of them in a pure decode step)."""
        b = self.size_for(len(chunks))
        self._fill(chunks)
        if self.capture:
            graph, out = self.graphs[b]
            graph.replay()
        else:
            out = self.model.forward(self.inputs(b))
        keep = [i for i, c in enumerate(chunks) if c.samples]
        return out[:len(chunks)][keep] if len(keep) < len(chunks) else out[:len(chunks)]
