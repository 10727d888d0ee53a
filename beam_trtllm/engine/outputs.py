"""What happens after a forward: commit the chunks, sample (grammar masks filled for the
constrained rows), apply stop conditions, emit `RequestOutput`s (the part of `Engine` between
the model and the caller).

A constrained step's host work is kept off the GPU's critical path: the masks are filled after
the forward is launched (while the GPU runs it) in one call for the batch, into a host buffer
reused every step that reaches the GPU without a synchronizing copy; the rows are masked in
place; the sampled tokens are accepted in one call.
"""

from __future__ import annotations

import torch

from .detok import IncrementalDetokenizer
from .request import Request, State
from .sampler import BitmaskBuffers, sample, token_logprobs
from .types import EngineError, RequestOutput


class OutputMixin:
    def _detokenizer(self, req: Request):
        if self.tokenizer is None:
            if req.sampling.stop:
                raise EngineError(f"request {req.request_id!r}: stop strings need a tokenizer, "
                                  "and this engine has none")
            return None
        return IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.sampling.stop)

    def _after_forward(self, chunks, logits, hidden=None, slots=None) -> list[RequestOutput]:
        """Commit, sample (verify the drafts of verify chunks), emit; then the drafter's
        context K/V and its next drafts (speculative.py)."""
        sampled, verify, rows, row = [], [], [], 0
        anchors = [c.request for c in chunks if c.samples]  # (before the new tokens land)
        for i, c in enumerate(chunks):
            req = c.request
            restored = max(0, min(c.start + c.n, req.full_cached) - c.start)
            self.stats["restored_tokens"] += restored
            self.stats["prompt_tokens"] += max(0, min(c.start + c.n, len(req.prompt_ids)) -
                                               max(c.start, req.full_cached))
            if c.drafts:  # committed once verified
                verify.append(i)
                rows.append(logits[row:row + len(c.drafts) + 1])
                row += len(c.drafts) + 1
                continue
            self.scheduler.commit(c)
            if c.samples:
                sampled.append((req, row))
                row += 1
        outputs = self._sample_rows(sampled, logits) if sampled else []
        if verify:
            self._verify(chunks, verify, rows, outputs)
        if self.spec is not None:
            if hidden is not None:  # (a CUDA-graph step wrote it inside the graph: None)
                self.spec.write_context(chunks, hidden, slots)
            self.spec.propose(anchors)
        return outputs

    def _sample_rows(self, sampled, logits) -> list[RequestOutput]:
        """sampled: (request, its row of `logits`). Without verify chunks the rows are all of
        `logits` in order, which is used as it is (no copy of a [B, V] tensor per step)."""
        reqs = [r for r, _ in sampled]
        picked = [i for _, i in sampled]
        if picked != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(picked, device=logits.device))
        params = [r.sampling for r in reqs]
        histories = ([(r.prompt_ids, r.output_ids) for r in reqs]
                     if any(p.penalized for p in params) else None)
        rows = [b for b, p in enumerate(params) if p.structural_tag]
        masks = self._grammar_masks(reqs, rows) if rows else (None, None)
        tokens, logprobs = sample(logits, params, [len(r.output_ids) for r in reqs],
                                  self.generator, histories, masks[0], rows, masks[1])
        for req, token in zip(reqs, tokens):
            req.output_ids.append(token)
        self.stats["generated_tokens"] += len(reqs)
        return self._emit_tokens(reqs, tokens, logprobs)

    def _emit_tokens(self, reqs: list[Request], tokens: list[int], logprobs=None):
        """The outputs of tokens just appended, one per request: the constrained rows'
        matchers accept theirs in one batch first."""
        rows = [b for b, r in enumerate(reqs) if r.sampling.structural_tag]
        verdicts = self._accept_rows(reqs, tokens, rows) if rows else {}
        lps = logprobs if logprobs is not None else [None] * len(reqs)
        return [self._token_output(r, t, lp, verdicts.get(b))
                for b, (r, t, lp) in enumerate(zip(reqs, tokens, lps))]

    def _verify(self, chunks, verify: list[int], rows, outputs) -> None:
        """Accept drafts, emit the accepted tokens and the correction / bonus one by one
        (stop conditions apply per token); commit the KV of what was kept."""
        vchunks = [chunks[i] for i in verify]
        res = self.spec.verify(vchunks, rows, [len(c.request.output_ids) for c in vchunks])
        for c, lg, n_acc, tokens in zip(vchunks, rows, res.num_accepted, res.tokens):
            self._emit_verified(c, tokens, n_acc, lg, outputs)

    def _emit_verified(self, c, tokens: list[int], n_acc: int, lg, outputs: list) -> None:
        """A verify chunk's kept tokens (`lg`: its logits rows, for logprobs) into `outputs`;
        its KV committed where the request goes on (also chained steps', spec_chain.py)."""
        req = c.request
        want = req.sampling.logprobs
        lps = lg.float().log_softmax(-1) if want is not None else None
        if req.sampling.stop:  # stop strings: token by token, so one can end it anywhere
            for j, token in enumerate(tokens):
                req.output_ids.append(token)
                self.stats["generated_tokens"] += 1
                lp = None if lps is None else token_logprobs(lps[j], token, want)
                out = self._token_output(req, token, lp)
                outputs.append(out)
                if out.finished:
                    break
        else:
            outputs.append(self._tokens_output(req, tokens, lps, want))
        if req.state == State.RUNNING:
            self.scheduler.commit(c, n_acc)

    def _tokens_output(self, req: Request, tokens: list[int], lps, want) -> RequestOutput:
        """One output for a verify step's tokens (no stop strings, no grammar: drafts are off
        for grammars), cut at the first stop token or length limit."""
        reason, kept = None, []
        for token in tokens:
            req.output_ids.append(token)
            kept.append(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                break
        self.stats["generated_tokens"] += len(kept)
        return self._output(req, kept, None if lps is None else
                            [token_logprobs(lps[j], t, want) for j, t in enumerate(kept)], reason)

    def _output(self, req: Request, tokens: list[int], logprobs, reason: str | None):
        """The RequestOutput of tokens already appended to the request; `reason` ends it."""
        text = req.detok.add(tokens) if req.detok is not None else ""
        if reason is None and req.detok is not None and req.detok.stopped:
            reason = "stop"  # these tokens completed a stop string: no step past it
        out = RequestOutput(req.request_id, tokens, text=text, logprobs=logprobs,
                            num_prompt_tokens=len(req.prompt_ids),
                            num_cached_tokens=req.num_cached_tokens)
        if reason is not None:
            if req.detok is not None:
                out.text += req.detok.finish()
            self._finish(req, reason, emit=False)
            out.finished, out.finish_reason = True, reason
        return out

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

    def _filler(self):
        filler = getattr(self, "_mask_filler", None)
        if filler is None:
            from ..chat.grammar import MaskFiller

            filler = self._mask_filler = MaskFiller()
        return filler

    def _bitmask_buffers(self, batch: int) -> BitmaskBuffers:
        """The engine's bitmask buffers, grown to `batch` rows."""
        buffers = getattr(self, "_bitmasks", None)
        if buffers is None or buffers.rows < batch:
            buffers = self._bitmasks = BitmaskBuffers(max(batch, self.options.max_batch),
                                                      self.cfg.vocab_size, self.device)
        return buffers

    def _grammar_masks(self, reqs: list[Request], rows: list[int]):
        """(bitmask on the logits' device, index of `rows` there or None) for the constrained
        rows `rows` of the step's sampled requests `reqs`."""
        buffers = self._bitmask_buffers(len(reqs))
        buffers.wait()
        self._filler().fill(buffers.host, [self._matcher(reqs[b]) for b in rows], rows)
        return buffers.to_device(len(reqs), rows)

    def _accept_rows(self, reqs: list[Request], tokens: list[int], rows: list[int]) -> dict:
        """Row -> (token accepted, grammar finished) for the constrained rows."""
        matchers = [reqs[b].grammar for b in rows]
        accepted = self._filler().accept(matchers, [tokens[b] for b in rows])
        # a matcher ends only on one of its stop tokens (the engine's eos ids)
        return {b: (ok, ok and tokens[b] in self.eos_token_ids and m.is_terminated())
                for b, m, ok in zip(rows, matchers, accepted)}

    def _token_output(self, req: Request, token: int, lp, verdict=None) -> RequestOutput:
        """`verdict`: (accepted, grammar finished) when the caller already had the request's
        matcher accept `token` (`_accept_rows`); None: accepted here."""
        matcher = self._matcher(req)
        if matcher is not None and verdict is None:
            ok = matcher.accept_token(token)
            verdict = (ok, ok and token in self.eos_token_ids and matcher.is_terminated())
        if verdict is not None and not verdict[0]:
            self._finish(req, "error", emit=False)
            return RequestOutput(req.request_id, [], finished=True, finish_reason="error",
                                 error=f"request {req.request_id!r}: token {token} is outside "
                                       "the request's grammar",
                                 num_prompt_tokens=len(req.prompt_ids))
        # a finished grammar takes no more tokens: the request ends (under ignore_eos too)
        reason = "stop" if verdict is not None and verdict[1] else self._stop_reason(req, token)
        return self._output(req, [token], [lp] if lp is not None else None, reason)

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
