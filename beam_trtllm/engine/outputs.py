"""What happens after a forward: commit the chunks, sample, apply stop conditions, emit
`RequestOutput`s (the part of `Engine` between the model and the caller)."""

from __future__ import annotations

from .detok import IncrementalDetokenizer
from .request import Request, State
from .sampler import sample
from .types import EngineError, RequestOutput


class OutputMixin:
    def _detokenizer(self, req: Request):
        if self.tokenizer is None:
            if req.sampling.stop:
                raise EngineError(f"request {req.request_id!r}: stop strings need a tokenizer, "
                                  "and this engine has none")
            return None
        return IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.sampling.stop)

    def _after_forward(self, chunks, logits) -> list[RequestOutput]:
        sampled = []
        for c in chunks:
            self.scheduler.commit(c)
            req = c.request
            restored = max(0, min(c.start + c.n, req.full_cached) - c.start)
            self.stats["restored_tokens"] += restored
            self.stats["prompt_tokens"] += max(0, min(c.start + c.n, len(req.prompt_ids)) -
                                               max(c.start, req.full_cached))
            if c.samples:
                sampled.append(req)
        if not sampled:
            return []
        params = [r.sampling for r in sampled]
        tokens, logprobs = sample(logits, params, [len(r.output_ids) for r in sampled],
                                  self.generator)
        outputs = []
        for req, token, lp in zip(sampled, tokens, logprobs):
            req.output_ids.append(token)
            self.stats["generated_tokens"] += 1
            outputs.append(self._token_output(req, token, lp))
        return outputs

    def _token_output(self, req: Request, token: int, lp) -> RequestOutput:
        text = req.detok.add([token]) if req.detok is not None else ""
        out = RequestOutput(req.request_id, [token], text=text,
                            logprobs=[lp] if lp is not None else None,
                            num_prompt_tokens=len(req.prompt_ids),
                            num_cached_tokens=req.num_cached_tokens)
        reason = self._stop_reason(req, token)
        if reason is not None:
            if req.detok is not None:
                out.text += req.detok.finish()
            self._finish(req, reason, emit=False)
            out.finished, out.finish_reason = True, reason
        return out

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.sampling
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if req.detok is not None and req.detok.stopped:
            return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= req.max_total:
            return "length"
        if req.prefill_only:
            return "length"
        return None

    def _finish(self, req: Request, reason: str, emit: bool = True) -> None:
        keep = req.prefill_only and reason != "abort"
        self.scheduler.finish(req, keep_kv=keep)
        req.finish_reason = reason
        if not keep:
            self.requests.pop(req.request_id, None)
        if emit:
            text = req.detok.finish() if req.detok is not None else ""
            self._pending_outputs.append(RequestOutput(
                req.request_id, [], finished=True, finish_reason=reason, text=text,
                num_prompt_tokens=len(req.prompt_ids), num_cached_tokens=req.num_cached_tokens))

    def _emit_handoff_tokens(self) -> list[RequestOutput]:
        """Decode side of a handoff: the prefill engine's first token is emitted first."""
        outputs = []
        for req in list(self.scheduler.running):
            if req.pending_first is None or req.state != State.RUNNING:
                continue
            token, req.pending_first = req.pending_first, None
            outputs.append(self._token_output(req, token, None))
        return outputs
