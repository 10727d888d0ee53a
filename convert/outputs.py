"""Output files: which tensor goes where, written front to back, journaled for resume.

The plan fixes every file's tensor list before any data is written. Files are written into
`<name>.partial` and renamed when complete; `.convert-state.json` (atomically replaced) records
the first unit not yet durable on disk and each open file's durable byte offset. A re-run with
the same plan skips finished units, re-hashes each partial file's durable prefix, truncates the
rest and continues: the bytes are a function of the plan, so the result is identical.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from beam_trtllm.checkpoint import INDEX_NAME, SINGLE_NAME, shard_name

from .errors import ConvertError
from .outdir import STATE, atomic_write_text, write_state
from .shard import Mapping, placement, rank_shape, take
from .st_io import NAMES, PartialFile, header_for, nbytes_of, sha256_file


@dataclass
class OutFile:
    name: str
    specs: list = field(default_factory=list)  # (tensor, dtype, shape) in write order
    first_unit: int = 0
    last_unit: int = 0


def hf_layout(outputs_by_unit, max_shard_bytes: int):
    """Greedy split into shards at unit boundaries (a unit's tensors stay in one file)."""
    files, used = [OutFile("")], 0
    for u, outs in enumerate(outputs_by_unit):
        size = sum(nbytes_of(d, s) for _, d, s in outs)
        if files[-1].specs and used + size > max_shard_bytes:
            files.append(OutFile("", first_unit=u))
            used = 0
        files[-1].specs += [(n, None, d, s) for n, d, s in outs]
        files[-1].last_unit, used = u, used + size
    n = len(files)
    for k, f in enumerate(files, 1):
        f.name = SINGLE_NAME if n == 1 else shard_name(k, n)
    return files


def trtllm_layout(outputs_by_unit, cfg, mapping: Mapping):
    files = [OutFile(f"rank{r}.safetensors", last_unit=len(outputs_by_unit) - 1)
             for r in range(mapping.world)]
    for outs in outputs_by_unit:
        for name, dtype, shape in outs:
            for r, f in enumerate(files):
                where = placement(name, shape, cfg, mapping, r)
                if where is not None:
                    f.specs.append((name, where, dtype, rank_shape(shape, where)))
    return files


def write_index(out_dir: Path, files: list[OutFile]) -> None:
    if len(files) == 1:
        return
    mapping = {n: f.name for f in files for n, *_ in f.specs}
    total = sum(nbytes_of(d, s) for f in files for _, _, d, s in f.specs)
    text = json.dumps({"metadata": {"total_size": total}, "weight_map": mapping}, indent=2)
    atomic_write_text(out_dir / INDEX_NAME, text)


def index_text_size(files: list[OutFile]) -> int:
    """An upper bound of the index's size (for the free-space check)."""
    return 0 if len(files) == 1 else sum(len(n) + len(f.name) + 8 for f in files
                                         for n, *_ in f.specs) + 256


def file_sizes(files: list[OutFile]) -> dict[str, int]:
    """Every weight file's final size: header plus data, known from the plan."""
    return {f.name: len(header_for([(n, d, s) for n, _, d, s in f.specs]))
            + sum(nbytes_of(d, s) for _, _, d, s in f.specs) for f in files}


class Writer:
    """Consumes (unit index, {name: tensor}) in unit order; owns the partial files and the journal."""

    def __init__(self, out_dir: Path, files: list[OutFile], plan_hash: str, fresh: bool):
        self.dir, self.files, self.plan_hash = out_dir, files, plan_hash
        self.open: dict[str, PartialFile] = {}
        self.done: dict[str, str] = {}  # finished file -> sha256
        self.next_unit, self.chain = 0, ""
        self.cursor = {f.name: 0 for f in files}  # index into specs
        if not fresh:
            self._resume()

    def _resume(self) -> None:
        state = json.loads((self.dir / STATE).read_text())
        self.next_unit, self.chain, self.done = state["next_unit"], state["chain"], state["done"]
        for f in self.files:
            if f.name in self.done:
                if not (self.dir / f.name).is_file():
                    raise ConvertError(f"{self.dir / f.name}: finished earlier but now missing; "
                                       f"remove {self.dir} and convert again")
                self.cursor[f.name] = len(f.specs)
            elif f.name in state["open"] and not (self.dir / (f.name + ".partial")).exists() \
                    and (self.dir / f.name).is_file():
                # finished (fsynced, renamed) after the last journal write: keep it as it is
                self.done[f.name] = sha256_file(self.dir / f.name)
                self.cursor[f.name] = len(f.specs)
            elif f.name in state["open"]:
                offset, cursor = state["open"][f.name]
                self.open[f.name] = PartialFile(self.dir / f.name, b"", resume_at=offset)
                self.cursor[f.name] = cursor

    def _file(self, f: OutFile) -> PartialFile:
        if f.name not in self.open:
            header = header_for([(n, d, s) for n, _, d, s in f.specs])
            self.open[f.name] = PartialFile(self.dir / f.name, header)
        return self.open[f.name]

    def write_unit(self, unit_index: int, tensors: dict[str, torch.Tensor], digest: str) -> None:
        for f in self.files:
            specs, i = f.specs, self.cursor[f.name]
            while i < len(specs) and specs[i][0] in tensors:
                name, where, dtype, shape = specs[i]
                piece = tensors[name] if where is None else take(tensors[name], where)
                if piece.dtype != dtype or tuple(piece.shape) != tuple(shape):
                    raise ConvertError(f"internal: {name} came out {piece.dtype} {list(piece.shape)}"
                                       f", the plan says {NAMES[dtype]} {list(shape)}")
                self._file(f).write_tensor(piece)
                i += 1
            self.cursor[f.name] = i
            if i == len(specs) and f.name in self.open and f.name not in self.done:
                self.done[f.name] = self.open.pop(f.name).finish()
        self.chain = hashlib.sha256((self.chain + digest).encode()).hexdigest()
        self.next_unit = unit_index + 1

    def commit(self) -> None:
        for pf in self.open.values():
            pf.commit()
        write_state(self.dir, {
            "plan_hash": self.plan_hash, "next_unit": self.next_unit, "chain": self.chain,
            "done": self.done,
            "open": {n: [pf.offset, self.cursor[n]] for n, pf in self.open.items()}})

    def close(self) -> None:
        for pf in self.open.values():
            pf.abandon()
