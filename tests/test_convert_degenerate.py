"""Degenerate weights: all-zero experts and Linears against ModelOpt 0.47's own export, and
`verify --against` failing (exit status 1, naming the tensor) on every inf / NaN it can meet."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from convert.calib_data import load_calib_tokens
from convert.pipeline import ConvertOptions, convert
from convert.st_io import TensorFile, sha256_file
from convert.verification import verify
from modelopt_reference import modelopt_export

SAMPLES, SEQ = 2, 32
L1, L2, L3 = "model.layers.1.mlp.", "model.layers.2.mlp.", "model.layers.3.mlp."
ZEROED = [L1 + f"experts.3.{p}_proj.weight" for p in ("gate", "up", "down")]  # a dead expert
ZEROED += [L2 + "experts.5.down_proj.weight",  # half dead: gate/up keep their scale
           L3 + "gate_proj.weight", L3 + "up_proj.weight"]  # dense: down_proj's input is 0
NVFP4_ZERO_SCALE_2 = torch.tensor(6.0) / 2688.0  # amax 0 -> maxbound 6 (docs/CONVERT.md)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _tensors(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def zero_ckpt(tiny_dir, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("zero") / "in"
    shutil.copytree(tiny_dir, d)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in sorted({index[n] for n in ZEROED}):
        tensors = load_file(str(d / shard))
        for name in ZEROED:
            if name in tensors:
                tensors[name] = torch.zeros_like(tensors[name])
        save_file(tensors, str(d / shard))
    return d


def _modelopt_undefined(ref: dict, module: str) -> bool:
    """ModelOpt's export of this Linear holds NaN or a zero weight scale (0/0)."""
    parts = [ref[module + s] for s in (".weight", ".weight_scale", ".weight_scale_2") if
             module + s in ref]
    nan = any(p.is_floating_point() and torch.isnan(p.float()).any() for p in parts)
    return nan or any(float(ref[module + s]) == 0 for s in (".weight_scale", ".weight_scale_2")
                      if module + s in ref and ref[module + s].dim() == 0)


def _our_choice(ours: dict, module: str) -> None:
    """An all-zero weight: zero codes, FP8 scale 1.0; NVFP4 scale_2 1/448, block scales 1.0."""
    assert not _bytes(ours[module + ".weight"]).any(), module
    if module + ".weight_scale_2" in ours:
        assert torch.equal(ours[module + ".weight_scale_2"], NVFP4_ZERO_SCALE_2), module
        assert (ours[module + ".weight_scale"].float() == 1.0).all(), module
    else:
        assert float(ours[module + ".weight_scale"]) == 1.0, module


@pytest.mark.parametrize("recipe", ["fp8", "fp8-block", "nvfp4", "nvfp4-all"])
def test_all_zero_weights_match_modelopt_where_it_defines_them(modelopt, zero_ckpt, tmp_path,
                                                               recipe):
    tokens = load_calib_tokens(zero_ckpt, None, SAMPLES, SEQ)
    ref_dir = modelopt_export(zero_ckpt, tmp_path / "modelopt", recipe, False, [tokens.ids])
    out = convert(zero_ckpt, tmp_path / "ours", ConvertOptions(
        recipe, calib_samples=SAMPLES, calib_seq_len=SEQ, workers=2))
    ref, ours = _tensors(ref_dir / "model.safetensors"), _tensors(out / "model.safetensors")
    assert sorted(ref) == sorted(ours)
    differ = {n.rsplit(".", 1)[0] for n in ref if not torch.equal(_bytes(ref[n]), _bytes(ours[n]))}
    zero_modules = {n[: -len(".weight")] for n in ZEROED}
    assert differ <= zero_modules, differ - zero_modules  # every other byte is ModelOpt's
    if recipe == "fp8-block":
        assert not differ  # ModelOpt defines zero blocks: scale 1.0, zero codes
    for module in differ:
        assert _modelopt_undefined(ref, module), module
        _our_choice(ours, module)
    for name, t in ours.items():  # nothing we write is NaN
        assert not (t.is_floating_point() and torch.isnan(t.float()).any()), name
    if recipe in ("fp8", "nvfp4"):  # down_proj of layer 3 saw only zeros: ModelOpt's rule
        scale = ours[L3 + "down_proj.input_scale"].item()
        assert scale == (1.0 if recipe == "fp8" else float(NVFP4_ZERO_SCALE_2)) == \
            ref[L3 + "down_proj.input_scale"].item()
    report = verify(out, zero_ckpt)
    assert report["ok"], report["problems"]


# ---------------------------------------------------------------------------- verify and NaN
@pytest.fixture(scope="module")
def converted(tiny_dir, tmp_path_factory) -> Path:
    return convert(tiny_dir, tmp_path_factory.mktemp("nan") / "out", ConvertOptions(
        "nvfp4", "fp8", calib_samples=SAMPLES, calib_seq_len=16, workers=2))


def _poison(out: Path, name: str, fill) -> None:
    """Overwrite tensor `name` in place (fill(t) -> new bytes) and re-sign the manifest, as if
    the converter itself had written it: only the value checks of --against can catch it."""
    path = out / "model.safetensors"
    start, nbytes = TensorFile(path).offsets[name]
    blob = bytearray(path.read_bytes())
    blob[start: start + nbytes] = fill(bytes(blob[start: start + nbytes]))
    path.write_bytes(bytes(blob))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"][path.name].update(size=path.stat().st_size, sha256=sha256_file(path))
    (out / "manifest.json").write_text(json.dumps(manifest))


NAN_F32 = b"\x00\x00\xc0\x7f"
CASES = {  # tensor, new bytes, what the problem line says
    "fp8-weight-nan": ("model.layers.0.self_attn.q_proj.weight",
                       lambda b: b"\x7f" + b[1:], "decodes to 1 inf/NaN"),
    "nvfp4-block-scale-nan": ("model.layers.1.mlp.experts.2.up_proj.weight_scale",
                              lambda b: b"\xff" + b[1:], "1 NaN block scales"),
    "scale-2-nan": ("model.layers.0.mlp.down_proj.weight_scale_2", lambda b: NAN_F32,
                    "is not a positive finite number"),
    "input-scale-zero": ("model.layers.1.self_attn.o_proj.input_scale",
                         lambda b: bytes(4), "is not a positive finite number"),
    "kv-scale-inf": ("model.layers.2.self_attn.k_proj.k_scale", lambda b: b"\x00\x00\x80\x7f",
                     "is not a finite number"),
    "bf16-norm-nan": ("model.layers.0.input_layernorm.weight", lambda b: b"\xc0\x7f" + b[2:],
                      "holds 1 inf/NaN values"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_verify_fails_on_nan_naming_the_tensor(converted, tiny_dir, tmp_path, case):
    name, fill, says = CASES[case]
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    _poison(out, name, fill)
    report = verify(out, tiny_dir)
    assert not report["ok"]
    assert any(name in p and says in p for p in report["problems"]), report["problems"]
    if case in ("fp8-weight-nan", "bf16-norm-nan"):  # the model on it gives NaN logits too
        assert any(p.startswith("logits:") for p in report["problems"]), report["problems"]


def test_verify_cli_exit_status_and_nan_input(converted, tiny_dir, tmp_path):
    """The CLI exits 1 naming the tensor; NaN in the input (same header, changed data) too."""
    from beam_trtllm.cli import main

    out = tmp_path / "out"
    shutil.copytree(converted, out)
    name = "model.layers.0.self_attn.v_proj.weight"
    _poison(out, name, lambda b: b"\xff" * 8 + b[8:])
    run = CliRunner().invoke(main, ["verify", str(out), "--against", str(tiny_dir)])
    assert run.exit_code == 1 and "FAILED" in run.output and name in run.output
    bad_in = tmp_path / "in"
    shutil.copytree(tiny_dir, bad_in)
    q = "model.layers.1.self_attn.q_proj.weight"
    shard = bad_in / json.loads((bad_in / "model.safetensors.index.json").read_text()
                                )["weight_map"][q]
    start, _ = TensorFile(shard).offsets[q]
    blob = bytearray(shard.read_bytes())
    blob[start: start + 2] = b"\xc0\x7f"  # BF16 NaN
    shard.write_bytes(bytes(blob))
    report = verify(converted, bad_in)
    assert not report["ok"]
    assert any(q in p and "the input holds 1 inf/NaN" in p for p in report["problems"])
