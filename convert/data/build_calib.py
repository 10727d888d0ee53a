"""Builds the shipped calibration set (`calib.jsonl`) and verify's held-out set (`heldout.jsonl`)
from text that ships offline: the Python standard library's own sources and its language
reference (`pydoc_data.topics`, the text of `help()`), beam-trt's docs, and `calib.txt` (mixed
languages, logs, SQL, YAML). Chat transcripts in Beam's response format (BEAM_SPEC.md "The
response format": `<|start|>{role}<|message|>...<|end|>`, analysis / final channels, tool calls
with `<rfl:parameter>`) are generated from the same sources.

Deterministic: sorted file lists, fixed strides, no randomness; the snapshot in this folder was
built with CPython 3.11.7's library and the docs of the commit that added it (rerunning it on
another Python version gives other text, which is why the output is shipped rather than built
at conversion time). Every source document goes to exactly one of the two sets (by its index),
so verify's held-out text is disjoint from the calibration text. The standard library's text
is under the PSF License (redistribution allowed with its notice: `LICENSE.txt` of CPython).

    python convert/data/build_calib.py            # rewrites calib.jsonl and heldout.jsonl
"""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages",
             "ensurepip", "encodings", "pydoc_data", "__pycache__", "distutils", "venv"}
HELD_OUT_EVERY = 6  # document i goes to the held-out set when i % 6 == 5
BUDGET = {"code": 150_000, "prose": 120_000, "chat": 110_000}  # calibration characters by kind
CHUNK = 2600  # characters per document at most
# The chat templates, worded differently for the two sets (so no template text is shared).
STYLES = [
    {"system": "You are Beam, a careful assistant for programmers. Answer precisely and briefly.",
     "explain": "Can you explain {topic}? Keep it short.", "about": "The user asks about {topic}.",
     "code": "What does this code from {path} do?", "read": "read_file",
     "read_ask": "Open {path} and tell me what the first definition is.", "search": "search_docs",
     "search_ask": "Look up `{query}` in the reference and summarise it.",
     "from": "The code is from `{path}` in the standard library."},
    {"system": "Beam here: a concise helper for software questions.",
     "explain": "I keep mixing up {topic}; what is it exactly?",
     "about": "Question on {topic}; recall the reference first.",
     "code": "Walk me through this snippet ({path}).", "read": "open_source",
     "read_ask": "Show me the start of {path}, please.", "search": "lookup_reference",
     "search_ask": "Find the reference entry for {query}.",
     "from": "Source file: {path}."},
]


def tools(style: dict) -> list[dict]:
    return [
        {"name": style["read"], "description": f"{style['read']}: a standard library file.",
         "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                        "required": ["path"]}},
        {"name": style["search"], "description": f"{style['search']}: the Python reference.",
         "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                         "limit": {"type": "integer"}},
                        "required": ["query"]}},
    ]


def _cut(text: str, limit: int = CHUNK) -> str:
    """At most `limit` characters, cut at a blank line (or a line end) when there is one."""
    if len(text) <= limit:
        return text.strip()
    head = text[:limit]
    for sep in ("\n\n", "\n"):
        at = head.rfind(sep)
        if at > limit // 2:
            return head[:at].strip()
    return head.strip()


def _code_body(source: str) -> str:
    """The module from its first top-level def/class on (skips license headers and imports)."""
    hit = re.search(r"^(class |def |async def |@)", source, re.M)
    return source[hit.start():] if hit else source


def code_docs() -> list[tuple[str, str]]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py")
                   if not SKIP_DIRS & set(p.relative_to(lib).parts) and p.stat().st_size > 4000)
    return [(f"stdlib:{p.relative_to(lib)}", _cut(_code_body(p.read_text(errors="replace"))))
            for p in files]


def prose_docs() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    docs = [(f"python-reference:{k}", _cut(topics[k])) for k in sorted(topics)
            if len(topics[k]) > 700]
    for md in ("README.md", "docs/ARCHITECTURE.md", "docs/DESIGN.md", "docs/ENGINE.md",
               "docs/SERVING.md", "docs/TRTLLM.md", "docs/CONTRIBUTING.md", "docs/CONVERT.md"):
        sections = re.split(r"^## ", (ROOT / md).read_text(), flags=re.M)
        docs += [(f"beam-trt:{md}#{i}", _cut("## " + s if i else s))
                 for i, s in enumerate(sections) if len(s) > 400]
    return docs


def _turn(role: str, text: str, channel: str | None = None, end: str = "<|end|>") -> str:
    ch = f"<|channel|>{channel}" if channel else ""
    return f"<|start|>{role}{ch}<|message|>{text}{end}"


def _sentences(text: str, n: int) -> str:
    parts = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    return " ".join(parts[:n])


def _explain_chat(name: str, prose: str, style: dict) -> str:
    topic = name.split(":", 1)[1].split("#")[0]
    reasoning = style["about"].format(topic=topic) + " " + _sentences(prose, 2)
    return (_turn("system", style["system"]) + _turn("user", style["explain"].format(topic=topic))
            + _turn("assistant", reasoning, "analysis")
            + _turn("assistant", _cut(prose, 1400), "final", "<|return|>"))


def _code_chat(name: str, code: str, style: dict) -> str:
    path = name.split(":", 1)[1]
    first = code.splitlines()[0] if code else ""
    doc = re.search(r'"""(.*?)"""', code, re.S)
    summary = _sentences(doc.group(1), 3) if doc else f"It starts with `{first.strip()}`."
    ask = style["code"].format(path=path)
    return (_turn("user", f"{ask}\n\n```python\n{_cut(code, 1500)}\n```")
            + _turn("assistant", f"{summary} " + style["from"].format(path=path), "final",
                    "<|return|>"))


def _tool_chat(name: str, body: str, style: dict, read: bool) -> str:
    path = name.split(":", 1)[1]
    tool = tools(style)[0 if read else 1]
    if read:
        params = f'<rfl:parameter name="path">\n{path}\n</rfl:parameter>'
        ask = style["read_ask"].format(path=path)
    else:
        query = path.split("#")[0]
        params = (f'<rfl:parameter name="query">\n{query}\n</rfl:parameter>\n'
                  f'<rfl:parameter name="limit">\n3\n</rfl:parameter>')
        ask = style["search_ask"].format(query=query)
    call = ("<|start|>assistant to=functions." + tool["name"]
            + "<|channel|>analysis  <|constrain|>xml<|message|>" + params + "<|call|>")
    return (_turn("developer", "# Tools\n" + json.dumps([tool], indent=1))
            + _turn("user", ask) + call
            + _turn(f"functions.{tool['name']} to=assistant", _cut(body, 1600))
            + _turn("assistant", _sentences(body, 3) or "The file is empty.", "final",
                    "<|return|>"))


def chat_docs(code, prose, style: dict) -> list[tuple[str, str]]:
    docs = []
    for i in range(max(len(code), len(prose))):
        if i < len(prose):
            name, text = prose[i]
            docs.append((f"chat:{name}", _explain_chat(name, text, style) if i % 2 == 0
                         else _tool_chat(name, text, style, read=False)))
        if i < len(code):
            name, text = code[i]
            docs.append((f"chat:{name}", _code_chat(name, text, style) if i % 2 == 0
                         else _tool_chat(name, text, style, read=True)))
    return docs


def _spread(docs: list, budget: int) -> list:
    """Documents at an even stride over the whole sorted list until the budget is used."""
    if not docs:
        return []
    mean = sum(len(t) for _, t in docs) / len(docs)
    want = min(len(docs), max(1, int(budget / mean)))
    picked = [docs[int(i * len(docs) / want)] for i in range(want)]
    out, used = [], 0
    for doc in picked:
        if used >= budget:
            break
        out.append(doc)
        used += len(doc[1])
    return out


def split(docs: list) -> tuple[list, list]:
    calib = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return calib, held


def build() -> tuple[list[dict], list[dict]]:
    code_c, code_h = split(code_docs())
    prose_c, prose_h = split(prose_docs())
    chat_c = chat_docs(code_c[1::2], prose_c[1::2], STYLES[0])  # other documents' text
    chat_h = chat_docs(code_h[1::4], prose_h[1::4], STYLES[1])
    kinds_c = {"code": _spread(code_c[::2], BUDGET["code"]),
               "prose": _spread(prose_c[::2], BUDGET["prose"]),
               "chat": _spread(chat_c, BUDGET["chat"])}
    kinds_h = {"code": _spread(code_h[::4], 12_000), "prose": _spread(prose_h[::4], 12_000),
               "chat": _spread(chat_h, 12_000)}
    mixed = (HERE / "calib.txt").read_text()
    calib = [{"kind": "mixed", "source": "beam-trt:convert/data/calib.txt", "text": mixed}]
    return calib + _interleave(kinds_c), _interleave(kinds_h)


def _interleave(kinds: dict[str, list]) -> list[dict]:
    """code, prose, chat, code, ...: every stretch of the token stream mixes the kinds."""
    out, n = [], max(len(v) for v in kinds.values())
    for i in range(n):
        for kind, docs in kinds.items():
            if i < len(docs):
                out.append({"kind": kind, "source": docs[i][0], "text": docs[i][1]})
    return out


def main() -> None:
    calib, held = build()
    for name, docs in (("calib.jsonl", calib), ("heldout.jsonl", held)):
        with open(HERE / name, "w") as f:
            for d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        size = sum(len(d["text"]) for d in docs)
        print(f"{name}: {len(docs)} documents, {size / 1000:.0f} K characters")


if __name__ == "__main__":
    main()
