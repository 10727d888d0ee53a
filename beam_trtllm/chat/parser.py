"""Streaming parser of a Beam turn: reasoning, content and tool calls from raw text (special
tokens kept), as vLLM's and SGLang's `beam` parsers read the `response_template` metadata.

Reasoning and content stream as they arrive; text that could still be the start of a delimiter
is held back until it resolves. A tool call is emitted whole when its region closes (at
`<|end|><|start|>assistant` or `<|call|>`), its arguments cast to the tool's JSON-schema types.
Malformed calls, calls to undeclared functions and calls cut off at the end of the stream are
dropped with a warning (SGLang's rule: a cut-off call is not run). Text outside every region is
content, without the delimiters (a turn that skips the channel header still answers).
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from . import format as F
from .tools import coerce_arguments

log = logging.getLogger("beam.chat")

_CALL_OPEN = re.compile(r" to=(?P<name>[^\s<]+)" + re.escape(F.CALL_HEAD_TAIL))
_PARAM = re.compile(r'<rfl:parameter name="(?P<key>[^"]+)">\n(?P<value>.*?)\n'
                    r'(?:</rfl:parameter>|(?=<rfl:parameter name="))', re.S)
_DROPPED_OUTSIDE = (F.ASSISTANT_START,) + F.BEAM_SPECIAL_TOKENS


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call-{uuid.uuid4().hex[:24]}")


@dataclass
class Delta:
    kind: str  # "reasoning" | "content" | "tool_call"
    text: str = ""
    call: ToolCall | None = None


def _held_prefix(buf: str, closers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of a closer."""
    best = 0
    for c in closers:
        for n in range(min(len(c) - 1, len(buf)), best, -1):
            if buf.endswith(c[:n]):
                best = n
                break
    return best


def _could_open(s: str) -> bool:
    """True while `s` (starting at a candidate position) may still become an opener or a
    delimiter dropped outside regions."""
    for lit in (F.THINKING_OPEN, F.CONTENT_OPEN) + _DROPPED_OUTSIDE:
        if lit.startswith(s):
            return True
    if " to=".startswith(s):
        return True
    if not s.startswith(" to="):
        return False
    name = re.match(r"[^\s<]*", s[4:]).group(0)
    rest = s[4 + len(name):]
    return rest == "" or (bool(name) and F.CALL_HEAD_TAIL.startswith(rest))


class BeamResponseParser:
    def __init__(self, tools: dict[str, dict] | None = None):
        self.tools = tools or {}
        self.state = "outside"
        self.buf = ""
        self.call_name = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        out: list[Delta] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Delta]:
        """End of stream: release held text; close or drop the open region."""
        out: list[Delta] = []
        while self._step(out, final=True):
            pass
        if self.state in ("thinking", "content"):
            kind = "reasoning" if self.state == "thinking" else "content"
            closers = (F.THINKING_CLOSE,) if kind == "reasoning" else F.CONTENT_CLOSE
            # a closer cut short at the end (e.g. `x<|end|>`) is the closer, not text
            tail = self.buf[:len(self.buf) - _held_prefix(self.buf, closers)]
            _emit(out, kind, tail)
        elif self.state == "call":
            log.warning("dropping a tool call to %r cut off at the end of the output",
                        self.call_name)
        elif self.buf:
            _emit(out, "content", _strip_delimiters(self.buf))
        self.buf, self.state = "", "done"
        return out

    # ------------------------------------------------------------------ states
    def _step(self, out: list[Delta], final: bool) -> bool:
        if self.state == "outside":
            return self._outside(out, final)
        if self.state == "thinking":
            return self._text_region(out, "reasoning", (F.THINKING_CLOSE,))
        if self.state == "content":
            return self._text_region(out, "content", F.CONTENT_CLOSE)
        if self.state == "call":
            return self._call_region(out)
        return False

    def _outside(self, out: list[Delta], final: bool) -> bool:
        buf = self.buf
        hits = [(buf.find(o), o, s) for o, s in ((F.THINKING_OPEN, "thinking"),
                                                 (F.CONTENT_OPEN, "content")) if o in buf]
        m = _CALL_OPEN.search(buf)
        if m:
            hits.append((m.start(), m.group(0), "call"))
        if hits:
            pos, opener, state = min(hits, key=lambda h: h[0])
            _emit(out, "content", _strip_delimiters(buf[:pos]))
            self.buf, self.state = buf[pos + len(opener):], state
            if state == "call":
                self.call_name = m.group("name")
            return True
        if final:
            return False
        keep = next((i for i in range(len(buf)) if buf[i] in "< " and _could_open(buf[i:])),
                    len(buf))
        stray = buf[:keep]
        # drop whole delimiters; release the rest
        _emit(out, "content", _strip_delimiters(stray))
        self.buf = buf[keep:]
        return False

    def _text_region(self, out: list[Delta], kind: str, closers: tuple[str, ...]) -> bool:
        hits = [(self.buf.find(c), c) for c in closers if c in self.buf]
        if hits:
            pos, closer = min(hits)
            _emit(out, kind, self.buf[:pos])
            self.buf, self.state = self.buf[pos + len(closer):], "outside"
            return True
        n = len(self.buf) - _held_prefix(self.buf, closers)
        _emit(out, kind, self.buf[:n])
        self.buf = self.buf[n:]
        return False

    def _call_region(self, out: list[Delta]) -> bool:
        hits = [(self.buf.find(c), c) for c in F.CALL_CLOSE if c in self.buf]
        if not hits:
            return False
        pos, closer = min(hits)
        body, self.buf, self.state = self.buf[:pos], self.buf[pos + len(closer):], "outside"
        call = self._close_call(self.call_name, body)
        if call is not None:
            self.calls.append(call)
            out.append(Delta("tool_call", call=call))
        return True

    def _close_call(self, name: str, body: str) -> ToolCall | None:
        if self.tools and name not in self.tools:
            log.warning("dropping a call to the undeclared function %r", name)
            return None
        raw: dict[str, str] = {}
        end = 0
        for m in _PARAM.finditer(body):
            if body[end:m.start()].strip("\n"):
                break
            raw[m.group("key")] = m.group("value")
            end = m.end()
        if body[end:].strip("\n"):
            log.warning("dropping a malformed call to %r: %r is not a parameter list", name,
                        body[end:][:80])
            return None
        return ToolCall(name, coerce_arguments(raw, self.tools.get(name)))


def _emit(out: list[Delta], kind: str, text: str) -> None:
    if text:
        if out and out[-1].kind == kind and out[-1].call is None:
            out[-1].text += text
        else:
            out.append(Delta(kind, text))


def _strip_delimiters(text: str) -> str:
    for d in _DROPPED_OUTSIDE:
        text = text.replace(d, "")
    return text


def parse_text(text: str, tools: dict[str, dict] | None = None) -> dict[str, Any]:
    """The whole message of a finished turn: {"reasoning", "content", "tool_calls"}."""
    p = BeamResponseParser(tools)
    return assemble(p.feed(text) + p.finish())


def assemble(deltas: list[Delta]) -> dict[str, Any]:
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    content = "".join(d.text for d in deltas if d.kind == "content")
    calls = [d.call for d in deltas if d.kind == "tool_call"]
    return {"reasoning": reasoning or None, "content": content or None, "tool_calls": calls}
