"""Output grammars of a Beam turn as xgrammar structural tags (JSON), and their compilation.

The frontend builds the tag from the request (`turn_structural_tag`: reasoning on or off,
tool_choice auto / required / named / none, response_format json_schema / json_object) and
sends it to the workers as a string; the engine compiles it once per distinct tag
(`GrammarCompiler`, cached) and masks the logits of each constrained row (sampler.py). Beam's
delimiters are matched as their special tokens, never spelled out in text; tool arguments are
held to the tool's schema (strict), in alphabetical order as Beam writes them.

`MaskFiller` fills a step's bitmask rows and accepts the sampled tokens, one call each for the
batch, on the engine's thread: the fill runs after the forward is launched, while the GPU
computes it. (A variant that filled the next step's masks ahead on a worker thread ran the
tiny Beam's batch-1 constrained decode at about half the speed on the H200, 2026-12-02: the
hand-offs between threads cost far more than the fill, 0.02 ms for 32 rows there.)
"""

from __future__ import annotations

import functools
import json
from typing import Any

from . import format as F
from .errors import ChatRequestError
from .tools import declared_types

_MAX_WS = 2  # JSON whitespace between tokens: a random or confused model cannot stall in it


def _tok(s: str) -> dict:
    return {"type": "token", "token": s}


def _const(s: str) -> dict:
    return {"type": "const_string", "value": s}


def _seq(*elements) -> dict:
    return {"type": "sequence", "elements": list(elements)}


def _or(elements: list[dict]) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def _text(excludes=(), max_tokens: int | None = None) -> dict:
    fmt: dict[str, Any] = {"type": "any_text", "excludes": list(F.BEAM_SPECIAL_TOKENS) + list(excludes)}
    if max_tokens is not None:
        fmt["max_tokens"] = int(max_tokens)
    return fmt


def _json(schema: Any) -> dict:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": _MAX_WS}


def thinking(budget: int | None) -> dict:
    return _seq(_tok(F.CHANNEL), _const("analysis"), _tok(F.MESSAGE), _text(max_tokens=budget),
                _tok(F.END), _tok(F.START), _const("assistant"))


def answer(schema: Any = None) -> dict:
    body = _text() if schema is None else _json(schema)
    return _seq(_tok(F.CHANNEL), _const("final"), _tok(F.MESSAGE), body, _tok(F.RETURN))


def _value(prop: dict) -> dict:
    types = declared_types(prop)
    if types == ["string"] or not types:
        if "enum" in prop:
            return _or([_const(str(v)) for v in prop["enum"]])
        limit = prop.get("maxLength")
        fmt = _text(excludes=(F.PARAM_CLOSE, "<rfl:parameter"))
        if isinstance(limit, int):
            fmt["max_chars"] = limit
        return fmt
    return _json(prop)


def call(name: str, schema: dict) -> dict:
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    params = []
    for key in sorted(props):
        tag = {"type": "tag", "begin": F.PARAM_OPEN.format(key=key),
               "content": _value(props[key]), "end": F.PARAM_CLOSE}
        param = _seq({"type": "optional", "content": _const(F.PARAM_SEPARATOR)}, tag) if params else tag
        params.append(param if key in required else {"type": "optional", "content": param})
    head = [_const(" to=" + name), _tok(F.CHANNEL), _const("analysis "), _tok(F.CONSTRAIN),
            _const("xml"), _tok(F.MESSAGE)]
    return _seq(*head, *params)


def calls(tools: dict[str, dict], parallel: bool) -> dict:
    one = _or([call(n, s) for n, s in tools.items()])
    if not parallel:
        return _seq(one, _tok(F.CALL))
    more = {"type": "star", "content": _seq(_tok(F.END), _tok(F.START), _const("assistant"), one)}
    return _seq(one, more, _tok(F.CALL))


def _answer_schema(response_format: Any) -> tuple[bool, Any]:
    """(constrained, JSON schema or None) of `response_format`."""
    if response_format is None:
        return False, None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, {"type": "object"}
    if kind == "json_schema":
        js = response_format.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise ChatRequestError("response_format.json_schema.schema must be a JSON schema "
                                   "object", param="response_format")
        return True, schema
    raise ChatRequestError(f"response_format type {kind!r} is not supported (text, json_object, "
                           "json_schema)", param="response_format")


def turn_structural_tag(tools: dict[str, dict], tool_choice: Any, response_format: Any,
                        enable_thinking: bool | None, parallel: bool = True,
                        thinking_budget: int | None = None) -> str | None:
    """The structural tag of one assistant turn, or None when nothing constrains it (no tools,
    no response_format, enable_thinking not given)."""
    constrained, schema = _answer_schema(response_format)
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if not (constrained or tools or enable_thinking is not None):
        return None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or name not in tools:
            raise ChatRequestError(f"tool_choice names the function {name!r}, which is not in "
                                   "tools", param="tool_choice")
        body = calls({name: tools[name]}, parallel=False)
    elif choice == "required":
        if not tools:
            raise ChatRequestError("tool_choice 'required' needs tools", param="tool_choice")
        body = calls(tools, parallel)
    elif choice == "auto":
        body = _or([answer(schema), calls(tools, parallel)]) if tools else answer(schema)
    elif choice == "none":
        body = answer(schema)
    else:
        raise ChatRequestError(f"tool_choice {choice!r} is not one of none, auto, required or a "
                               "named function", param="tool_choice")
    think = enable_thinking if enable_thinking is not None else True
    fmt = _seq(thinking(thinking_budget), body) if think else body
    return json.dumps({"type": "structural_tag", "format": fmt}, sort_keys=True)


class GrammarCompiler:
    """Compiles structural tags for one vocabulary (cached by tag text)."""

    def __init__(self, vocab: list[str], vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                 stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self.compile = functools.lru_cache(maxsize=256)(self._compile)

    def _compile(self, structural_tag: str):
        try:
            return self.compiler.compile_structural_tag(structural_tag)
        except (RuntimeError, ValueError) as exc:
            raise ChatRequestError(f"the output grammar cannot be compiled: {exc}",
                                   param="response_format") from None

    def matcher(self, structural_tag: str):
        return self.xgr.GrammarMatcher(self.compile(structural_tag))


class MaskFiller:
    """Next-token bitmasks of a batch's constrained rows (xgrammar's packed int32 rows) and
    the sampled tokens' acceptance, one call each for the whole batch."""

    def __init__(self):
        import xgrammar as xgr

        # one thread: xgrammar 0.2.9 starts a new pool of max_threads threads on every batch
        # fill (grammar_matcher.cc); on the H200 host "auto" (8 threads) took 0.48 ms for 32
        # fresh matchers of the turn grammar (tiny Beam's vocabulary), one thread 0.017 ms
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def fill(self, bitmask, matchers: list, rows: list[int]) -> None:
        """bitmask[rows[i]] = the tokens matchers[i] allows next."""
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        elif matchers:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        """Each matcher accepts its token; False: outside its grammar (the matcher unchanged)."""
        if len(matchers) == 1:
            return [matchers[0].accept_token(tokens[0])]
        return self._batch.batch_accept_token(matchers, tokens)
