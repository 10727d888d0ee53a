"""Render an OpenAI chat request with the checkpoint's chat template and tokenize it so that
only the template's own delimiters become control tokens.

A user who writes `<|end|><|start|>system` in a message must not reach the model as those
control tokens. Every string that comes from the request (contents, names, arguments, tool
declarations) is escaped before rendering so that no special-token string survives in it:
each `<|` becomes `<` ESC `|` and ESC itself is doubled (ESC is a private-use character). The
rendered text is then split at the special-token strings, which can only be the template's;
the pieces between are unescaped and tokenized with special tokens disabled.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from .errors import ChatRequestError

ESC = "\ue000"
ROLES = ("system", "developer", "user", "assistant", "tool")


def escape(text: str) -> str:
    return text.replace(ESC, ESC + ESC).replace("<|", "<" + ESC + "|")


def unescape(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == ESC:
            nxt = text[i + 1] if i + 1 < len(text) else ""
            if nxt == ESC:
                out.append(ESC)
            else:  # the ESC put inside '<|': drop it, keep the '|'
                out.append(nxt)
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _escape_all(value: Any) -> Any:
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, list):
        return [_escape_all(v) for v in value]
    if isinstance(value, dict):
        return {escape(k) if isinstance(k, str) else k: _escape_all(v) for k, v in value.items()}
    return value


def _text_content(content: Any, where: str) -> str:
    """OpenAI content: a string, null, or a list of parts of which only text parts exist here."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatRequestError(f"{where}.content[{i}]: only text parts are supported, "
                                       f"got {kind!r}", param=f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise ChatRequestError(f"{where}.content must be a string or a list of text parts",
                           param=f"{where}.content")


def _tool_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatRequestError(f"{where}.function.name is missing", param=f"{where}.function")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError as exc:
            raise ChatRequestError(f"{where}.function.arguments is not JSON: {exc}",
                                   param=f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise ChatRequestError(f"{where}.function.arguments must be a JSON object",
                               param=f"{where}.function.arguments")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def normalize_messages(messages: Any) -> list[dict]:
    """The request's messages as the template reads them; ChatRequestError names a bad one."""
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise ChatRequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                                   param=f"{where}.role")
        msg = {"role": m["role"], "content": _text_content(m.get("content"), where)}
        if m["role"] == "assistant":
            calls = m.get("tool_calls") or []
            msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]")
                                 for j, c in enumerate(calls)]
        if m["role"] == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
            msg["name"] = m.get("name") or ""
        out.append(msg)
    return out


def _environment():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # transformers' settings, and its tojson (no HTML escaping, non-ASCII kept)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                              indent=indent)
    return env


_ENV = None


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """Compiling the template costs ~10 ms; a checkpoint has one, so compile it once."""
    global _ENV
    _ENV = _ENV or _environment()
    return _ENV.from_string(template)


def render(template: str, messages: list[dict], tools: list[dict] | None = None,
           add_generation_prompt: bool = True, **kwargs) -> str:
    """The escaped prompt text (control tokens only where the template put them)."""
    return _compiled(template).render(
        messages=_escape_all(messages), tools=_escape_all(tools) if tools else None,
        add_generation_prompt=add_generation_prompt, **kwargs)


class PromptTokenizer:
    """Tokenizes rendered prompts: special-token strings -> their ids, the rest as plain text."""

    def __init__(self, tok, special_tokens: list[str]):
        from tokenizers import Tokenizer

        self.special = {s: tok.token_to_id(s) for s in special_tokens}
        missing = [s for s, i in self.special.items() if i is None]
        if missing:
            raise ValueError(f"the tokenizer lacks the special tokens {missing}")
        self.plain = Tokenizer.from_str(tok.to_str())
        self.plain.encode_special_tokens = True  # special-token strings become plain text
        self.split = re.compile("(" + "|".join(re.escape(s) for s in sorted(
            self.special, key=len, reverse=True)) + ")")

    def encode_plain(self, text: str) -> list[int]:
        return self.plain.encode(text, add_special_tokens=False).ids if text else []

    def encode_rendered(self, rendered: str) -> list[int]:
        ids: list[int] = []
        for piece in self.split.split(rendered):
            if piece in self.special:
                ids.append(self.special[piece])
            elif piece:
                ids += self.encode_plain(unescape(piece))
        return ids
