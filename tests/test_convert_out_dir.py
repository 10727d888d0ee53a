"""OUT_DIR checks, all before calibration: a non-empty directory that is not this conversion's
own interrupted output is refused naming what is there (`overwrite` removes checkpoint files
only), a file / unwritable / too small OUT_DIR is one clear error, and a full disk at any point
(weights, side files) is resumed by the same command without calibrating again."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import shutil
import tempfile
from pathlib import Path

import pytest

from convert import ConvertError
from convert.pipeline import ConvertOptions, convert
from convert.verification import verify

OPTS = dict(calib_samples=2, calib_seq_len=16, workers=2)


def _digest(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file()}


def _refused(tiny_dir, out, capsys, match, kept_manifest=False, options=None, **opts):
    before = _digest(tiny_dir)
    capsys.readouterr()  # what earlier steps printed
    with pytest.raises(ConvertError, match=match):
        convert(tiny_dir, out, options or ConvertOptions("nvfp4", **(OPTS | opts)))
    assert "calibration:" not in capsys.readouterr().err  # refused before any work
    assert _digest(tiny_dir) == before
    assert (out / "manifest.json").exists() == kept_manifest


def test_non_empty_out_dir_is_refused_naming_what_is_there(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model.safetensors.index.json").write_text("{}")  # stale, of another checkpoint
    _refused(tiny_dir, out, capsys, r"is not empty \(model.safetensors.index.json, notes.txt\)")
    # --overwrite deletes checkpoint files only: notes.txt is not one, so nothing is removed
    _refused(tiny_dir, out, capsys, "--overwrite removes only checkpoint files, and it also "
                                    "holds notes.txt", overwrite=True)
    assert sorted(os.listdir(out)) == ["model.safetensors.index.json", "notes.txt"]
    (out / "notes.txt").unlink()
    for stale in ("model-00001-of-00009.safetensors", "model-00002-of-00009.safetensors.partial",
                  "config.json.tmp"):
        (out / stale).write_bytes(b"stale")
    convert(tiny_dir, out, ConvertOptions("nvfp4", overwrite=True, **OPTS))
    manifest = json.loads((out / "manifest.json").read_text())
    listed = set(manifest["files"]) | set(manifest["side_files"]) | {"manifest.json"}
    assert set(os.listdir(out)) == listed  # no stale shard, index or temporary file left
    assert verify(out)["ok"]
    # a finished conversion is refused, and replaced with --overwrite
    _refused(tiny_dir, out, capsys, "already holds a finished conversion", kept_manifest=True)
    convert(tiny_dir, out, ConvertOptions("fp8", overwrite=True, **OPTS))
    assert json.loads((out / "manifest.json").read_text())["recipe"]["name"] == "fp8"


def test_interrupted_conversion_of_other_options_is_refused(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    state = {"plan_hash": "another plan", "next_unit": 3, "chain": "", "done": {}, "open": {}}
    (out / ".convert-state.json").write_text(json.dumps(state))
    _refused(tiny_dir, out, capsys, "interrupted conversion of other inputs or options")


@contextlib.contextmanager
def file_size_limit(limit: int):
    """RLIMIT_FSIZE (soft) in this process: a write past `limit` bytes fails with EFBIG, as a
    full disk fails with ENOSPC (convert() ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_full_disk_at_weights_then_side_files_resumes_without_recalibrating(tiny_dir, tmp_path,
                                                                            capsys):
    """1: a weight shard cannot grow past 50 KB (before the first journal commit); then a
    foreign file in the interrupted output is refused; 2: the weights fit, the 300 KB
    tokenizer.model does not; 3: room. No manifest and no temporary file after a failure; the
    reruns reuse the journaled calibration; the result equals an uninterrupted conversion."""
    src = tmp_path / "in"
    shutil.copytree(tiny_dir, src)
    (src / "tokenizer.model").write_bytes(bytes(range(256)) * 1200)
    out = tmp_path / "out"
    opts = ConvertOptions("nvfp4", "fp8", shard_size_mb=0.1, **OPTS)
    for limit, where in ((50_000, ".partial"), (150_000, "tokenizer.model")):
        with file_size_limit(limit), pytest.raises(ConvertError, match=f"{where}.*is the disk "
                                                                       "full?"):
            convert(src, out, opts)
        err = capsys.readouterr().err
        assert ("reusing the amax" in err) == (limit == 150_000), err
        assert not (out / "manifest.json").exists() and not list(out.glob("*.tmp"))
        if limit == 50_000:
            (out / "scratch.bin").write_bytes(b"x")
            _refused(src, out, capsys, r"also files it does not write \(scratch.bin\)",
                     options=opts)
            (out / "scratch.bin").unlink()
    convert(src, out, opts)
    assert "reusing the amax" in capsys.readouterr().err
    ref = convert(src, tmp_path / "ref", opts)
    assert _digest(out) == _digest(ref)
    assert verify(out, src)["ok"]


def test_out_dir_that_is_a_file_or_under_a_file(tiny_dir, tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    _refused(tiny_dir, f, capsys, f"OUT_DIR {f} is a file, not a directory")
    _refused(tiny_dir, f / "sub", capsys, f"OUT_DIR {f / 'sub'}: cannot create it")
    assert f.read_text() == "x"


@contextlib.contextmanager
def unprivileged():
    """Root ignores file modes: run the block with effective uid `nobody` (restored after)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_read_only_out_dir_is_refused_before_calibration(tiny_dir, capsys):
    base = Path(tempfile.mkdtemp(prefix="beam-ro-"))  # world-readable, unlike pytest's tmp
    try:
        base.chmod(0o755)
        shutil.copytree(tiny_dir, base / "in")
        (base / "in").chmod(0o755)
        out = base / "out"
        out.mkdir()
        out.chmod(0o555)
        _refused(base / "in", base / "in" / "config.json", capsys, "is a file")  # imports
        with unprivileged():
            _refused(base / "in", out, capsys, f"{out}.*Permission denied")
        assert os.listdir(out) == []
    finally:
        shutil.rmtree(base)


def test_too_little_free_space_is_refused_before_calibration(tiny_dir, tmp_path, capsys,
                                                             monkeypatch):
    import convert.outdir

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(convert.outdir.shutil, "disk_usage",
                        lambda p: usage._replace(free=1_000_000))
    out = tmp_path / "out"
    _refused(tiny_dir, out, capsys, rf"OUT_DIR {out}: the output needs 0.0\d GB more, the file "
                                    r"system has 0.00 GB free")
