"""init-tiny output, strict checkpoint loading, tokenizer and the generate CLI."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from beam_trtllm.checkpoint import INDEX_NAME, CheckpointError, load_state_dict, weight_map
from beam_trtllm.cli import main
from beam_trtllm.config import PRESETS, BeamConfig
from beam_trtllm.reference import BeamForCausalLM
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
    assert sd["lm_head.weight"].dtype == torch.bfloat16


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
    probs = tiny_model(ids).softmax(-1)
    assert probs.max(-1).values.mean() < 0.5  # no single token dominates
    out = tiny_model.generate(torch.tensor([[3, 40, 200]]), 48)
    assert len(set(out[0, 3:].tolist())) >= 10


def test_tokenizer_and_chat_template(tiny_dir):
    tok = TextTokenizer(tiny_dir)
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert tok.tok.get_vocab_size() == cfg["vocab_size"]
    text = "def add(a, b):\n    return a + b  # ünïcode ✓"
    assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.token_id("<|im_end|>") in cfg["eos_token_id"]
    tc = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and "chat_template" in tc


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
        BeamForCausalLM.from_pretrained(ckpt)
    out = CliRunner().invoke(main, ["generate", str(ckpt), "--prompt", "hi"])
    assert out.exit_code == 1 and "Traceback" not in out.output
    assert message.replace("\\", "").split(" has")[0] in out.output


def test_missing_shard_and_truncated_shard(tiny_dir, tmp_path):
    ckpt = _copy(tiny_dir, tmp_path / "gone")
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        BeamForCausalLM.from_pretrained(ckpt)
    ckpt = _copy(tiny_dir, tmp_path / "cut")
    shard = ckpt / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        BeamForCausalLM.from_pretrained(ckpt)


def test_single_file_checkpoint_loads(tiny_dir, tmp_path, tiny_model):
    ckpt = tmp_path / "single"
    ckpt.mkdir()
    shutil.copy(tiny_dir / "config.json", ckpt)
    sd = load_state_dict(tiny_dir, PRESETS["tiny"].replace())
    save_file(sd, str(ckpt / "model.safetensors"))
    model = BeamForCausalLM.from_pretrained(ckpt)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(model(ids), tiny_model(ids))


def test_generate_cli_streams_text(tiny_dir):
    out = CliRunner().invoke(main, ["generate", str(tiny_dir), "--prompt", "def add(a, b):",
                                    "--max-new-tokens", "12"])
    assert out.exit_code == 0, out.output
    assert out.output.startswith("def add(a, b):") and len(out.output) > len("def add(a, b):") + 5
    chat = CliRunner().invoke(main, ["generate", str(tiny_dir), "--chat", "--prompt", "hello",
                                     "--max-new-tokens", "4", "--temperature", "0.7", "--seed", "1"])
    assert chat.exit_code == 0 and "<|im_start|>assistant" in chat.output


def test_init_tiny_cli(tmp_path):
    out = CliRunner().invoke(main, ["init-tiny", str(tmp_path / "t"), "--seed", "4"])
    assert out.exit_code == 0 and "tiny Beam" in out.output
    assert BeamConfig.from_hf(tmp_path / "t").num_hidden_layers == PRESETS["tiny"].num_hidden_layers
