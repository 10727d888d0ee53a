"""The training corpus of the trained tiny Beam, offline and reproducible: the Python standard
library's source files (a fixed, sorted list; a fixed 2% held out by a hash of the path) and
the synthetic dialogues of dialogues.py, tokenized and packed into rows.

The file list depends on the Python that runs it (a stdlib of another version has other
files), so `Corpus.meta` records the version, the file counts and a SHA-256 of the list and
the bytes read.
"""

from __future__ import annotations

import hashlib
import random
import sys
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .dialogues import Example, dialogues

# Not the library's own code: installed packages, bytecode, the rendered docs blob, and the
# codec tables (megabytes of generated hex literals).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "pydoc_data",
                           "encodings"})
MAX_FILE_BYTES = 200_000
MAX_LINE_CHARS = 400  # longer lines are data blobs, not code
HELDOUT_MODULUS = 50  # a file is held out when crc32(path) % 50 == 0: 2%, stable across lists
IGNORE = -100


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """The corpus' files: sorted POSIX paths relative to the stdlib root."""
    root = root or stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("bad"):
            continue
        if path.is_file() and path.stat().st_size <= MAX_FILE_BYTES:
            out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % HELDOUT_MODULUS == 0


def read_source(root: Path, rel: str) -> str | None:
    """The file's text, or None for one that is not UTF-8 or has data-blob lines."""
    try:
        text = (root / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    if not text.strip() or max(len(line) for line in text.splitlines()) > MAX_LINE_CHARS:
        return None
    return text


@dataclass
class Sources:
    """The raw text of the corpus before tokenization."""
    train_files: list[tuple[str, str]]  # (path, text)
    heldout_files: list[tuple[str, str]]
    train_dialogues: list[Example]
    heldout_dialogues: list[Example]
    meta: dict = field(default_factory=dict)


def gather_sources(seed: int, n_dialogues: int, max_stdlib_bytes: int | None = None,
                   root: Path | None = None) -> Sources:
    """Stdlib files (the first `max_stdlib_bytes` of training text in path order, all held-out
    files) and `n_dialogues` dialogues from `seed` (plus a tenth as many from another seed,
    for the held-out dialogue loss)."""
    root = root or stdlib_root()
    digest = hashlib.sha256()
    train, heldout, used = [], [], 0
    for rel in stdlib_files(root):
        text = read_source(root, rel)
        if text is None:
            continue
        if is_heldout(rel):
            heldout.append((rel, text))
        elif max_stdlib_bytes is None or used < max_stdlib_bytes:
            train.append((rel, text))
            used += len(text.encode())
        else:
            continue
        digest.update(rel.encode() + b"\0" + text.encode() + b"\0")
    if not train or not heldout:
        raise RuntimeError(f"{root}: found {len(train)} training and {len(heldout)} held-out "
                           "stdlib files; the corpus needs both")
    meta = {"python": sys.version.split()[0], "stdlib_root": str(root),
            "stdlib_train_files": len(train), "stdlib_heldout_files": len(heldout),
            "stdlib_train_bytes": used, "stdlib_sha256": digest.hexdigest(),
            "dialogues": n_dialogues, "dialogue_seed": seed}
    return Sources(train, heldout, dialogues(n_dialogues, seed),
                   dialogues(max(8, n_dialogues // 10), seed + 7919), meta)


def tokenizer_lines(src: Sources, max_bytes: int = 6_000_000) -> list[str]:
    """What the BPE learns from: every dialogue's text between the special tokens, and the
    training files (every k-th, so at most ~`max_bytes`), line by line."""
    from ..chat.format import BEAM_SPECIAL_TOKENS
    from ..chat.template import unescape

    total = sum(len(t) for _, t in src.train_files)
    step = max(1, -(-total // max_bytes))
    lines = [line for _, text in src.train_files[::step] for line in text.splitlines(True)]
    for ex in src.train_dialogues:
        text = unescape(ex.prompt + ex.completion)
        for tok in BEAM_SPECIAL_TOKENS:
            text = text.replace(tok, "\n")
        lines += text.splitlines(True)
    return lines


# ---------------------------------------------------------------- tokenized pieces and rows
@dataclass
class Piece:
    ids: list[int]
    targets: list[bool]  # which tokens the loss predicts
    splittable: bool  # plain code may be cut to fill a row; a dialogue may not


def file_pieces(encodings: list[list[int]], row_len: int) -> list[Piece]:
    out = []
    for ids in encodings:
        for start in range(0, len(ids), row_len):
            chunk = ids[start:start + row_len]
            out.append(Piece(chunk, [True] * len(chunk), True))
    return out


def example_pieces(tok, examples: list[Example], row_len: int) -> list[Piece]:
    """Prompt tokens are context only; the completion's tokens are the targets. An example
    longer than a row is left out; a row length that leaves out most is refused."""
    out = []
    for ex in examples:
        prompt = tok.prompt_tokenizer.encode_rendered(ex.prompt)
        completion = tok.prompt_tokenizer.encode_rendered(ex.completion)
        if len(prompt) + len(completion) < row_len:  # + its separator
            out.append(Piece(prompt + completion, [False] * len(prompt) + [True] * len(completion),
                             False))
    if len(out) < len(examples) // 2:
        raise ValueError(f"only {len(out)} of {len(examples)} dialogue examples fit rows of "
                         f"{row_len - 1} tokens: use a longer --seq-len")
    return out


def pack_rows(pieces: list[Piece], row_len: int, sep_id: int, pad_id: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffle (seeded) and pack pieces into rows of `row_len` tokens, a separator before each
    piece. Plain code that does not fit continues in the next row; a dialogue that does not fit
    starts the next row (the rest of this one is padding, never a target). Returns ids
    [N, row_len] int64 and the target mask [N, row_len] bool."""
    order = list(range(len(pieces)))
    random.Random(seed).shuffle(order)
    rows: list[list[int]] = []
    masks: list[list[bool]] = []
    row: list[int] = []
    mask: list[bool] = []
    for i in order:
        p = pieces[i]
        ids, tgt = [sep_id] + p.ids, [False] + p.targets
        while ids:
            room = row_len - len(row)
            take = len(ids) if len(ids) <= room or p.splittable else 0
            take = min(take, room)
            if take == 0 and not row:
                raise ValueError(f"a dialogue of {len(ids)} tokens does not fit a row of {row_len}")
            row, mask = row + ids[:take], mask + tgt[:take]
            ids, tgt = ids[take:], tgt[take:]
            if ids or len(row) == row_len:  # full, or a dialogue that needs a fresh row
                rows.append(row + [pad_id] * (row_len - len(row)))
                masks.append(mask + [False] * (row_len - len(mask)))
                row, mask = [], []
    if row:
        rows.append(row + [pad_id] * (row_len - len(row)))
        masks.append(mask + [False] * (row_len - len(mask)))
    return torch.tensor(rows, dtype=torch.long), torch.tensor(masks, dtype=torch.bool)


def labels_of(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [N, T+1] -> inputs [N, T] and next-token labels [N, T] (IGNORE where not a target)."""
    labels = ids[:, 1:].masked_fill(~mask[:, 1:], IGNORE)
    return ids[:, :-1], labels


@dataclass
class Corpus:
    """Tokenized corpus: training rows (packed once; each epoch visits them in a new seeded
    order), held-out rows, metadata."""
    train: tuple[torch.Tensor, torch.Tensor]  # (inputs [N, T], labels [N, T])
    heldout_code: tuple[torch.Tensor, torch.Tensor]
    heldout_chat: tuple[torch.Tensor, torch.Tensor]
    meta: dict

    def epoch_order(self, epoch: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        return torch.randperm(self.train[0].shape[0], generator=gen)


def tokenize_corpus(tok, src: Sources, seq_len: int, sep_id: int, pad_id: int,
                    max_heldout_tokens: int, seed: int = 0) -> Corpus:
    """Rows of seq_len tokens and their next-token labels, packed with `seed`."""
    row_len = seq_len + 1
    plain = tok.prompt_tokenizer.plain
    train_enc = [e.ids for e in plain.encode_batch([t for _, t in src.train_files],
                                                   add_special_tokens=False)]
    held_enc = [e.ids for e in plain.encode_batch([t for _, t in src.heldout_files],
                                                  add_special_tokens=False)]
    pieces = file_pieces(train_enc, row_len) + example_pieces(tok, src.train_dialogues, row_len)
    # held-out code: the files back to back, cut into rows (no padding inside the budget)
    stream: list[int] = []
    for ids in held_enc:
        stream += [sep_id] + ids
    n_rows = max(1, min(len(stream) // row_len, max_heldout_tokens // seq_len))
    held = torch.tensor(stream[:n_rows * row_len], dtype=torch.long).view(n_rows, row_len)
    held_mask = held != sep_id
    chat_ids, chat_mask = pack_rows(example_pieces(tok, src.heldout_dialogues, row_len), row_len,
                                    sep_id, pad_id, seed)
    chat_ids, chat_mask = chat_ids[:n_rows], chat_mask[:n_rows]
    meta = dict(src.meta, train_tokens=sum(len(p.ids) for p in pieces),
                train_target_tokens=sum(sum(p.targets) for p in pieces),
                heldout_code_tokens=int(held_mask[:, 1:].sum()),
                heldout_chat_target_tokens=int(chat_mask[:, 1:].sum()))
    train = labels_of(*pack_rows(pieces, row_len, sep_id, pad_id, seed))
    return Corpus(train, labels_of(held, held_mask), labels_of(chat_ids, chat_mask), meta)
