"""`beam-trt convert --quant fp8-dynamic --format compressed-tensors`: the checkpoint the
compressed-tensors library's own flow writes (tests/ct_reference.py) byte for byte, read back
by the library within FP8's error, streamed, resumable after SIGKILL, verified, and built."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from ct_reference import ct_decompress, ct_export
from safetensors.torch import load_file

from beam_trtllm.checkpoint import SafetensorsCheckpoint
from convert import ConvertError, ConvertOptions, convert, verify

BEAM_TRT = [sys.executable, "-m", "beam_trtllm.cli"]
CT = dict(fmt="compressed-tensors", workers=1)


@pytest.fixture(scope="module")
def ours(tiny_dir, tmp_path_factory):
    return convert(tiny_dir, tmp_path_factory.mktemp("ct") / "ours",
                   ConvertOptions("fp8-dynamic", **CT))


def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


def test_same_checkpoint_as_the_library_flow(ours, tiny_dir, tmp_path):
    ref = ct_export(tiny_dir, tmp_path / "library", ignore=["lm_head"])
    a, b = load_file(str(ref / "model.safetensors")), load_file(str(ours / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), name
        assert torch.equal(_bytes(a[name]), _bytes(b[name])), name
    qa = json.loads((ref / "config.json").read_text())["quantization_config"]
    qb = json.loads((ours / "config.json").read_text())["quantization_config"]
    assert qa == qb and qb["quant_method"] == "compressed-tensors" and qb["ignore"] == ["lm_head"]
    assert not (ours / "hf_quant_config.json").exists()


def test_library_reads_it_back_within_fp8_error(ours, tiny_dir):
    src = SafetensorsCheckpoint(tiny_dir)
    decoded = ct_decompress(ours)
    assert len(decoded) == 6 * 5 + 2 * 3 + 4 * 16 * 3  # every decoder Linear; lm_head BF16
    for module, w in decoded.items():
        x = src.get(module + ".weight").float()
        rel = float((w.float() - x).norm() / x.norm())
        # per-channel E4M3 on Gaussian rows: ~0.025 (verify's FP8 limit is 0.06)
        assert rel < 0.035, (module, rel)
    report = verify(ours, tiny_dir)
    assert report["ok"], report["problems"]
    assert 0.02 < report["tensors"]["by_format"]["fp8_channel"]["mean_rel_err"] < 0.03
    manifest = json.loads((ours / "manifest.json").read_text())
    assert manifest["format"] == "compressed-tensors"
    assert manifest["calibration"]["mode"] == "dynamic"


def test_killed_run_resumes_to_identical_bytes(ours, tiny_dir, tmp_path):
    out = tmp_path / "out"
    args = ["convert", str(tiny_dir), str(out), "--quant", "fp8-dynamic", "--format",
            "compressed-tensors", "--shard-size", "0.1", "--workers", "1"]
    env = dict(os.environ, BEAM_TRT_CONVERT_THROTTLE_S="0.05")
    proc = subprocess.Popen(BEAM_TRT + args, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # kill once shards are finished and others partial
        if len(list(out.glob("model-*-of-*.safetensors"))) >= 2 and list(out.glob("*.partial")):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists() and (out / ".convert-state.json").exists()
    resumed = subprocess.run(BEAM_TRT + args, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at unit" in resumed.stderr
    assert verify(out, tiny_dir)["ok"]
    whole = SafetensorsCheckpoint(ours)
    sharded = SafetensorsCheckpoint(out)
    assert sorted(whole.infos) == sorted(sharded.infos)
    for name in whole.infos:
        assert torch.equal(_bytes(whole.get(name)), _bytes(sharded.get(name))), name


def test_it_builds_and_generates(ours, tmp_path):
    from engine_helpers import TINY_OPTS

    from beam_trtllm.engine.build import build_engine
    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.plan import BuildOptions
    from beam_trtllm.engine.types import SamplingParams

    engine = Engine.from_dir(build_engine(ours, tmp_path / "e", BuildOptions(**TINY_OPTS)),
                             device="cpu")
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0][
        "token_ids"]


@pytest.mark.parametrize("quant, fmt, kv, match", [
    ("fp8", "compressed-tensors", "none", "writes FP8_DYNAMIC.*fp8 \\(use --format hf\\)"),
    ("fp8-dynamic", "hf", "none", "add --format compressed-tensors"),
    ("fp8-dynamic", "compressed-tensors", "fp8", "--kv-cache fp8"),
])
def test_mismatched_recipe_and_format_are_refused(tiny_dir, tmp_path, quant, fmt, kv, match):
    with pytest.raises(ConvertError, match=match):
        convert(tiny_dir, tmp_path / "x", ConvertOptions(quant, kv, fmt, calib_samples=0))
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_info_reports_what_is_quantized_and_its_bytes(ours):
    from click.testing import CliRunner

    from beam_trtllm.cli import main

    out = CliRunner().invoke(main, ["info", str(ours), "--json"])
    assert out.exit_code == 0, out.output
    c = json.loads(out.output)["checkpoint"]
    assert c["scheme"].startswith("compressed-tensors FP8_DYNAMIC")
    assert c["linear_formats"]["fp8_channel"]["linears"] == 228
    assert c["linear_formats"]["bf16"]["linears"] == 1  # lm_head, in `ignore`
