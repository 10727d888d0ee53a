"""The trained tiny Beam's tokenizer: a byte-level BPE trained with `tokenizers` on the training
corpus (data.py), with Beam's special tokens, chat template and `response_template` metadata
exactly as `beam_trtllm.tokenizer` writes them for every tiny Beam (one definition of each)."""

from __future__ import annotations

from pathlib import Path

from ..chat.format import BEAM_SPECIAL_TOKENS
from ..tokenizer import SPECIAL_TOKENS, TextTokenizer, write_tokenizer_files
from .data import Sources, tokenizer_lines

ROUND_TRIP_SAMPLE = 'def add(a, b):\n    """Sum."""\n    return a + b  # ünïcode ✓\n'


def train_tokenizer(out_dir: Path, src: Sources, vocab_size: int,
                    max_length: int) -> tuple[TextTokenizer, dict[str, int]]:
    """Write tokenizer.json / tokenizer_config.json into `out_dir`, check them, and return the
    loaded tokenizer and the special token ids."""
    ids = write_tokenizer_files(out_dir, vocab_size, max_length, tokenizer_lines(src))
    tok = TextTokenizer(out_dir)
    check_tokenizer(tok, src.train_files[0][1])
    return tok, ids


def check_tokenizer(tok: TextTokenizer, sample: str) -> None:
    """Text round-trips byte for byte; each special token is one id, and typed as plain text
    it is not."""
    for text in (ROUND_TRIP_SAMPLE, sample):
        got = tok.decode(tok.encode_plain(text))
        if got != text:
            at = next((i for i, (a, b) in enumerate(zip(got, text)) if a != b),
                      min(len(got), len(text)))
            raise RuntimeError(f"tokenizer does not round-trip: first difference at char {at}")
    for name in SPECIAL_TOKENS:
        if len(tok.encode(name)) != 1 or tok.encode(name)[0] != tok.token_id(name):
            raise RuntimeError(f"special token {name!r} does not encode to its single id")
    for name in BEAM_SPECIAL_TOKENS:
        if tok.token_id(name) in tok.encode_plain(name):
            raise RuntimeError(f"{name!r} typed as text became the control token")
