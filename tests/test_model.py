"""beam-trt's Beam against transformers' BeamForCausalLM, the canonical model (the oracle).

FP32 on the CPU: the engine's logits at every position of a prompt of more than 2K tokens
(chunked prefill over paged blocks and sliding rings, the window crossed ~260 times, SSMax at
1.072 by position 2047) and of step-by-step decode equal transformers' eager FP32 logits within
1e-5 of the largest |logit|, on checkpoints written by transformers itself and by init-tiny.
BF16: BF16 rounding changes a random-weight model's logits by itself (transformers' own BF16
run parts from its FP32 run by ~0.03 nats/token, ~90% top-1 on these weights), so the BF16
engine is held to transformers' own BF16-vs-FP32 distance: KL no more than 1.25 times it
(+0.002 nats) and top-1 agreement no more than 2 points below it.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import all_logits, kl_top1, one_thread, prompts  # noqa: F401

from beam_trtllm.config import PRESETS, BeamConfig
from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.hf_model import hf_config, load_model, logits

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = 2100  # prompt tokens: past position 2047, where SSMax's scale is 1.072
FP32_REL = 1e-5  # of max |logit| (the acceptance bound; measured 1.1e-6)


def _engine(ckpt, tmp_path, dtype: str, max_seq_len: int) -> Engine:
    opts = BuildOptions(max_batch=2, max_seq_len=max_seq_len, max_num_tokens=512,
                        block_size=16, dtype=dtype)
    return Engine.from_dir(build_engine(ckpt, tmp_path / f"engine-{dtype}", opts), device="cpu")


def _check_fp32(ckpt, tmp_path, length: int, decode: int) -> None:
    engine = _engine(ckpt, tmp_path, "float32", length + decode + 1)
    prompt = prompts(21, [length], vocab=508)[0]
    got, tokens = all_logits(engine, prompt, decode)
    want = logits(load_model(ckpt, torch.float32), torch.tensor([prompt + tokens]))[0, :-1]
    assert got.shape == want.shape
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= FP32_REL, f"max |engine - transformers| = {err:.2e} of max |logit|"
    assert tokens == want[length - 1:].argmax(-1).tolist()


def test_fp32_engine_equals_transformers_on_a_transformers_checkpoint(hf_tiny_fp32_dir, tmp_path):
    torch.set_num_threads(2)  # (the 2K-token prefill is the one big job of the suite)
    _check_fp32(hf_tiny_fp32_dir, tmp_path, LONG, decode=16)


def test_fp32_engine_equals_transformers_on_init_tiny(tiny_dir, tmp_path):
    _check_fp32(tiny_dir, tmp_path, 300, decode=8)


@pytest.mark.parametrize("ckpt", ["hf_tiny_bf16_dir", "tiny_dir"])
def test_bf16_engine_within_transformers_own_bf16_distance(ckpt, request, tmp_path):
    ckpt = request.getfixturevalue(ckpt)
    engine = _engine(ckpt, tmp_path, "bfloat16", 600)
    prompt = prompts(22, [512], vocab=508)[0]
    got, tokens = all_logits(engine, prompt, 8)
    ids = torch.tensor([prompt + tokens])
    fp32 = logits(load_model(ckpt, torch.float32), ids)[0, :-1]
    hf_bf16 = logits(load_model(ckpt, torch.bfloat16), ids)[0, :-1]
    floor_kl, floor_top1 = kl_top1(fp32, hf_bf16)
    kl, top1 = kl_top1(fp32, got)
    assert kl <= 1.25 * floor_kl + 2e-3, (kl, floor_kl)
    assert top1 >= floor_top1 - 0.02, (top1, floor_top1)


def test_tiny_preset_is_a_plain_transformers_config(tmp_path):
    from transformers import BeamConfig as HFBeamConfig

    cfg = PRESETS["tiny"]
    hf = hf_config(cfg)
    assert isinstance(hf, HFBeamConfig)
    hf.save_pretrained(tmp_path)  # the config.json transformers writes for it
    back = BeamConfig.from_hf(tmp_path)
    assert back == cfg and not back.unknown_fields
    # every feature the spec's "Presets" asks of it
    assert cfg.dense_layers and cfg.moe_layers and cfg.dense_layers != tuple(range(len(cfg.dense_layers)))
    assert len(cfg.full_layers) >= 2 and cfg.n_group > cfg.topk_group and cfg.num_queries_per_kv > 1
    assert cfg.final_logit_softcapping == 30.0 and cfg.sliding_window < 300
