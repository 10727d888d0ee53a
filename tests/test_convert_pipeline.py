"""The converter end to end on the tiny Beam: TP/EP rank files reassemble to the unsharded
checkpoint, a killed run resumes to identical bytes, verify/dequant catch what they should."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from convert import ConvertError, dequant
from convert.dequantize import QuantizedCheckpoint
from convert.pipeline import ConvertOptions, convert
from convert.st_io import TensorFile
from convert.verification import verify

BEAM_TRT = [sys.executable, "-m", "beam_trtllm.cli"]


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file()}


@pytest.fixture(scope="module")
def hf_nvfp4(tiny_dir, tmp_path_factory):
    """nvfp4 + FP8 KV, calibrated on 2 x 16 tokens, the unsharded reference of the TP/EP test."""
    out = tmp_path_factory.mktemp("conv") / "hf"
    return convert(tiny_dir, out, ConvertOptions("nvfp4", "fp8", calib_samples=2, calib_seq_len=16))


def test_tp_ep_rank_files_reassemble_to_the_unsharded_checkpoint(tiny_dir, hf_nvfp4, tmp_path):
    # tiny: 4 query heads, 2 KV heads, 16 experts. tp 4 > 2 KV heads: each KV head on 2 ranks.
    out = convert(tiny_dir, tmp_path / "trt", ConvertOptions(
        "nvfp4", "fp8", fmt="trtllm", tp=4, ep=2, calib_samples=2, calib_seq_len=16))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mapping"] == {"world_size": 4, "tp_size": 4, "pp_size": 1, "moe_tp_size": 2,
                              "moe_ep_size": 2}
    assert cfg["quantization"]["quant_algo"] == "MIXED_PRECISION"
    ranks = [TensorFile(out / f"rank{r}.safetensors") for r in range(4)]
    k = "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(ranks[0].read(k).view(torch.uint8), ranks[1].read(k).view(torch.uint8))
    assert not torch.equal(ranks[1].read(k).view(torch.uint8), ranks[2].read(k).view(torch.uint8))
    for r, f in enumerate(ranks):  # expert e on ep rank e // 8 = r % 2 only
        experts = {int(n.split(".")[5]) for n in f.specs if ".experts." in n}
        assert experts == set(range(8 * (r % 2), 8 * (r % 2) + 8))
        assert f.specs["model.layers.1.mlp.experts.0.up_proj.weight" if r % 2 == 0 else
                       "model.layers.1.mlp.experts.8.up_proj.weight"][1] == (16, 32)  # moe_tp 2
    whole, sharded = QuantizedCheckpoint(hf_nvfp4), QuantizedCheckpoint(out)
    assert sorted(whole.names()) == sorted(sharded.names())
    for name in whole.names():
        a, b = whole.tensor(name), sharded.tensor(name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("tp,ep,flag", [(3, 1, "--tp 3"), (4, 3, "--ep 3"), (8, 1, "--tp 8")])
def test_tp_that_does_not_fit_the_heads_is_refused(tiny_dir, tmp_path, tp, ep, flag):
    with pytest.raises(ConvertError, match=flag):
        convert(tiny_dir, tmp_path / "x", ConvertOptions("nvfp4", fmt="trtllm", tp=tp, ep=ep,
                                                         calib_samples=0))
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_killed_run_resumes_to_identical_bytes(tiny_dir, tmp_path):
    args = [str(tiny_dir), "--quant", "nvfp4", "--kv-cache", "fp8", "--calib-samples", "2",
            "--calib-seq-len", "16", "--shard-size", "0.06"]
    ref = convert(tiny_dir, tmp_path / "ref", ConvertOptions(  # the same options, uninterrupted
        "nvfp4", "fp8", calib_samples=2, calib_seq_len=16, shard_size_mb=0.06))
    out = tmp_path / "out"
    env = dict(os.environ, BEAM_TRT_CONVERT_THROTTLE_S="0.03")
    proc = subprocess.Popen(BEAM_TRT + ["convert", args[0], str(out)] + args[1:], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # kill once some shards are finished, others partial
        if len(list(out.glob("model-*-of-*.safetensors"))) >= 3 and list(out.glob("*.partial")):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()
    assert (out / ".convert-state.json").exists()
    done = _hashes(out)
    resumed = subprocess.run(BEAM_TRT + ["convert", args[0], str(out)] + args[1:],
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at unit" in resumed.stderr and "reusing the amax" in resumed.stderr
    final = _hashes(out)
    assert {n: h for n, h in final.items() if n in done} == {n: done[n] for n in done
                                                              if n in final}  # kept as they were
    assert final == _hashes(ref)
    assert verify(out)["ok"]


def test_verify_reports_dequant_error_logits_and_catches_corruption(tiny_dir, hf_nvfp4, tmp_path):
    report = verify(hf_nvfp4, tiny_dir)
    assert report["ok"], report["problems"]
    by = report["tensors"]["by_format"]
    # Not a comparison tolerance: the expected size of quantization noise on Gaussian weights
    # (shared/research/modelopt.md §4 measured 0.095 for NVFP4 and 0.026 for FP8).
    assert 0.08 < by["nvfp4"]["mean_rel_err"] < 0.11 and 0.02 < by["fp8"]["mean_rel_err"] < 0.035
    assert 0 <= report["logits"]["kl_mean"] and 0 < report["logits"]["top1_agreement"] <= 1
    bad = tmp_path / "bad"
    shutil.copytree(hf_nvfp4, bad)
    blob = bytearray((bad / "model.safetensors").read_bytes())
    blob[-100] ^= 0x40
    (bad / "model.safetensors").write_bytes(bytes(blob))
    report = verify(bad)
    assert not report["ok"] and "sha256" in report["problems"][0]
    os.remove(bad / "manifest.json")
    with pytest.raises(ConvertError, match="did not finish"):
        verify(bad)


def test_dequant_of_an_unquantized_recipe_is_exact(tiny_dir, tmp_path, capsys):
    """An all-BF16 recipe: dequant returns the input bit for bit and the logits check gives
    KL 0 and full top-1 agreement (so the check can tell a perfect model from a broken one).
    Without calibration data the run says so on the console and in the manifest."""
    recipe = tmp_path / "bf16.yaml"
    recipe.write_text("name: bf16\nrules:\n  - {match: '*', format: none}\n")
    out = convert(tiny_dir, tmp_path / "o", ConvertOptions(str(recipe), calib_samples=0))
    assert "WARNING" in capsys.readouterr().err
    calibration = json.loads((out / "manifest.json").read_text())["calibration"]
    assert calibration["mode"] == "weight-only" and "--calib-samples 0" in calibration["reason"]
    from beam_trtllm.checkpoint import load_state_dict
    from beam_trtllm.config import BeamConfig

    state = dequant(out)
    src = load_state_dict(tiny_dir, BeamConfig.from_hf(tiny_dir))
    assert sorted(state) == sorted(src)
    assert all(torch.equal(state[n], src[n]) and state[n].dtype == src[n].dtype for n in src)
    logits = verify(out, tiny_dir)["logits"]
    assert logits["kl_mean"] == 0.0 and logits["top1_agreement"] == 1.0


def test_dequant_api_returns_the_bf16_layout(hf_nvfp4, tiny_dir):
    from beam_trtllm.checkpoint import expected_tensors
    from beam_trtllm.config import BeamConfig

    state = dequant(hf_nvfp4)
    expected = expected_tensors(BeamConfig.from_hf(tiny_dir))
    assert {n: (tuple(t.shape), t.dtype) for n, t in state.items()} == expected
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (hf_nvfp4 / side).read_bytes() == (tiny_dir / side).read_bytes()  # servable dir
    manifest = json.loads((hf_nvfp4 / "manifest.json").read_text())
    assert manifest["calibration"]["mode"] == "max" and manifest["tools"]["torch"]
    calibration = manifest["calibration"]
    assert calibration["experts_routed_per_layer"]  # coverage is reported, per expert too:
    cfg = BeamConfig.from_hf(tiny_dir)
    per_expert = calibration["tokens_per_expert"]
    assert sorted(map(int, per_expert)) == list(cfg.moe_layers)
    for counts in per_expert.values():  # 2 x 16 tokens, each routed to top-k experts
        assert len(counts) == cfg.num_experts and sum(counts) == 32 * cfg.num_experts_per_tok
    assert calibration["min_tokens_per_expert"] == min(min(c) for c in per_expert.values())
    assert calibration["documents"] and calibration["source"] == "builtin:calib.jsonl"
