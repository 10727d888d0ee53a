"""init-tiny output (a checkpoint transformers loads), strict checkpoint loading of every
layout a user brings (sharded or single file, per-expert or fused experts, FP32 / BF16 / FP16),
the errors for v1 and broken checkpoints, tokenizer and the generate CLI."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from beam_trtllm.checkpoint import INDEX_NAME, CheckpointError, load_state_dict, weight_map
from beam_trtllm.cli import main
from beam_trtllm.config import PRESETS, BeamConfig
from beam_trtllm.hf_model import load_model, logits, stream
from beam_trtllm.tiny import init_tiny
from beam_trtllm.tokenizer import TextTokenizer


def test_layout_and_dtypes(tiny_dir):
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            INDEX_NAME} <= names
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    sd = load_state_dict(tiny_dir, BeamConfig.from_hf(tiny_dir))
    assert sd["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert sd["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert sd["model.layers.1.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert sd["model.layers.1.self_attn.gate_proj.weight"].shape == (4 * 16, 64)
    assert sd["model.layers.1.self_attn.gate_bias"].abs().min() > 0  # nonzero: a test sees it
    assert sd["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0
    assert sd["lm_head.weight"].dtype == torch.bfloat16


def test_transformers_loads_init_tiny_exactly(tiny_dir, tiny_model):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(),
                    "error_msgs": []}
    ids = torch.randint(0, 508, (2, 40), generator=torch.Generator().manual_seed(5))
    assert torch.equal(logits(model, ids), logits(tiny_model, ids))


def test_deterministic_per_seed(tiny_dir, tmp_path):
    again = init_tiny(tmp_path / "again", seed=0)
    other = init_tiny(tmp_path / "other", seed=1)
    for p in tiny_dir.iterdir():
        assert (again / p.name).read_bytes() == p.read_bytes(), p.name
    a = load_file(str(tiny_dir / "model-00001-of-00003.safetensors"))
    b = load_file(str(other / "model-00001-of-00003.safetensors"))
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_realistic_scales_and_no_dominant_token(tiny_model):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (4, 32), generator=gen)
    probs = logits(tiny_model, ids).softmax(-1)
    assert probs.max(-1).values.mean() < 0.5  # no single token dominates
    out = [int(t[0]) for t in stream(tiny_model, torch.tensor([[3, 40, 200]]), 48)]
    assert len(set(out)) >= 10


def test_tokenizer_and_chat_template(tiny_dir):
    tok = TextTokenizer(tiny_dir)
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert tok.tok.get_vocab_size() == cfg["vocab_size"]
    text = "def add(a, b):\n    return a + b  # ünïcode ✓"
    assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|start|>user<|message|>hi<|end|><|start|>assistant"
    assert tok.token_id("<|return|>") in cfg["eos_token_id"]
    tc = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|return|>" and "chat_template" in tc


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_first_shard(ckpt, edit):
    wm = weight_map(ckpt)
    shard = wm["model.embed_tokens.weight"]
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard))
    index = json.loads((ckpt / INDEX_NAME).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                           if v != shard.name or k in tensors}
    index["weight_map"].update({k: shard.name for k in tensors})
    (ckpt / INDEX_NAME).write_text(json.dumps(index))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.0.self_attn.k_norm.weight"),
         "missing tensor model.layers.0.self_attn.k_norm.weight"),
        (lambda t: t.__setitem__("model.layers.0.self_attn.bogus.weight", torch.zeros(2)),
         "unexpected tensor model.layers.0.self_attn.bogus.weight"),
        (lambda t: t.__setitem__("model.embed_tokens.weight", torch.zeros(512, 32)),
         r"tensor model.embed_tokens.weight has shape \[512, 32\]"),
    ],
)
def test_bad_checkpoints_name_the_tensor(tiny_dir, tmp_path, edit, message):
    ckpt = _copy(tiny_dir, tmp_path / "bad")
    _rewrite_first_shard(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt)
    out = CliRunner().invoke(main, ["generate", str(ckpt), "--prompt", "hi"])
    assert out.exit_code == 1 and "Traceback" not in out.output
    assert message.replace("\\", "").split(" has")[0] in out.output


def test_missing_shard_and_truncated_shard(tiny_dir, tmp_path):
    ckpt = _copy(tiny_dir, tmp_path / "gone")
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        load_model(ckpt)
    ckpt = _copy(tiny_dir, tmp_path / "cut")
    shard = ckpt / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        load_model(ckpt)


def test_single_file_checkpoint_loads(tiny_dir, tmp_path, tiny_model):
    ckpt = tmp_path / "single"
    ckpt.mkdir()
    shutil.copy(tiny_dir / "config.json", ckpt)
    sd = load_state_dict(tiny_dir, PRESETS["tiny"].replace())
    save_file(sd, str(ckpt / "model.safetensors"))
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(logits(load_model(ckpt), ids), logits(tiny_model, ids))


def test_float_dtypes_and_fused_experts_load_as_the_same_model(tiny_dir, tmp_path, hf_checkpoints):
    """FP32 and FP16 files and transformers' fused in-memory expert layout are read."""
    from beam_trtllm.checkpoint import SafetensorsCheckpoint

    sd = load_state_dict(tiny_dir, PRESETS["tiny"])
    ids = torch.randint(0, 508, (1, 20), generator=torch.Generator().manual_seed(6))
    for dtype in (torch.float32, torch.float16):
        ckpt = tmp_path / str(dtype)
        ckpt.mkdir()
        shutil.copy(tiny_dir / "config.json", ckpt)
        save_file({k: v if ".mlp.gate." in k else v.to(dtype) for k, v in sd.items()},
                  str(ckpt / "model.safetensors"))
        want = load_model(tiny_dir) if dtype == torch.float32 else None
        got = logits(load_model(ckpt), ids)
        if want is not None:  # BF16 values are exact in FP32
            assert torch.equal(got, logits(want, ids))
    fused = SafetensorsCheckpoint(hf_checkpoints["fused"])
    assert fused.views and "model.layers.1.mlp.experts.3.up_proj.weight" in fused.infos
    per_expert = SafetensorsCheckpoint(hf_checkpoints["bf16"])
    for name in ("model.layers.1.mlp.experts.3.gate_proj.weight",
                 "model.layers.1.mlp.experts.3.up_proj.weight",
                 "model.layers.3.mlp.experts.7.down_proj.weight"):
        assert torch.equal(fused.get(name), per_expert.get(name)), name
    assert torch.equal(logits(load_model(hf_checkpoints["fused"]), ids),
                       logits(load_model(hf_checkpoints["bf16"]), ids))


def _as_v1(tensors):
    """beam-trt's pre-canonical layout: a per-head g_proj [Hq, H], no gate_proj / gate_bias."""
    for name in [n for n in tensors if n.endswith("self_attn.gate_proj.weight")]:
        tensors[name.replace("gate_proj", "g_proj")] = tensors.pop(name)[::16].contiguous()
        tensors.pop(name.replace("gate_proj.weight", "gate_bias"))


def test_v1_checkpoint_and_wrong_gate_are_refused(tiny_dir, tmp_path):
    ckpt = tmp_path / "v1"
    ckpt.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, ckpt)
    sd = load_state_dict(tiny_dir, PRESETS["tiny"])
    _as_v1(sd)
    save_file(sd, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="g_proj gate of beam-trt's pre-canonical Beam"):
        load_model(ckpt)
    out = CliRunner().invoke(main, ["build", str(ckpt), str(tmp_path / "e")])
    assert out.exit_code == 1 and "pre-canonical" in out.output and "Traceback" not in out.output
    bad = _copy(tiny_dir, tmp_path / "bad-gate")
    _rewrite_first_shard(bad, lambda t: t.__setitem__(
        "model.layers.0.self_attn.gate_proj.weight", torch.zeros(4, 64, dtype=torch.bfloat16)))
    with pytest.raises(CheckpointError, match=r"tensor model.layers.0.self_attn.gate_proj.weight "
                                              r"has shape \[4, 64\], config.json implies \[64, 64\]"):
        load_model(bad)
    out = CliRunner().invoke(main, ["build", str(bad), str(tmp_path / "e2")])
    assert out.exit_code == 1 and "model.layers.0.self_attn.gate_proj.weight" in out.output


def test_generate_cli_streams_text(tiny_dir):
    out = CliRunner().invoke(main, ["generate", str(tiny_dir), "--prompt", "def add(a, b):",
                                    "--max-new-tokens", "12"])
    assert out.exit_code == 0, out.output
    assert out.output.startswith("def add(a, b):") and len(out.output) > len("def add(a, b):") + 5
    chat = CliRunner().invoke(main, ["generate", str(tiny_dir), "--chat", "--prompt", "hello",
                                     "--max-new-tokens", "4", "--temperature", "0.7", "--seed", "1"])
    assert chat.exit_code == 0 and "<|start|>assistant" in chat.output


def test_generate_cli_runs_a_transformers_checkpoint(hf_checkpoints):
    for kind in ("fp32", "bf16"):
        out = CliRunner().invoke(main, ["generate", str(hf_checkpoints[kind]), "--prompt",
                                        "def add(a, b):", "--max-new-tokens", "6"])
        assert out.exit_code == 0, out.output


def test_init_tiny_cli(tmp_path):
    out = CliRunner().invoke(main, ["init-tiny", str(tmp_path / "t"), "--seed", "4"])
    assert out.exit_code == 0 and "tiny Beam" in out.output
    assert BeamConfig.from_hf(tmp_path / "t").num_hidden_layers == PRESETS["tiny"].num_hidden_layers


def test_info_cli_on_a_transformers_checkpoint(hf_checkpoints):
    from transformers import BeamForCausalLM

    for kind in ("fp32", "bf16"):
        out = CliRunner().invoke(main, ["info", str(hf_checkpoints[kind]), "--json"])
        assert out.exit_code == 0, out.output
        model = BeamForCausalLM.from_pretrained(hf_checkpoints[kind])
        counted = sum(t.numel() for n, t in [*model.named_parameters(), *model.named_buffers()]
                      if "rotary_emb" not in n)
        report = json.loads(out.output)
        assert report["total_params"] == counted
        assert report["dense_layers"] == [0, 2] and report["moe_layers"] == [1, 3]
