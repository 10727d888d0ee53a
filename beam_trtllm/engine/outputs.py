"""What happens after a forward: commit the chunks, sample (grammar masks filled for the
constrained rows), apply stop conditions, emit `RequestOutput`s (the part of `Engine` between
the model and the caller)."""

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
        histories = ([(r.prompt_ids, r.output_ids) for r in sampled]
                     if any(p.shapes_logits for p in params) else None)
        bitmask, rows = self._grammar_masks(sampled, logits.shape[-1])
        tokens, logprobs = sample(logits, params, [len(r.output_ids) for r in sampled],
                                  self.generator, histories, bitmask, rows)
        outputs = []
        for req, token, lp in zip(sampled, tokens, logprobs):
            req.output_ids.append(token)
            self.stats["generated_tokens"] += 1
            outputs.append(self._token_output(req, token, lp))
        return outputs

    # ------------------------------------------------------------------ grammars
    def _grammar_compiler(self):
        compiler = getattr(self, "_grammars", None)
        if compiler is None:
            from ..chat.grammar import GrammarCompiler

            if self.tokenizer is None:
                raise EngineError("structured output needs the engine's tokenizer")
            # the turn grammar ends on its own closers; only these end a finished grammar
            compiler = self._grammars = GrammarCompiler(
                self.tokenizer.vocab, self.cfg.vocab_size, sorted(self.eos_token_ids))
        return compiler

    def _matcher(self, req: Request):
        if req.grammar is None and req.sampling.structural_tag:
            req.grammar = self._grammar_compiler().matcher(req.sampling.structural_tag)
        return req.grammar

    def _grammar_masks(self, reqs: list[Request], vocab: int):
        rows = [b for b, r in enumerate(reqs) if r.sampling.structural_tag]
        if not rows:
            return None, []
        import xgrammar as xgr

        matchers = [self._matcher(reqs[b]) for b in rows]
        bitmask = xgr.allocate_token_bitmask(len(reqs), vocab)
        if len(rows) > 1:
            batch = getattr(self, "_batch_matcher", None) or xgr.BatchGrammarMatcher()
            self._batch_matcher = batch
            batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        else:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        return bitmask, rows

    def _token_output(self, req: Request, token: int, lp) -> RequestOutput:
        matcher = self._matcher(req)
        if matcher is not None and not matcher.accept_token(token):
            self._finish(req, "error", emit=False)
            return RequestOutput(req.request_id, [], finished=True, finish_reason="error",
                                 error=f"request {req.request_id!r}: token {token} is outside "
                                       "the request's grammar",
                                 num_prompt_tokens=len(req.prompt_ids))
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
