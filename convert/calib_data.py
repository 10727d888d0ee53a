"""Calibration tokens: documents tokenized with the checkpoint's own tokenizer, concatenated, and
cut into `samples` windows of `seq_len` consecutive tokens spread evenly over the whole stream.

Documents come from `--calib-data`:
- nothing: the shipped set `convert/data/calib.jsonl` (built offline by
  `convert/data/build_calib.py`: 160 documents, 347 K characters of Python standard library code,
  its language reference and beam-trt's docs as prose, chat transcripts in Beam's response
  format with reasoning and tool calls, and `calib.txt`'s mixed languages, logs and tables;
  interleaved, so every window mixes kinds);
- a `.jsonl` file: one JSON object a line with `"text"` (a string) or `"messages"` (a list of
  `{"role", "content"}`, rendered in Beam's format, `render_messages`);
- a `.parquet` file (needs pyarrow): a `text` or `messages` column, one document a row;
- any other file: its whole text is one document;
- a directory: every `.jsonl`, `.parquet`, `.txt` and `.md` file in it, sorted by name.
Deterministic: no shuffling; when the stream is shorter than samples * seq_len it wraps around.
`heldout_tokens` gives verify its text from `convert/data/heldout.jsonl`, documents disjoint
from the shipped calibration set.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from .errors import ConvertError

DEFAULT_SAMPLES = 32
DEFAULT_SEQ_LEN = 256
DIR_SUFFIXES = (".jsonl", ".parquet", ".txt", ".md")


@dataclass(frozen=True)
class CalibTokens:
    ids: torch.Tensor  # [samples, seq_len] int64
    source: str
    sha256: str  # of the documents' texts
    unique_tokens: int  # tokens of the documents before any wrap-around
    documents: dict[str, int] = field(default_factory=dict)  # kind -> documents


def _builtin(name: str) -> Path:
    return Path(str(resources.files("convert").joinpath("data", name)))


def render_messages(messages, where: str) -> str:
    """A chat in Beam's prompt format: `<|start|>{role}<|message|>{content}<|end|>` a message;
    an assistant message as the `final` channel (and its `reasoning` as `analysis`), the last
    one ending in `<|return|>` (BEAM_SPEC.md "The response format")."""
    if not isinstance(messages, list) or not messages:
        raise ConvertError(f"{where}: `messages` must be a non-empty list")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise ConvertError(f"{where}: messages[{k}] needs string `role` and `content`")
        if m["role"] != "assistant":
            out.append(f"<|start|>{m['role']}<|message|>{m['content']}<|end|>")
            continue
        if isinstance(m.get("reasoning"), str):
            out.append(f"<|start|>assistant<|channel|>analysis<|message|>{m['reasoning']}<|end|>")
        end = "<|return|>" if k == len(messages) - 1 else "<|end|>"
        out.append(f"<|start|>assistant<|channel|>final<|message|>{m['content']}{end}")
    return "".join(out)


def _document(row, where: str) -> dict:
    if isinstance(row, dict) and isinstance(row.get("text"), str):
        return {"kind": str(row.get("kind", "text")), "text": row["text"]}
    if isinstance(row, dict) and row.get("messages") is not None:
        return {"kind": "chat", "text": render_messages(row["messages"], where)}
    raise ConvertError(f"{where}: expected an object with a string `text` or a `messages` list")


def _jsonl(path: Path) -> list[dict]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ConvertError(f"--calib-data {path}:{n}: not JSON ({exc})") from exc
            docs.append(_document(row, f"--calib-data {path}:{n}"))
    return docs


def _parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConvertError(f"--calib-data {path}: reading parquet needs pyarrow "
                           "(pip install pyarrow), or pass a .jsonl / text file") from exc
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow.ArrowInvalid is a ValueError
        raise ConvertError(f"--calib-data {path}: not a readable parquet file ({exc})") from exc
    column = next((c for c in ("text", "messages") if c in table.column_names), None)
    if column is None:
        raise ConvertError(f"--calib-data {path}: needs a `text` or `messages` column, it has "
                           f"{table.column_names}")
    return [_document({column: v}, f"--calib-data {path} row {i}")
            for i, v in enumerate(table.column(column).to_pylist())]


def _file(path: Path) -> list[dict]:
    try:
        if path.suffix == ".jsonl":
            return _jsonl(path)
        if path.suffix == ".parquet":
            return _parquet(path)
        return [{"kind": "text", "text": path.read_text(encoding="utf-8")}]
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertError(f"--calib-data {path}: cannot read it as text ({exc})") from exc


def read_documents(calib_data: str | None) -> tuple[list[dict], str]:
    """(documents, source) for --calib-data (None: the shipped set)."""
    if calib_data is None:
        return _jsonl(_builtin("calib.jsonl")), "builtin:calib.jsonl"
    path = Path(calib_data)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in DIR_SUFFIXES and p.is_file())
        if not files:
            raise ConvertError(f"--calib-data {path}: no {', '.join(DIR_SUFFIXES)} files in it")
        docs = [d for p in files for d in _file(p)]
    elif path.is_file():
        docs = _file(path)
    else:
        raise ConvertError(f"--calib-data {calib_data}: cannot read it as text (no such file "
                           "or directory)")
    return docs, str(path.resolve())


def windows(stream: list[int], samples: int, seq_len: int) -> torch.Tensor:
    """`samples` windows of `seq_len` tokens, evenly spaced from the first token to the last
    (non-overlapping once the stream holds samples * seq_len tokens; else it wraps around)."""
    need = samples * seq_len
    if len(stream) < need:
        stream = (stream * (need // len(stream) + 1))[:need]
        return torch.tensor(stream, dtype=torch.long).view(samples, seq_len)
    step = (len(stream) - seq_len) / max(1, samples - 1)
    starts = [int(i * step) for i in range(samples)]
    return torch.tensor([stream[s: s + seq_len] for s in starts], dtype=torch.long)


def _tokenize(in_dir: Path, docs: list[dict], source: str) -> list[int]:
    from beam_trtllm.tokenizer import TextTokenizer

    try:
        tok = TextTokenizer(in_dir)
    except FileNotFoundError as exc:
        raise ConvertError(f"{in_dir}: no tokenizer.json, so the calibration text cannot be "
                           "tokenized; pass --calib-data none for weight-only scales") from exc
    sep = tok.encode("\n\n")
    stream: list[int] = []
    for d in docs:
        stream += tok.encode(d["text"]) + sep
    if not stream or len(stream) == len(sep) * len(docs):
        raise ConvertError(f"--calib-data {source}: the text encodes to zero tokens")
    return stream


def load_calib_tokens(in_dir: Path, calib_data: str | None, samples: int,
                      seq_len: int) -> CalibTokens:
    docs, source = read_documents(calib_data)
    if not docs:
        raise ConvertError(f"--calib-data {source}: holds no documents")
    stream = _tokenize(Path(in_dir), docs, source)
    h = hashlib.sha256()
    for d in docs:
        h.update(hashlib.sha256(d["text"].encode()).digest())
    kinds: dict[str, int] = {}
    for d in docs:
        kinds[d["kind"]] = kinds.get(d["kind"], 0) + 1
    return CalibTokens(windows(stream, samples, seq_len), source, h.hexdigest(), len(stream),
                       kinds)


def heldout_tokens(in_dir: Path, samples: int, seq_len: int) -> torch.Tensor:
    """verify's text: the shipped held-out documents (none of them is in calib.jsonl)."""
    docs = _jsonl(_builtin("heldout.jsonl"))
    return windows(_tokenize(Path(in_dir), docs, "builtin:heldout.jsonl"), samples, seq_len)
