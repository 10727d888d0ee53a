"""`beam-trt convert` + `verify --against` on checkpoints saved by transformers itself
(tests/hf_checkpoints.py): FP32, BF16, FP16 and fused-expert inputs of one model, every
shipped recipe, the `hf` and the `trtllm` (TP 2, EP 2) layouts, and the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from convert import ConvertError
from convert.dequantize import QuantizedCheckpoint
from convert.pipeline import ConvertOptions, convert
from convert.st_io import TensorFile
from convert.verification import verify

RECIPES = ["fp8", "fp8-block", "nvfp4", "nvfp4-all"]
CALIB = {"calib_samples": 2, "calib_seq_len": 16, "workers": 1}
GATE = "model.layers.1.self_attn.gate_proj.weight"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def hf(hf_checkpoints):
    """{"fp32", "bf16", "fp16", "fused"} dirs of one model (conftest's session fixture)."""
    return hf_checkpoints


@pytest.fixture(scope="module")
def converted(hf, tmp_path_factory):
    """(input kind, recipe) -> its hf-layout conversion with FP8 KV, made once per module."""
    root, done = tmp_path_factory.mktemp("converted"), {}

    def get(kind: str, recipe: str):
        if (kind, recipe) not in done:
            done[kind, recipe] = convert(hf[kind], root / f"{kind}-{recipe}",
                                         ConvertOptions(recipe, "fp8", **CALIB))
        return done[kind, recipe]
    return get


def _same_weights(a, b) -> None:
    ta, tb = TensorFile(a / "model.safetensors"), TensorFile(b / "model.safetensors")
    assert ta.specs == tb.specs
    for name in ta.specs:
        assert torch.equal(_bytes(ta.read(name)), _bytes(tb.read(name))), name


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp32_and_bf16_inputs_convert_to_the_same_checkpoint_and_verify(hf, converted, recipe):
    """An FP32 input is cast to BF16 at read, so it converts to the bytes of its BF16 cast (the
    BF16 checkpoint transformers saves from it); both verify against their input."""
    out32, out16 = converted("fp32", recipe), converted("bf16", recipe)
    _same_weights(out32, out16)
    quant_config = "hf_quant_config.json"
    assert (out32 / quant_config).read_text() == (out16 / quant_config).read_text()
    quant = json.loads((out16 / "hf_quant_config.json").read_text())["quantization"]
    assert quant["kv_cache_quant_algo"] == "FP8"
    gate = TensorFile(out16 / "model.safetensors").specs[GATE][0]  # the attention's output gate
    assert gate == {"fp8": torch.float8_e4m3fn, "fp8-block": torch.float8_e4m3fn,
                    "nvfp4": torch.float8_e4m3fn, "nvfp4-all": torch.uint8}[recipe]
    for kind, out in (("fp32", out32), ("bf16", out16)):
        report = verify(out, hf[kind])
        assert report["ok"], (kind, report["problems"])
        # Not comparison tolerances: the expected size of quantization noise on Gaussian weights
        # (shared/research/modelopt.md §4: 0.095 NVFP4, 0.026 FP8), which a tensor decoded into
        # the wrong rows or with the wrong scale would leave far behind.
        bands = {"fp8": (0.02, 0.035), "nvfp4": (0.08, 0.11)}
        for fmt, stats in report["tensors"]["by_format"].items():
            assert bands[fmt][0] < stats["mean_rel_err"] < bands[fmt][1], (kind, fmt, stats)
        assert report["logits"]["kl_mean"] > 0 and report["logits"]["tokens"] == 256


def test_fused_expert_input_converts_to_the_same_checkpoint(hf, converted):
    """mlp.experts.gate_up_proj / down_proj (as vLLM and SGLang also read them), read as
    per-expert byte ranges: the same output as the per-expert checkpoint of the same model."""
    _same_weights(converted("fused", "fp8"), converted("bf16", "fp8"))
    assert verify(converted("fused", "fp8"), hf["fused"])["ok"]


def test_fp16_input_converts_and_verifies(hf, tmp_path):
    out = convert(hf["fp16"], tmp_path / "out", ConvertOptions("nvfp4", "fp8", **CALIB))
    assert TensorFile(out / "model.safetensors").specs["lm_head.weight"][0] == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    report = verify(out, hf["fp16"])
    assert report["ok"], report["problems"]


def test_trtllm_tp2_ep2_splits_the_attention_gate_by_heads(hf, converted, tmp_path):
    out = convert(hf["bf16"], tmp_path / "trt", ConvertOptions(
        "nvfp4-all", "fp8", fmt="trtllm", tp=2, ep=2, **CALIB))
    assert verify(out, hf["bf16"])["ok"]
    whole, sharded = QuantizedCheckpoint(converted("bf16", "nvfp4-all")), QuantizedCheckpoint(out)
    assert sorted(whole.names()) == sorted(sharded.names())
    for name in whole.names():
        assert torch.equal(_bytes(whole.tensor(name)), _bytes(sharded.tensor(name))), name
    bias = "model.layers.1.self_attn.gate_bias"
    for r in range(2):  # 4 query heads of 16: rank r holds heads 2r, 2r + 1
        f = TensorFile(out / f"rank{r}.safetensors")
        assert f.specs[GATE][1] == (32, 32)  # NVFP4 packed [2 heads x 16 rows, 64 / 2]
        assert torch.equal(_bytes(f.read(GATE)), _bytes(whole.tensor(GATE)[32 * r: 32 * (r + 1)]))
        assert torch.equal(f.read(bias), whole.tensor(bias)[2 * r: 2 * (r + 1)])
        experts = {int(n.split(".")[5]) for n in f.specs if ".experts." in n}
        assert experts == set(range(4 * r, 4 * r + 4))  # ep 2: 8 experts, 4 a rank


def test_cli_convert_and_verify_against_the_input(hf, tmp_path):
    cli = [sys.executable, "-m", "beam_trtllm.cli"]
    out = tmp_path / "out"
    run = subprocess.run(cli + ["convert", str(hf["fp32"]), str(out), "--quant", "nvfp4",
                                "--kv-cache", "fp8", "--calib-samples", "2", "--calib-seq-len",
                                "16"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    run = subprocess.run(cli + ["verify", str(out), "--against", str(hf["fp32"])],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.rstrip().endswith("OK") and "top-1 agreement" in run.stdout


def test_fused_expert_tensor_of_the_wrong_shape_is_named(hf, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hf["fused"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name][:, :48].contiguous()  # [8, 48, 64]: not gate + up rows
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ConvertError, match=f"fused expert tensor {name} has shape "
                                           r"\[8, 48, 64\], config.json implies \[8, 64, 64\]"):
        convert(bad, tmp_path / "out", ConvertOptions("fp8", calib_samples=0))
