"""`beam-trt init-tiny`: a complete, deterministic tiny Beam in Hugging Face layout.

Weights are random at realistic scales: embeddings of unit variance (the residual stream
starts at unit variance), projections ~ N(0, 1/fan_in), norm weights near 1, and an lm_head
whose logits have a standard deviation of about 2 (peaked but not dominated by one token).
Each tensor has its own seed derived from (seed, name), so the result does not depend on
the order tensors are made in.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from .checkpoint import expected_tensors, save_sharded
from .config import PRESETS, BeamConfig
from .tokenizer import END_OF_TEXT, EOS_TOKENS, PAD, write_tokenizer_files

LOGIT_STD = 2.0
SPECIAL_LOGIT_DAMPING = 0.25


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def scaled(name: str, normal: torch.Tensor) -> torch.Tensor:
    """Standard-normal draws for the tensor `name` (a checkpoint or transformers module name)
    at the scale its role calls for: norm weights near 1, unit-variance embeddings, an lm_head
    of logits with std ~LOGIT_STD, nonzero biases (so a test sees a dropped one), projections
    (fused experts and the router too) N(0, 1/fan_in) with fan_in the last dim."""
    if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1] or "layernorm" in name:
        return 1.0 + 0.1 * normal
    if name.endswith("embed_tokens.weight"):
        return normal
    if name == "lm_head.weight":
        return normal * LOGIT_STD / normal.shape[-1] ** 0.5
    if name.endswith("e_score_correction_bias"):
        return 0.05 * normal
    if name.endswith("gate_bias"):
        return 0.5 * normal
    return normal / normal.shape[-1] ** 0.5


def random_tensor(cfg: BeamConfig, name: str, shape, dtype, seed: int) -> torch.Tensor:
    """One tensor of a random Beam at the scale its role calls for (`scaled`), from its own
    seed, so that the result does not depend on the order tensors are made in."""
    normal = torch.randn(shape, generator=_generator(seed, name), dtype=torch.float32)
    return scaled(name, normal).to(dtype)


def random_state_dict(cfg: BeamConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        name: random_tensor(cfg, name, shape, dtype, seed)
        for name, (shape, dtype) in expected_tensors(cfg).items()
    }


def init_tiny(out_dir: str | Path, seed: int = 0, cfg: BeamConfig | None = None,
              max_shard_bytes: int = 512 << 10, corpus_lines: list[str] | None = None) -> Path:
    """Write config, sharded BF16 weights (router FP32), generation config and tokenizer
    (a BPE of cfg.vocab_size tokens trained on `corpus_lines`, default the bundled corpus)."""
    cfg = cfg or PRESETS["tiny"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer_files(out, cfg.vocab_size, cfg.max_position_embeddings, corpus_lines)
    eos = [ids[t] for t in EOS_TOKENS]
    cfg = cfg.replace(bos_token_id=ids[END_OF_TEXT], eos_token_id=eos, pad_token_id=ids[PAD])
    (out / "config.json").write_text(json.dumps(cfg.to_hf(dtype="bfloat16"), indent=2))
    generation = {
        "bos_token_id": ids[END_OF_TEXT],
        "eos_token_id": eos,
        "pad_token_id": ids[PAD],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    state = random_state_dict(cfg, seed)
    # A random model would end most answers at once if the stop tokens were as likely as any
    # other: damp their logits so generated text has some length.
    special = sorted(ids.values())
    state["lm_head.weight"][special] *= SPECIAL_LOGIT_DAMPING
    save_sharded(state, out, max_shard_bytes)
    return out


TRAINED_DIR = Path(__file__).parent / "data" / "trained_tiny"
TRAINED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "RUN.json", "train.log")
TRAINED_DRAFT_FILES = ("config.json", "model.safetensors", "RUN.json")  # under draft/


def _check_sha256(src: Path) -> None:
    import hashlib

    run = json.loads((src / "RUN.json").read_text())
    weights = src / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    if digest != run["model_safetensors_sha256"]:
        raise ValueError(f"{weights}: SHA-256 {digest} is not the one RUN.json records "
                         f"({run['model_safetensors_sha256']}): a damaged install")


def init_trained_tiny(out_dir: str | Path) -> Path:
    """Write the trained tiny Beam shipped in beam_trtllm/data/trained_tiny (how it was trained:
    its RUN.json) and its DFlash2 drafter (draft/, docs/SPECULATIVE.md), after checking their
    weights against the SHA-256 each RUN.json records."""
    import shutil

    _check_sha256(TRAINED_DIR)
    _check_sha256(TRAINED_DIR / "draft")
    out = Path(out_dir)
    (out / "draft").mkdir(parents=True, exist_ok=True)
    for name in TRAINED_FILES:
        shutil.copyfile(TRAINED_DIR / name, out / name)
    for name in TRAINED_DRAFT_FILES:
        shutil.copyfile(TRAINED_DIR / "draft" / name, out / "draft" / name)
    return out
