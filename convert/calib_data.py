"""Calibration tokens: a text file (default: `convert/data/calib.txt`, shipped, ~5 KB of prose,
code in eight languages, shell logs, tool calls, chat turns, tables, YAML, non-English text)
tokenized with the checkpoint's own tokenizer and cut into `samples` windows of `seq_len`
consecutive tokens. Deterministic: no shuffling; when the text is shorter than
samples * seq_len the token stream wraps around."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .errors import ConvertError

DEFAULT_SAMPLES = 8
DEFAULT_SEQ_LEN = 128


@dataclass(frozen=True)
class CalibTokens:
    ids: torch.Tensor  # [samples, seq_len] int64
    source: str
    sha256: str
    unique_tokens: int  # tokens of the text before any wrap-around


def default_text() -> tuple[str, str]:
    return resources.files("convert").joinpath("data", "calib.txt").read_text(), "builtin:calib.txt"


def load_calib_tokens(in_dir: Path, calib_file: str | None, samples: int,
                      seq_len: int) -> CalibTokens:
    from beam_trtllm.tokenizer import TextTokenizer

    if calib_file is None:
        text, source = default_text()
    else:
        path = Path(calib_file)
        try:
            text, source = path.read_text(), str(path.resolve())
        except (OSError, UnicodeDecodeError) as exc:
            raise ConvertError(f"--calib-data {calib_file}: cannot read it as text ({exc})") from exc
    try:
        tok = TextTokenizer(in_dir)
    except FileNotFoundError as exc:
        raise ConvertError(f"{in_dir}: no tokenizer.json, so the calibration text cannot be "
                           "tokenized; pass --calib-data none for weight-only scales") from exc
    ids = tok.encode(text)
    if not ids:
        raise ConvertError(f"--calib-data {source}: the text encodes to zero tokens")
    need = samples * seq_len
    stream = (ids * (need // len(ids) + 1))[:need]
    return CalibTokens(torch.tensor(stream, dtype=torch.long).view(samples, seq_len), source,
                       hashlib.sha256(text.encode()).hexdigest(), len(ids))
