"""OUT_DIR before any work: its type, contents, writability and free space; atomic side files.

`prepare_out_dir` runs before calibration, so every problem it finds costs nothing:
- OUT_DIR (or a parent) is a file, or cannot be created / written: refused, naming the path;
- OUT_DIR holds a finished conversion (manifest.json), an interrupted conversion of other
  inputs or options, or files this conversion would not write (foreign files, a stale index or
  stale shards): refused, naming what is there. `overwrite` first removes the files a
  checkpoint conversion writes (safetensors, index, configs, tokenizer files, manifest,
  journals); anything else is still refused, never deleted;
- the file system has less free space than the files still to be written (the plan knows
  every size): refused, naming both numbers;
- otherwise the resume journal is written at once (plan hash, nothing done yet), so a run
  stopped at any later point, during calibration included, is resumed by the same command.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path

from .errors import ConvertError
from .inputs import SIDE_FILES

STATE = ".convert-state.json"
CALIB_STATE = ".convert-calibration.json"
MANIFEST = "manifest.json"
# What any checkpoint conversion writes: the only files --overwrite removes.
CHECKPOINT_PATTERNS = ("*.safetensors", "*.safetensors.partial", "*.safetensors.index.json",
                       "hf_quant_config.json", MANIFEST, STATE, CALIB_STATE, *SIDE_FILES)
SLACK_BYTES = 16 << 20  # journals, manifest and config rewrites on top of the planned files


def _is_checkpoint_file(path: Path) -> bool:
    name = path.name[: -len(".tmp")] if path.name.endswith(".tmp") else path.name
    return path.is_file() and any(fnmatch.fnmatchcase(name, p) for p in CHECKPOINT_PATTERNS)


def _describe(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _fs_error(path: Path, what: str, exc: OSError) -> ConvertError:
    hint = "; is the disk full?" if exc.errno in (28, 27) else ""  # ENOSPC, EFBIG
    return ConvertError(f"{path}: {what} failed ({exc.strerror or exc}){hint}")


def write_state(out_dir: Path, state: dict) -> None:
    atomic_write_text(out_dir / STATE, json.dumps(state))


def atomic_write_text(path: Path, text: str) -> None:
    """`path` appears complete or not at all; on any error the temporary file is removed."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _fs_error(path, "writing", exc) from exc


def atomic_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _fs_error(dst, f"copying {src.name}", exc) from exc


def _make_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ConvertError(f"OUT_DIR {out_dir} is a file, not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConvertError(f"OUT_DIR {out_dir}: cannot create it ({exc.strerror or exc})") from exc


def _old_plan(out_dir: Path) -> str | None:
    if not (out_dir / STATE).is_file():
        return None
    try:
        return json.loads((out_dir / STATE).read_text())["plan_hash"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConvertError(f"{out_dir / STATE}: unreadable resume journal ({exc}); remove "
                           f"{out_dir} or pass --overwrite") from exc


def _refusal(out_dir: Path, entries: list[str], own: set[str], plan_hash: str) -> str | None:
    """Why OUT_DIR cannot be used as it is (None: it is empty or this conversion's own)."""
    if not entries:
        return None
    if MANIFEST in entries:
        return (f"{out_dir} already holds a finished conversion ({MANIFEST}); verify it with "
                "`beam-trt verify`, or pass --overwrite to replace it")
    old = _old_plan(out_dir)
    if old is not None and old != plan_hash:
        return (f"{out_dir} holds an interrupted conversion of other inputs or options; rerun "
                "that command to resume it, or pass --overwrite to start this one instead")
    foreign = [e for e in entries if e not in own]
    if old is None:
        return (f"OUT_DIR {out_dir} is not empty ({_describe(entries)}) and holds no "
                "interrupted conversion; choose an empty directory or pass --overwrite")
    if foreign:
        return (f"OUT_DIR {out_dir} holds an interrupted run of this conversion but also files "
                f"it does not write ({_describe(foreign)}); move them away to resume")
    return None


def _clear(out_dir: Path, entries: list[str]) -> None:
    """--overwrite: remove the checkpoint files; refuse (deleting nothing) if others remain."""
    keep = [e for e in entries if not _is_checkpoint_file(out_dir / e)]
    if keep:
        raise ConvertError(f"OUT_DIR {out_dir}: --overwrite removes only checkpoint files, and "
                           f"it also holds {_describe(keep)}; move them away or choose another "
                           "directory")
    for e in entries:
        try:
            (out_dir / e).unlink()
        except OSError as exc:
            raise ConvertError(f"{out_dir / e}: cannot remove it ({exc.strerror})") from exc


def _check_space(out_dir: Path, planned: dict[str, int]) -> None:
    present = sum((out_dir / n).stat().st_size for n in planned if (out_dir / n).is_file())
    need = sum(planned.values()) - present + SLACK_BYTES
    free = shutil.disk_usage(out_dir).free
    if need > free:
        raise ConvertError(f"OUT_DIR {out_dir}: the output needs {need / 1e9:.2f} GB more, the "
                           f"file system has {free / 1e9:.2f} GB free")


def own_names(planned: dict[str, int]) -> set[str]:
    """Every name this conversion may leave in OUT_DIR (finished, partial or temporary)."""
    names = set(planned) | {MANIFEST, STATE, CALIB_STATE, "config.json", "hf_quant_config.json"}
    names |= {n + ".partial" for n in planned if n.endswith(".safetensors")}
    return names | {n + ".tmp" for n in names}


def prepare_out_dir(out_dir: Path, plan_hash: str, planned: dict[str, int],
                    overwrite: bool) -> bool:
    """planned: every output file name -> its size. True when resuming an interrupted run."""
    _make_dir(out_dir)
    entries = sorted(os.listdir(out_dir))
    why = _refusal(out_dir, entries, own_names(planned), plan_hash)
    if why is not None and not overwrite:
        raise ConvertError(why)
    if why is not None or (overwrite and entries):
        _clear(out_dir, entries)
        entries = []
    resuming = bool(entries)
    _check_space(out_dir, planned)
    fresh = {"plan_hash": plan_hash, "next_unit": 0, "chain": "", "done": {}, "open": {}}
    try:  # rewriting the journal as it is proves OUT_DIR is still writable
        text = (out_dir / STATE).read_text() if resuming else json.dumps(fresh)
        atomic_write_text(out_dir / STATE, text)
    except ConvertError as exc:
        raise ConvertError(f"OUT_DIR {out_dir} is not writable: {exc}") from exc
    return resuming
