"""`beam-trt build` and engine-dir validation: the dir's contents, and every way a corrupted or
mismatched dir is refused with its reason."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_helpers import TINY_OPTS, tiny_engine_dir  # noqa: F401
from safetensors.torch import load_file, save_file

from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.engine_dir import check_device, read_engine_dir
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.types import EngineError


@pytest.fixture
def copy_dir(tiny_engine_dir, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, dst)
    return dst


def test_engine_dir_holds_everything_a_server_needs(tiny_engine_dir, tiny_dir):
    names = {p.name for p in tiny_engine_dir.iterdir()}
    assert {"engine.json", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    spec = json.loads((tiny_engine_dir / "engine.json").read_text())
    cfg = spec["config"]
    assert cfg == json.loads((tiny_dir / "config.json").read_text())
    assert spec["target"] == "cpu" and spec["options"]["block_size"] == 4
    plan = spec["kv_plan"]
    # default plan: max_batch sequences of max_seq_len, 3 full layers x K,V x 4 x 2 heads x 16
    assert plan["num_blocks"] == 4 * 160 // 4 and plan["bytes_per_block"] == 3 * 2 * 4 * 32 * 2
    assert plan["ring_bytes"] == 3 * 2 * 5 * 8 * 32 * 2
    assert len(spec["checkpoint"]["sha256"]) == 64 and spec["tools"]["torch"] == torch.__version__
    assert spec["kernels"]["autotune"]["status"].startswith("not applicable")
    layer1 = spec["quantization"]["layers"]["layer1"]
    assert layer1["self_attn.qkvg_proj"] == [{"format": "bf16", "rows": 64 + 32 + 32 + 64,
                                              "parts": ["self_attn.q_proj", "self_attn.k_proj",
                                                        "self_attn.v_proj",
                                                        "self_attn.gate_proj"]}]
    assert layer1["experts"] == "bf16"
    assert all(f in names for f in spec["files"])


def test_weights_are_repacked_for_the_ops(tiny_engine_dir, tiny_dir):
    from beam_trtllm.checkpoint import load_state_dict
    from beam_trtllm.config import BeamConfig

    cfg = BeamConfig.from_hf(tiny_dir)
    src = load_state_dict(tiny_dir, cfg)
    eng = {}
    for f in sorted(tiny_engine_dir.glob("weights-*.safetensors")):
        eng.update(load_file(f))
    p = "model.layers.2."
    qkvg = torch.cat([src[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v", "gate")])
    assert torch.equal(eng[p + "self_attn.qkvg_proj.0.weight"], qkvg)
    assert torch.equal(eng[p + "self_attn.gate_bias"], src[p + "self_attn.gate_bias"])
    e = 5
    w13 = torch.cat([src[p + f"mlp.experts.{e}.gate_proj.weight"], src[p + f"mlp.experts.{e}.up_proj.weight"]])
    assert torch.equal(eng[p + "mlp.experts.w13"][e], w13)
    assert torch.equal(eng[p + "mlp.experts.w2"][e], src[p + f"mlp.experts.{e}.down_proj.weight"])
    assert eng[p + "mlp.gate.weight"].dtype == torch.float32
    dense = torch.cat([src["model.layers.0.mlp.gate_proj.weight"], src["model.layers.0.mlp.up_proj.weight"]])
    assert torch.equal(eng["model.layers.0.mlp.gate_up_proj.0.weight"], dense)


@pytest.mark.parametrize("damage, reason", [
    ("flip", "does not match its SHA-256"),
    ("truncate", "bytes, engine.json says"),
    ("delete", "is missing"),
    ("config", "config.json differs from the config the engine was built with"),
    ("version", "format_version 99"),
    ("no-spec", "no engine.json"),
    ("bad-json", "engine.json: not valid JSON"),
])
def test_corrupted_or_mismatched_dir_is_refused(copy_dir, damage, reason):
    weights = sorted(copy_dir.glob("weights-*.safetensors"))[3]
    if damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0x40
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "delete":
        weights.unlink()
    elif damage == "config":
        cfg = json.loads((copy_dir / "config.json").read_text())
        cfg["sliding_window"] = 16
        (copy_dir / "config.json").write_text(json.dumps(cfg))
    elif damage == "version":
        spec = json.loads((copy_dir / "engine.json").read_text())
        spec["format_version"] = 99
        (copy_dir / "engine.json").write_text(json.dumps(spec))
    elif damage == "no-spec":
        (copy_dir / "engine.json").unlink()
    else:
        (copy_dir / "engine.json").write_text("{not json")
    with pytest.raises(EngineError, match=reason):
        Engine.from_dir(copy_dir, device="cpu")


def test_consistent_but_wrong_weights_are_refused(copy_dir):
    """A weights file replaced and its hash updated (a dir edited by hand): the tensors are
    checked against the plan and config."""
    weights = sorted(copy_dir.glob("weights-*.safetensors"))[2]
    tensors = load_file(weights)
    tensors["model.layers.1.extra.weight"] = torch.zeros(3)
    save_file(tensors, str(weights))
    spec = json.loads((copy_dir / "engine.json").read_text())
    spec["files"][weights.name]["bytes"] = weights.stat().st_size
    (copy_dir / "engine.json").write_text(json.dumps(spec))
    with pytest.raises(EngineError, match="unexpected tensor model.layers.1.extra.weight"):
        Engine.from_dir(copy_dir, device="cpu", verify=False)


def test_target_mismatch_is_refused(tiny_dir, tmp_path):
    opts = BuildOptions(**{**TINY_OPTS, "target": "sm90", "autotune": "off"})  # no search here
    engine_dir = build_engine(tiny_dir, tmp_path / "gpu", opts)
    spec = read_engine_dir(engine_dir)
    assert spec.raw["kernels"]["autotune"]["status"].startswith("off (--autotune off)")
    with pytest.raises(EngineError, match="built for --target sm90, but loading on the CPU"):
        check_device(spec, torch.device("cpu"))


def test_build_refuses_bad_inputs(tiny_dir, tmp_path):
    with pytest.raises(EngineError, match="fewer than one --max-seq-len 4096 sequence needs"):
        build_engine(tiny_dir, tmp_path / "a", BuildOptions(max_seq_len=4096, kv_memory_gib=1e-4))
    with pytest.raises(EngineError, match="--kv-dtype fp8 needs calibrated KV scales"):
        build_engine(tiny_dir, tmp_path / "b", BuildOptions(kv_dtype="fp8"))
    with pytest.raises(EngineError, match="--max-num-tokens .* must be >= --max-batch"):
        BuildOptions(max_batch=64, max_num_tokens=32)
    with pytest.raises(EngineError, match="--target must be one of"):
        BuildOptions(target="sm80")
    odd = tmp_path / "odd"
    shutil.copytree(tiny_dir, odd)
    shard = sorted(odd.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.rotary.inv_freq"] = torch.ones(8)
    save_file(tensors, str(shard))
    index = json.loads((odd / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.rotary.inv_freq"] = shard.name
    (odd / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EngineError, match="unexpected tensor model.layers.0.self_attn.rotary.inv_freq"):
        build_engine(odd, tmp_path / "c", BuildOptions(**TINY_OPTS))
    assert not (tmp_path / "c").exists() and not list(tmp_path.glob(".c.building-*"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("x")
    with pytest.raises(EngineError, match="exists and is not empty"):
        build_engine(tiny_dir, tmp_path / "d", BuildOptions(**TINY_OPTS))
