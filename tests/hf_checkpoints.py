"""Tiny canonical Beam checkpoints saved by transformers itself (not by beam-trt), for tests.

    from hf_checkpoints import write_hf_checkpoints
    dirs = write_hf_checkpoints(tmp_dir, tokenizer_dir=tiny_dir)  # a `beam-trt init-tiny` dir
    dirs["fp32"]   # BeamForCausalLM(config).save_pretrained: FP32 tensors, sharded with an index
    dirs["bf16"]   # from_pretrained(fp32, dtype=bfloat16).save_pretrained: BF16, router FP32
    dirs["fp16"]   # the same with dtype=float16
    dirs["fused"]  # the BF16 model's in-memory state dict as is: fused experts
                   # (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]), as vLLM/SGLang read

All hold the same model (the BF16 and FP16 ones its round-to-nearest cast), with the init-tiny
tokenizer files and token ids. `canonical_config()` is the transformers BeamConfig they use:
hidden 64, 4 layers (sliding/full s F s F, dense/sparse D S D S), 8 experts in 4 groups
(topk_group 2, top-2), heads 4/2 of 16, window 8, vocab 512, softcap 30. `random_model()`
fills a BeamForCausalLM with weights at realistic scales (embeddings N(0,1), projections
N(0, 1/fan_in), norms 1 + 0.1 N, lm_head logits of std ~2) and a nonzero `gate_bias` and
`e_score_correction_bias`, so a test sees either dropped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from beam_trtllm.tiny import scaled

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def canonical_config(tokenizer_dir: Path | None = None, **overrides):
    from transformers import BeamConfig

    fields = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        mlp_layer_types=["dense", "sparse"] * 2, num_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, sliding_window=8, final_logit_softcapping=30.0,
        max_position_embeddings=4096, architectures=["BeamForCausalLM"],
    )
    if tokenizer_dir is not None:  # the tokenizer's special token ids
        ids = json.loads((Path(tokenizer_dir) / "config.json").read_text())
        fields.update({k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    fields.update(overrides)
    return BeamConfig(**fields)


@torch.no_grad()
def random_model(config, seed: int = 0):
    """transformers' BeamForCausalLM in FP32 with seeded weights at realistic scales."""
    from transformers import BeamForCausalLM

    model = BeamForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, t in model.state_dict().items():  # parameters and persistent buffers, in place
        t.copy_(scaled(name, torch.randn(t.shape, generator=gen)))
    return model


def _copy_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)


def write_hf_checkpoints(root: Path, tokenizer_dir: Path, seed: int = 0,
                         config=None) -> dict[str, Path]:
    """The "fp32", "bf16", "fp16" and "fused" checkpoints of one random model under `root`."""
    from safetensors.torch import save_file
    from transformers import BeamForCausalLM

    root, tokenizer_dir = Path(root), Path(tokenizer_dir)
    dirs = {k: root / f"hf-{k}" for k in ("fp32", "bf16", "fp16", "fused")}
    model = random_model(config or canonical_config(tokenizer_dir), seed)
    model.save_pretrained(dirs["fp32"], max_shard_size="200KB")
    bf16 = BeamForCausalLM.from_pretrained(dirs["fp32"], dtype=torch.bfloat16)
    bf16.save_pretrained(dirs["bf16"])
    BeamForCausalLM.from_pretrained(dirs["fp32"], dtype=torch.float16).save_pretrained(dirs["fp16"])
    dirs["fused"].mkdir(parents=True)
    state = {k: v.contiguous() for k, v in bf16.state_dict().items()}
    save_file(state, str(dirs["fused"] / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        shutil.copyfile(dirs["bf16"] / name, dirs["fused"] / name)
    for d in dirs.values():
        _copy_tokenizer(tokenizer_dir, d)
    return dirs
