"""Overlapped decode steps: the next step's forward is launched before this step's tokens
reach the host.

A plain decode step spends host time after the GPU finishes (tokens to the host, stop checks,
outputs, scheduling, the next step's inputs) while the GPU waits; at batch 1 and 1M tokens of
context that was a fifth of the step (docs/BENCHMARKS.md, long context). When every running
request is a plain decode whose next token cannot end it by length, the engine samples on the
device, copies the tokens to pinned host memory behind an event, and launches the next step
with those device tokens as its input ids (`Chunk.pending`) before it waits for them; then it
applies the stop conditions. A request that stops there has one more step in flight: its
token is dropped when that step lands. The GPU runs steps back to back while the host works.

What runs overlapped: greedy and sampled rows (seeded or not), stop tokens and strings,
length limits, grammars. A step with grammar rows launches its forward only: its tokens are
sampled once the step before has landed and its tokens' matchers have filled the next masks,
so that host work (xgrammar holds the GIL while it fills) runs beside the forward. What runs
as before, one step at a time: prefill chunks, waiting requests, speculative decoding,
penalties and logit bias, logprobs, handoffs, parallel ranks (speculative steps chain on
the device by their own rules: spec_chain.py).
The tokens are those of the step-by-step engine (the same kernels, inputs and random draws,
in the same order; tests/test_overlap.py). Blocks a finished request held may still be written
by its last in-flight step: that write is ordered before any later step's on the stream, and
`kv_reserve` (whose blocks a transport fills from outside the stream) waits for it first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Chunk, Request, State
from .sampler import sample_on_device
from .types import RequestOutput


@dataclass
class InFlight:
    """A launched step whose tokens have not reached the host."""

    chunks: list[Chunk]
    tokens: torch.Tensor                 # [B] int64 on the device (the next step's input ids)
    host: torch.Tensor                   # [B] int64, pinned on CUDA: filled when `ready` fires
    ready: torch.cuda.Event | None


class OverlapMixin:
    def _init_overlap(self, enabled: bool | None) -> None:
        """enabled: None = on CUDA, off on the CPU (nothing to overlap there)."""
        self.overlap = self.device.type == "cuda" if enabled is None else bool(enabled)
        self._inflight: InFlight | None = None
        self._token_bufs = [torch.zeros(self.options.max_batch, dtype=torch.int64,
                                        pin_memory=self.device.type == "cuda") for _ in range(2)]
        self._next_buf = 0
        self.stats["overlapped_steps"] = 0

    def _can_overlap(self, req: Request) -> bool:
        """The request's next step can be launched before its current token is known."""
        p = req.sampling
        return (req.state == State.RUNNING and not req.prefill_only and req.pending_first is None
                and not p.penalized and not p.logit_bias
                and p.logprobs is None and len(req.output_ids) + 1 < p.max_tokens
                and req.num_tokens + 1 < req.max_total)

    def _overlappable(self, chunks: list[Chunk]) -> bool:
        """A scheduled step the overlapped path may run: plain decode, every request eligible."""
        return (self.overlap and self.spec is None and self.parallel is None
                and all(c.n == 1 and not c.drafts and c.samples and c.start >= c.request.full_cached
                        and self._can_overlap(c.request) for c in chunks))

    def _next_chunks(self, current: InFlight) -> list[Chunk] | None:
        """The step after `current` for the same requests, or None where it must wait for the
        host: new requests to admit, a request about to end by length, no block for it."""
        sched = self.scheduler
        reqs = [c.request for c in current.chunks]
        if (sched.waiting or len(reqs) != len(sched.running)
                or not all(self._can_overlap(r) for r in reqs)):
            return None
        # the current token lands at position num_tokens; the next step writes its KV there
        if not all(sched.ensure_blocks(r, r.num_tokens + 1) for r in reqs):
            return None
        return [Chunk(r, r.num_tokens, 1, pending=True) for r in reqs]

    def _launch(self, chunks: list[Chunk], input_ids: torch.Tensor | None = None) -> InFlight:
        """Forward and device-side sampling of a step; its tokens start for the host."""
        logits = self._forward(chunks, input_ids)[0]
        return self._sample_launched(chunks, logits, 1 if input_ids is not None else 0)

    def _sample_launched(self, chunks: list[Chunk], logits: torch.Tensor, ahead: int) -> InFlight:
        """Device-side sampling of a launched forward (grammar rows masked by their matchers'
        current state); `ahead`: 1 where the token before is not appended yet."""
        reqs = [c.request for c in chunks]
        rows = [b for b, r in enumerate(reqs)
                if r.sampling.structural_tag and r.state == State.RUNNING]
        bitmask, index = self._grammar_masks(reqs, rows) if rows else (None, None)
        tokens, _ = sample_on_device(logits, [r.sampling for r in reqs],
                                     [len(r.output_ids) + ahead for r in reqs], self.generator,
                                     bitmask=bitmask, mask_rows=rows, mask_index=index)
        host = self._token_bufs[self._next_buf][:len(chunks)]
        self._next_buf ^= 1
        ready = None
        if self.device.type == "cuda":
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host.copy_(tokens)
        return InFlight(chunks, tokens, host, ready)

    def _overlapped_step(self, chunks: list[Chunk] | None) -> list[RequestOutput]:
        """Launch `chunks` (None: a step is in flight already), launch the one after it where
        it can be, then land the first: its tokens, stop conditions, outputs."""
        current = self._inflight if chunks is None else self._launch(chunks)
        after = self._next_chunks(current)
        self._inflight = None
        masked = after is not None and any(c.request.sampling.structural_tag for c in after)
        if after:
            logits = self._forward(after, current.tokens)[0]
            if not masked:
                self._inflight = self._sample_launched(after, logits, 1)
            self.stats["overlapped_steps"] += 1
        outputs = self._land(current)
        if masked:  # its matchers have taken the landed tokens: the masks, then the sampling
            self._inflight = self._sample_launched(after, logits, 0)
        if self._inflight is not None and not any(
                c.request.state == State.RUNNING for c in self._inflight.chunks):
            self._inflight = None  # every request it computes for has ended
        return outputs

    def _land(self, step: InFlight) -> list[RequestOutput]:
        if step.ready is not None:
            step.ready.synchronize()
        landed = []
        for c, token in zip(step.chunks, step.host.tolist()):
            req = c.request
            if req.state != State.RUNNING:  # ended (a stop, an abort) while this step ran
                continue
            self.scheduler.commit(c)
            req.output_ids.append(token)
            landed.append((req, token))
        self.stats["generated_tokens"] += len(landed)
        return self._emit_tokens([r for r, _ in landed], [t for _, t in landed])

    def _quiesce(self) -> None:
        """Wait for an in-flight step's GPU work (before blocks are handed to a transport)."""
        busy = self._inflight is not None or self._chain is not None
        if busy and self.device.type == "cuda":  # (a chained speculative step too)
            torch.cuda.current_stream(self.device).synchronize()
