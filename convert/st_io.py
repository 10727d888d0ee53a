"""safetensors reading and writing, one tensor at a time.

Reading parses the header (validated against the file size, so a truncated file is refused
before any work) and reads each tensor, or one expert's rows of a fused expert tensor, with
`pread` into its own buffer. Pages of an mmap'd
file count in the process RSS while mapped, so reading a 5 GB shard through one mmap grows RSS
by 5 GB; pread keeps peak RSS at the tensors actually held.

Writing lays out the header first (every tensor's dtype, shape and offsets are known from the
plan), then the data in header order, so a file is written front to back, hashed as it goes,
and can be resumed at any tensor boundary (`PartialFile`).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from pathlib import Path

import torch

from .errors import ConvertError

DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20
HUGE_MIN = 2 << 20  # buffers from this size on are backed by transparent huge pages


def byte_buffer(nbytes: int) -> torch.Tensor:
    """A fresh uint8 [nbytes] buffer. Large ones are an anonymous mmap advised MADV_HUGEPAGE:
    faulting in fresh 4 KB pages costs more than the copy into them (pread into such a buffer
    measured 1.7 GB/s, into a huge-page one 7-9 GB/s); the mapping goes away with the tensor,
    so RSS stays flat."""
    if nbytes < HUGE_MIN or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=torch.uint8)


class TensorFile:
    """A safetensors file opened for reading: `.specs` {name: (dtype, shape)}, `.read(name)`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.size = self.path.stat().st_size
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise ConvertError(f"{self.path}: cannot open ({exc.strerror})") from exc
        self.header_bytes, self.data_start = self._read_header()
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.offsets: dict[str, tuple[int, int]] = {}
        self._parse(json.loads(self.header_bytes))

    def _read_header(self) -> tuple[bytes, int]:
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise ConvertError(f"{self.path}: truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > self.size:
            raise ConvertError(f"{self.path}: corrupted or truncated header (claims {n} bytes)")
        raw = os.pread(self._fd, n, 8)
        try:
            json.loads(raw)
        except ValueError as exc:
            raise ConvertError(f"{self.path}: corrupted header (not JSON: {exc})") from exc
        return raw, 8 + n

    def _parse(self, header: dict) -> None:
        end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, stop = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ConvertError(f"{self.path}: tensor {name} has a bad header entry ({exc})")
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            if stop - begin != nbytes or begin < 0:
                raise ConvertError(f"{self.path}: tensor {name} header offsets do not match its "
                                   f"shape {list(shape)} and dtype {info['dtype']}")
            self.specs[name] = (dtype, shape)
            self.offsets[name] = (self.data_start + begin, nbytes)
            end = max(end, self.data_start + stop)
        if end > self.size:
            raise ConvertError(f"{self.path}: truncated: the header needs {end} bytes, the file "
                               f"has {self.size}")

    def read(self, name: str) -> torch.Tensor:
        dtype, shape = self.specs[name]
        start, nbytes = self.offsets[name]
        return self._pread(name, start, nbytes).view(dtype).reshape(shape)

    def read_rows(self, name: str, index: int, row: int, rows: int) -> torch.Tensor:
        """`tensor[index, row:row + rows]` of a 3-D tensor (one expert's rows of a fused expert
        tensor): a contiguous byte range, read alone."""
        dtype, shape = self.specs[name]
        start, _ = self.offsets[name]
        if len(shape) != 3 or not (0 <= index < shape[0] and 0 <= row and row + rows <= shape[1]):
            raise ConvertError(f"{self.path}: tensor {name} {list(shape)} has no rows "
                               f"[{index}, {row}:{row + rows}]")
        row_bytes = shape[2] * torch.empty((), dtype=dtype).element_size()
        first = start + (index * shape[1] + row) * row_bytes
        return self._pread(name, first, rows * row_bytes).view(dtype).reshape(rows, shape[2])

    def _pread(self, name: str, start: int, nbytes: int) -> torch.Tensor:
        buf = byte_buffer(nbytes)
        view = memoryview(buf.numpy())
        done = 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], start + done)
            if got <= 0:
                raise ConvertError(f"{self.path}: tensor {name}: file ended while reading")
            done += got
        return buf

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def nbytes_of(dtype: torch.dtype, shape) -> int:
    return _numel(shape) * torch.empty((), dtype=dtype).element_size()


def header_for(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The header of a file holding `specs` in this order, padded to 8 bytes as safetensors does."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in specs:
        size = nbytes_of(dtype, shape)
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class PartialFile:
    """An output file written front to back into `<name>.partial`, resumable at a tensor boundary.

    `offset` is where the next byte goes; `sha` hashes everything before it. `commit()` flushes
    and fsyncs so that a journal can record `offset` as durable; `resume(offset)` re-hashes the
    durable prefix and continues there. `finish()` renames to the final name (atomic)."""

    def __init__(self, path: Path, header: bytes, resume_at: int | None = None):
        self.path, self.partial = path, path.with_name(path.name + ".partial")
        self.sha = hashlib.sha256()
        if resume_at is not None and not self.partial.is_file():
            raise ConvertError(f"{self.partial}: missing, though the resume journal lists it; "
                               f"remove {path.parent} and convert again")
        try:
            self.f = open(self.partial, "wb" if resume_at is None else "r+b")
        except OSError as exc:
            raise ConvertError(f"{self.partial}: cannot open it for writing ({exc.strerror})") \
                from exc
        if resume_at is None:
            self._write(header)
        else:
            self._rehash(resume_at)
            self.f.seek(resume_at)
            self.f.truncate()
        self.offset = self.f.tell()

    def _rehash(self, upto: int) -> None:
        left = upto
        while left:
            chunk = self.f.read(min(left, 16 << 20))
            if not chunk:
                raise ConvertError(f"{self.partial}: shorter than its journal says; delete it")
            self.sha.update(chunk)
            left -= len(chunk)

    def _write(self, data) -> None:
        try:
            self.f.write(data)
        except OSError as exc:
            raise ConvertError(f"{self.partial}: write failed ({exc.strerror}); is the disk full?")
        self.sha.update(data)

    def write_tensor(self, tensor: torch.Tensor) -> None:
        data = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        self._write(data)
        self.offset += len(data)

    def commit(self) -> None:
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
        except OSError as exc:
            raise ConvertError(f"{self.partial}: flush failed ({exc.strerror}); is the disk full?")

    def finish(self) -> str:
        self.commit()
        try:
            self.f.close()
            os.chmod(self.partial, 0o644)
            os.replace(self.partial, self.path)
        except OSError as exc:
            raise ConvertError(f"{self.partial}: finishing failed ({exc.strerror}); is the disk "
                               "full?") from exc
        return self.sha.hexdigest()

    def abandon(self) -> None:
        try:
            self.f.close()
        except OSError:
            pass  # the unflushed tail lies past the journal's durable offset: resume redoes it


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()
