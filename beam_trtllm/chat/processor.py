"""Beam's chat processor inside Dynamo's frontend: OpenAI chat request in, chat.completion
chunks out, the tokens routed through Dynamo's KV router and prefill router to the workers.

Dynamo 1.6.1's frontend renders chat templates and tokenizes in Rust (special-token strings
in user text become control tokens) and has no Beam parser; its Python hook
(`chat_engine_factory`, the one its vllm and sglang processors use) lets this module do the
pre- and post-processing instead (docs/CHAT.md "Where it runs").
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator

from dynamo.llm.exceptions import InvalidArgument, Unknown

from ..engine.detok import IncrementalDetokenizer
from ..tokenizer import TextTokenizer
from .errors import ChatRequestError
from .limits import ChatLimits
from .parser import BeamResponseParser, Delta
from .request import ChatPlan, plan_chat

log = logging.getLogger("beam.chat")


class _KeepSpecial:
    """Decoder for the detokenizer that keeps Beam's delimiters (the parser needs them)."""

    def __init__(self, tok: TextTokenizer):
        self.tok = tok

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)

    def decode_stream(self):
        return self.tok.decode_stream(skip_special_tokens=False)


class BeamChatProcessor:
    def __init__(self, model_dir: str, routed_engine, vocab_size: int, eos_token_ids: list[int],
                 limits_of=None):
        """`limits_of(vocab) -> ChatLimits`: the context limits (from the model card)."""
        self.tok = TextTokenizer(model_dir)
        self.routed = routed_engine
        self.vocab_size = vocab_size
        self.eos = eos_token_ids
        self.limits: ChatLimits | None = limits_of(self.tok.vocab) if limits_of else None
        self._grammars = None

    def _compile_check(self, tag: str) -> None:
        from .grammar import GrammarCompiler

        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tok.vocab, self.vocab_size, self.eos)
        self._grammars.compile(tag)

    async def generator(self, request: dict, context=None) -> AsyncIterator[dict]:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            # Before any cost (tokenizing) and before routing (prefill): refuse what cannot run
            if self.limits is not None:
                self.limits.check_text(request)
            plan = plan_chat(request, self.tok, self.vocab_size, self.eos, self._compile_check)
            if self.limits is not None:
                self.limits.check_prompt(rid, len(plan.prompt_ids),
                                         plan.preproc["stop_conditions"]["max_tokens"])
        except ChatRequestError as exc:
            raise InvalidArgument(str(exc)) from None
        created = int(time.time())
        choices = (self._choice(0, plan, request, context) if plan.n == 1 else
                   self._choices_at_once(plan, request, context))
        async for item in choices:
            yield {"_dynamo_annotated": True, "data": {
                "id": rid, "object": "chat.completion.chunk", "created": created,
                "model": request.get("model"), **item}}

    async def _choice(self, index, plan: ChatPlan, request, context) -> AsyncIterator[dict]:
        """One choice's chunks; a failure other than the client's reaches it as Unknown."""
        try:
            async for item in self._run_choice(index, plan, request, context):
                yield item
        except (InvalidArgument, Unknown, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - the client gets the reason, not a hang
            log.exception("chat choice %d failed", index)
            raise Unknown(f"chat request failed: {exc}") from None

    async def _choices_at_once(self, plan: ChatPlan, request, context) -> AsyncIterator[dict]:
        """n > 1: the choices run concurrently, each as its own routed request (the router keys
        a request by its context id: each gets a detached context, stopped with the client's),
        their chunks interleaved as they come (each names its choice's index)."""
        subs = [context.detached(f"{context.id()}-{i}") if context is not None else None
                for i in range(plan.n)]
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def run(i):
            try:
                async for item in self._choice(i, plan, request, subs[i]):
                    await queue.put(item)
                await queue.put(done)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer below
                await queue.put(exc)

        async def follow_client():
            await context.async_killed_or_stopped()
            for sub in subs:
                sub.stop_generating()

        tasks = [asyncio.create_task(run(i)) for i in range(plan.n)]
        watch = asyncio.create_task(follow_client()) if context is not None else None
        try:
            finished = 0
            while finished < plan.n:
                item = await queue.get()
                if item is done:
                    finished += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for sub in subs:
                if sub is not None and finished < plan.n:
                    sub.stop_generating()
            for task in tasks + ([watch] if watch else []):
                task.cancel()

    async def _run_choice(self, index, plan: ChatPlan, request, context) -> AsyncIterator[dict]:
        preproc = json.loads(json.dumps(plan.preproc))
        seed = preproc["sampling_options"].get("seed")
        if seed is not None and index:
            preproc["sampling_options"]["seed"] = int(seed) + index
        stream = await self.routed.generate(preproc, context=context)
        state = _ChoiceState(index, plan, self.tok)
        yield state.chunk({"role": "assistant", "content": ""})
        async for resp in stream:
            if resp.is_error():
                raise Unknown("; ".join(resp.comments() or []) or "worker error")
            out = resp.data()
            if not isinstance(out, dict) or "token_ids" not in out:
                continue
            for chunk in state.feed(out):
                yield chunk
            if out.get("finish_reason"):
                break
        for chunk in state.finish(request):
            yield chunk


class _ChoiceState:
    """Detokenizer + parser of one choice; turns worker outputs into OpenAI chunks."""

    def __init__(self, index: int, plan: ChatPlan, tok: TextTokenizer):
        self.index, self.plan, self.tok = index, plan, tok
        self.detok = IncrementalDetokenizer(_KeepSpecial(tok), plan.prompt_ids)
        self.parser = BeamResponseParser(plan.tools)
        self.token_ids: list[int] = []
        self.num_calls = 0
        self.finish_reason = None
        self.usage: dict = {}

    def chunk(self, delta: dict, finish_reason=None, logprobs=None) -> dict:
        choice = {"index": self.index, "delta": delta, "finish_reason": finish_reason}
        if logprobs is not None:
            choice["logprobs"] = {"content": logprobs}
        return {"choices": [choice]}

    def feed(self, out: dict) -> list[dict]:
        ids = [int(t) for t in out["token_ids"]]
        self.token_ids += ids
        if out.get("completion_usage"):
            self.usage = out["completion_usage"]
        if out.get("finish_reason"):
            self.finish_reason = out["finish_reason"]
        deltas = self.parser.feed(self.detok.add(ids))
        lps = self._logprobs(ids, out) if self.plan.logprobs is not None else None
        chunks = [self.chunk(d) for d in map(self._delta, deltas) if d]
        if lps:
            if chunks:
                chunks[0]["choices"][0]["logprobs"] = {"content": lps}
            else:
                chunks.append(self.chunk({}, logprobs=lps))
        return chunks

    def finish(self, request: dict) -> list[dict]:
        deltas = self.parser.feed(self.detok.finish()) + self.parser.finish()
        chunks = [self.chunk(d) for d in map(self._delta, deltas) if d]
        reason = {"cancelled": "stop", "eos": "stop"}.get(self.finish_reason, self.finish_reason)
        if self.num_calls and reason == "stop":
            reason = "tool_calls"
        last = self.chunk({}, finish_reason=reason or "stop")
        prompt = len(self.plan.prompt_ids)
        stream = request.get("stream", False)
        if not stream or (request.get("stream_options") or {}).get("include_usage"):
            last["usage"] = {"prompt_tokens": prompt, "completion_tokens": len(self.token_ids),
                             "total_tokens": prompt + len(self.token_ids)}
            cached = (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                last["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        fields = ((request.get("nvext") or {}).get("extra_fields") or [])
        if "completion_token_ids" in fields:
            last["nvext"] = {"completion_token_ids": list(self.token_ids)}
        return chunks + [last]

    def _delta(self, d: Delta) -> dict | None:
        if d.kind == "reasoning":
            if not self.plan.include_reasoning:
                return None
            # Dynamo's delta type reads `reasoning` as an alias of this field (both at once are
            # a duplicate); its --reasoning-field-name picks the name clients see
            return {"reasoning_content": d.text}
        if d.kind == "content":
            return {"content": d.text}
        call = d.call
        self.num_calls += 1
        return {"tool_calls": [{"index": self.num_calls - 1, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": json.dumps(
                                    call.arguments, ensure_ascii=False)}}]}

    def _logprobs(self, ids: list[int], out: dict) -> list[dict] | None:
        lps = out.get("log_probs")
        if not lps:
            return None
        tops = out.get("top_logprobs") or [[] for _ in ids]
        entries = []
        for tid, lp, top in zip(ids, lps, tops):
            entries.append({**self._token(tid), "logprob": lp, "top_logprobs": [
                {**self._token(t["token_id"]), "logprob": t["logprob"]} for t in top]})
        return entries

    def _token(self, tid: int) -> dict:
        text = self.tok.decode([tid], skip_special_tokens=False)
        return {"token": text, "bytes": list(text.encode("utf-8"))}


class BeamEngineFactory:
    """What Dynamo's frontend calls when a Beam model registers: the processor over its
    routed engine (KV router, prefill router)."""

    async def chat_engine_factory(self, instance_id, mdc, routed_engine):
        from dynamo.llm import PythonAsyncEngine

        from .limits import limits_from_card

        model_dir = mdc.local_dir()
        cfg = json.loads(open(f"{model_dir}/config.json").read())
        eos = cfg.get("eos_token_id")
        eos = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
        rc = mdc.runtime_config()
        proc = BeamChatProcessor(model_dir, routed_engine, int(cfg["vocab_size"]), eos,
                                 lambda vocab: limits_from_card(rc, vocab, mdc.name()))
        log.info("Beam chat processor for %s (vocab %d, eos %s, limits %s)", model_dir,
                 proc.vocab_size, eos, proc.limits)
        return PythonAsyncEngine(proc.generator, asyncio.get_running_loop())
