"""Every bad input ends in one ConvertError naming the file / tensor / flag, leaves no
manifest.json and never touches the input. The CLI shows it as `Error: ...` (no traceback)."""

from __future__ import annotations

import hashlib
import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from convert import ConvertError
from convert.pipeline import ConvertOptions, convert
from convert.st_io import TensorFile

Q = "model.layers.0.self_attn.q_proj.weight"
GATE = "model.layers.0.self_attn.gate_proj"  # the attention's output gate [Hq*D, H] ...
GATE_BIAS = "model.layers.0.self_attn.gate_bias"  # ... and its per-head bias [Hq]


def _digest(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _shard_of(ckpt: Path, name: str) -> Path:
    return ckpt / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _missing_shard(d):
    _shard_of(d, Q).unlink()
    return _shard_of(d, Q).name


def _truncated(d):
    p = _shard_of(d, Q)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    return f"{p.name}: truncated"


def _corrupt_header(d):
    p = _shard_of(d, Q)
    blob = bytearray(p.read_bytes())
    blob[20:60] = b"\x00\xff" * 20
    p.write_bytes(bytes(blob))
    return f"{p.name}: corrupted"


def _nan_data(d):
    p = _shard_of(d, Q)
    start, nbytes = TensorFile(p).offsets[Q]
    blob = bytearray(p.read_bytes())
    blob[start: start + 64] = b"\xff" * 64  # BF16 0xffff is NaN
    p.write_bytes(bytes(blob))
    return f"{Q} holds inf or NaN"


def _nan_norm(d):
    """A copied (unquantized) tensor: refused as well, not passed through."""
    norm = "model.layers.0.input_layernorm.weight"
    _rewrite(_shard_of(d, norm), lambda t: t[norm].__setitem__(3, float("inf")))
    return f"{norm} holds inf or NaN"


def _wrong_shape(d):
    _rewrite(_shard_of(d, Q), lambda t: t.__setitem__(Q, t[Q].reshape(32, 128).contiguous()))
    return f"{Q} has shape \\[32, 128\\], config.json implies \\[64, 64\\]"


def _wrong_dtype(d):  # FP32, BF16 and FP16 are read (cast to BF16); integers are not weights
    _rewrite(_shard_of(d, Q), lambda t: t.__setitem__(Q, t[Q].to(torch.int32)))
    return f"{Q} has dtype I32; an unquantized Beam checkpoint holds F32, BF16 or F16"


def _drop(d: Path, name: str) -> None:
    _rewrite(_shard_of(d, name), lambda t: t.__delitem__(name))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _v1_gate(d):
    """beam-trt's pre-canonical model: a per-head g_proj [Hq, H] and no gate_bias."""
    gate, v1 = GATE + ".weight", GATE[: -len("gate_proj")] + "g_proj.weight"
    _rewrite(_shard_of(d, gate), lambda t: t.__setitem__(v1, t.pop(gate)[::16].contiguous()))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"][v1] = index["weight_map"].pop(gate)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _drop(d, GATE_BIAS)
    return f"tensor {v1} is the per-head g_proj gate of beam-trt's pre-canonical Beam \\(v1\\)"


def _v1_config(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["n_routed_experts"] = cfg.pop("num_experts")
    (d / "config.json").write_text(json.dumps(cfg))
    return "pre-canonical Beam \\(v1 field 'n_routed_experts'"


def _gate_per_head(d):
    """The canonical name with v1's shape: one gate row per head instead of per element."""
    name = GATE + ".weight"
    _rewrite(_shard_of(d, name), lambda t: t.__setitem__(name, t[name][::16].contiguous()))
    return (f"{name} has shape \\[4, 64\\], config.json implies \\[64, 64\\] \\(one row per "
            "head")


def _gate_bias_missing(d):
    _drop(d, GATE_BIAS)
    return f"missing tensor {GATE_BIAS} \\(config.json implies it\\)"


def _unknown_name(d):
    bogus = "model.layers.0.self_attn.bogus.weight"
    _rewrite(_shard_of(d, Q), lambda t: t.__setitem__(bogus, torch.zeros(4, dtype=torch.bfloat16)))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"][bogus] = _shard_of(d, Q).name
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return f"unknown tensor name {bogus}"


def _config_mismatch(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    return "mlp.gate_proj.weight has shape \\[128, 64\\], config.json implies \\[96, 64\\]"


def _config_invalid(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_attention_heads"] = 5
    (d / "config.json").write_text(json.dumps(cfg))
    return "num_attention_heads \\(5\\) is not divisible by num_key_value_heads"


CASES = {f.__name__[1:]: f for f in (_missing_shard, _truncated, _corrupt_header, _nan_data,
                                     _nan_norm, _wrong_shape, _wrong_dtype, _unknown_name, _config_mismatch,
                                     _config_invalid, _v1_gate, _v1_config, _gate_per_head,
                                     _gate_bias_missing)}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_named_and_nothing_is_written(tiny_dir, tmp_path, case):
    bad = tmp_path / "in"
    shutil.copytree(tiny_dir, bad)
    expect = CASES[case](bad)
    before = _digest(bad)
    with pytest.raises(ConvertError, match=expect):
        convert(bad, tmp_path / "out", ConvertOptions("nvfp4", "fp8", calib_samples=1,
                                                      calib_seq_len=8))
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert _digest(bad) == before


def test_flags_and_dirs_are_checked(tiny_dir, tmp_path):
    before = _digest(tiny_dir)
    with pytest.raises(ConvertError, match="is the input directory"):
        convert(tiny_dir, tiny_dir, ConvertOptions("nvfp4", calib_samples=0))
    with pytest.raises(ConvertError, match="--quant 'int3'"):
        convert(tiny_dir, tmp_path / "o", ConvertOptions("int3", calib_samples=0))
    with pytest.raises(ConvertError, match="--calib-data /nonexistent.txt"):
        convert(tiny_dir, tmp_path / "o", ConvertOptions("nvfp4", calib_data="/nonexistent.txt"))
    if not torch.cuda.is_available():
        with pytest.raises(ConvertError, match="--device cuda"):
            convert(tiny_dir, tmp_path / "o", ConvertOptions("nvfp4", device="cuda"))
    with pytest.raises(ConvertError, match="add --format trtllm"):
        convert(tiny_dir, tmp_path / "o", ConvertOptions("nvfp4", tp=2, calib_samples=0))
    assert _digest(tiny_dir) == before


def test_disk_full_is_one_clear_error_without_traceback(tiny_dir, tmp_path):
    """RLIMIT_FSIZE makes a write fail with EFBIG as a full disk fails with ENOSPC."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "beam_trtllm.cli", "convert", str(tiny_dir),
                          str(out), "--quant", "nvfp4", "--calib-data", "none"],
                         preexec_fn=limit, capture_output=True, text=True)
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "is the disk full?" in errors[0] and ".partial" in errors[0]
    assert "Traceback" not in run.stderr
    assert not (out / "manifest.json").exists()
