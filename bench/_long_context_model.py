"""The long-context benchmark's model (bench/long_context.py): Beam-1.0 at full width cut to a
few layers, written as a random FP8 checkpoint in the layout `beam-trt convert --quant fp8`
writes (ModelOpt per-tensor FP8 W8A8 for every decoder Linear, FP8 KV scales, lm_head BF16),
so that `beam-trt build` turns it into an engine dir; plus the FLOP and byte counts of the
floors.

Random weights at realistic magnitudes: FP8 codes ~ N(0, 32^2) with weight_scale
1 / (32 sqrt(fan_in)) (dequantised weights ~ N(0, 1 / fan_in)), static activation scales
amax / 448 with the amax a normed input reaches (6; o_proj's gated attention output 2, the
down projections' SwiGLU output 8), KV scales 5 / 448, everything else as `beam-trt
init-tiny` makes it (beam_trtllm/tiny.py `scaled`)."""

from __future__ import annotations

import json
import time
from itertools import groupby
from pathlib import Path

import torch

from _engine_model import _linear_params
from beam_trtllm.checkpoint import INDEX_NAME, atomic_save, shard_name
from beam_trtllm.config import DENSE, FULL, SLIDING, SPARSE, BeamConfig, preset
from beam_trtllm.tiny import scaled

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_SPREAD = 32.0
ACT_AMAX = {"o_proj": 2.0, "down_proj": 8.0}  # every other Linear reads a normed input: 6
NORMED_AMAX = 6.0
KV_AMAX = 5.0
LAYER_KINDS = {"sD": (SLIDING, DENSE), "sM": (SLIDING, SPARSE), "fD": (FULL, DENSE),
               "fM": (FULL, SPARSE)}


# ---------------------------------------------------------------------------- the model
def parse_layers(spec: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """"sD,fM" -> (layer_types, mlp_layer_types): s/f sliding/full attention, D/M dense/MoE."""
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    bad = [k for k in kinds if k not in LAYER_KINDS]
    if not kinds or bad:
        raise SystemExit(f"--layers {spec!r}: each layer is one of {', '.join(LAYER_KINDS)} "
                         f"(s/f = sliding/full attention, D/M = dense/MoE), got {bad or 'none'}")
    if not any(k.startswith("f") for k in kinds):
        raise SystemExit(f"--layers {spec!r}: a long-context benchmark needs a full-attention "
                         "layer (fD or fM): only those keep every token's KV")
    return tuple(LAYER_KINDS[k][0] for k in kinds), tuple(LAYER_KINDS[k][1] for k in kinds)


def bench_config(layers: str, smoke: bool, max_context: int) -> BeamConfig:
    """Beam-1.0's widths (the beam-1.0-501b preset) with `layers`; --smoke: narrow widths."""
    types, mlps = parse_layers(layers)
    if smoke:
        return BeamConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                          moe_intermediate_size=128, num_hidden_layers=len(types),
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          layer_types=types, mlp_layer_types=mlps, num_experts=16,
                          num_experts_per_tok=4, n_group=4, topk_group=2, sliding_window=16,
                          max_position_embeddings=max_context)
    cfg = preset("beam-1.0-501b")
    if max_context > cfg.max_position_embeddings:
        raise SystemExit(f"--contexts: {max_context} tokens exceed Beam-1.0's "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")
    return cfg.replace(num_hidden_layers=len(types), layer_types=types, mlp_layer_types=mlps)


def checkpoint_plan(cfg: BeamConfig):
    """Every tensor `beam-trt convert --quant fp8` (calibrated, FP8 KV) writes for `cfg`."""
    from convert.plan import make_plan
    from convert.recipe import load_recipe

    return make_plan(cfg, load_recipe("fp8"), calibrated=True, kv_fp8=True)


def planned_bytes(plan) -> int:
    return sum(_numel(shape) * torch.empty((), dtype=dtype).element_size()
               for _, dtype, shape in plan.outputs)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ---------------------------------------------------------------------------- the checkpoint
def write_checkpoint(cfg: BeamConfig, out: Path, device, log) -> int:
    """The random FP8 checkpoint in `out` (one shard per layer, embedding and head), made on
    `device` one tensor at a time; returns the bytes written."""
    from convert.hfconfig import hf_quant_config, quantization_config

    plan = checkpoint_plan(cfg)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)
    groups = [(key, list(items)) for key, items in groupby(plan.outputs, key=_group)]
    weight_map, fan_in, total = {}, {}, 0
    for k, (group, outputs) in enumerate(groups, start=1):
        t = time.perf_counter()
        tensors = {name: _random_tensor(name, dtype, shape, fan_in, device, gen).cpu()
                   for name, dtype, shape in outputs}
        fname = shard_name(k, len(groups))
        atomic_save(out / fname, tensors)
        nbytes = sum(x.numel() * x.element_size() for x in tensors.values())
        total += nbytes
        weight_map.update({name: fname for name in tensors})
        log(f"checkpoint [{k}/{len(groups)}] {group}: {len(tensors)} tensors, "
            f"{nbytes / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s")
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": weight_map}, indent=1))
    hfq = hf_quant_config(plan)
    config = dict(cfg.to_hf(dtype="bfloat16"), quantization_config=quantization_config(hfq))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "hf_quant_config.json").write_text(json.dumps(hfq, indent=2))
    write_tokenizer(out, cfg.vocab_size, cfg.max_position_embeddings)
    return total


def _group(output) -> str:
    name = output[0]
    if name.startswith("model.layers."):
        return "layer" + name.split(".")[2]
    return "embed" if name.startswith("model.embed_tokens") else "head"


def _random_tensor(name: str, dtype, shape, fan_in: dict, device, gen) -> torch.Tensor:
    module, _, field = name.rpartition(".")
    if dtype == FP8:  # a Linear's weight: its scale (next) follows from its fan-in
        fan_in[module] = shape[-1]
        codes = torch.randn(shape, device=device, generator=gen) * FP8_SPREAD
        return codes.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if field == "weight_scale":
        return torch.tensor(1.0 / (FP8_SPREAD * fan_in[module] ** 0.5), device=device)
    if field == "input_scale":
        amax = ACT_AMAX.get(module.rsplit(".", 1)[-1], NORMED_AMAX)
        return torch.tensor(amax / FP8_MAX, device=device)
    if field in ("k_scale", "v_scale"):
        return torch.tensor(KV_AMAX / FP8_MAX, device=device)
    normal = torch.randn(shape, device=device, generator=gen)
    return scaled(name, normal).to(dtype)


def write_tokenizer(out: Path, vocab_size: int, max_length: int) -> None:
    """A word-level tokenizer of `vocab_size` tokens ("t0", "t1", ...): the prompts are random
    ids and the engine only decodes what it generates, so no trained vocabulary is needed
    (the bundled BPE corpus cannot fill Beam-1.0's 151,936 ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length}))


# ---------------------------------------------------------------------------- floors
def prefill_flops(cfg: BeamConfig, start: int, n: int, sampled: int = 0) -> dict[str, float]:
    """FLOPs of prefilling positions [start, start + n) of one sequence by the unit that runs
    them: FP8 tensor cores (every W8A8 Linear and expert), FP32 (the router), BF16 (the LM
    head of `sampled` rows) and attention (QK^T and PV over the visible keys)."""
    fp8 = fp32 = attention = 0.0
    for i in range(cfg.num_hidden_layers):
        attn_w, mlp, router = _linear_params(cfg, i)
        fp8 += 2.0 * n * (attn_w + mlp)
        fp32 += 2.0 * n * router
        window = 0 if cfg.is_full(i) else cfg.sliding_window
        attention += 4.0 * visible_keys(start, n, window) * cfg.num_attention_heads * cfg.head_dim
    bf16 = 2.0 * sampled * cfg.vocab_size * cfg.hidden_size
    return {"fp8": fp8, "fp32": fp32, "bf16": bf16, "attention": attention}


def visible_keys(start: int, n: int, window: int) -> int:
    """Sum over query positions p in [start, start + n) of the keys p sees: p + 1, or at most
    `window` (0: no window)."""
    total = n * start + n * (n + 1) // 2  # sum of (p + 1)
    if window <= 0:
        return total
    first_capped = max(start, window - 1)  # positions p >= window - 1 see exactly `window`
    capped = max(0, start + n - first_capped)
    over = sum_range(first_capped + 1, first_capped + capped) - capped * window
    return total - over


def sum_range(a: int, b: int) -> int:
    """a + (a + 1) + ... + b (0 if b < a)."""
    return (a + b) * (b - a + 1) // 2 if b >= a else 0


def floor_seconds(flops: dict[str, float], ceilings: dict) -> dict[str, float]:
    """Each unit's FLOPs at its measured rate: the GEMMs at cuBLAS's FP8 / FP32 / BF16 rates,
    the attention at the measured attention rate."""
    rate = {"fp8": ceilings["fp8_TFLOPs"], "fp32": ceilings["fp32_TFLOPs"],
            "bf16": ceilings["bf16_TFLOPs"], "attention": ceilings["attention_TFLOPs"]}
    out = {u: flops[u] / (rate[u] * 1e12) for u in flops}
    out["gemm"] = out["fp8"] + out["fp32"] + out["bf16"]
    out["total"] = out["gemm"] + out["attention"]
    return out


def decode_bytes(cfg: BeamConfig, depth: int) -> dict[str, float]:
    """Bytes one batch-1 decode step at `depth` cached tokens must read: FP8 weights with
    their per-row FP32 scales (a MoE layer its top-k experts), the FP32 router, norms and
    gate bias (BF16), the embedding row and the BF16 LM head, and the FP8 KV each layer sees
    (a full layer all `depth` positions, a sliding one its window)."""
    h, weights, kv = cfg.hidden_size, 0.0, 0.0
    per_row = 1.0 + 4.0 / h  # FP8 byte per weight + one FP32 scale per output row
    for i in range(cfg.num_hidden_layers):
        attn_w, mlp, router = _linear_params(cfg, i)
        weights += (attn_w + mlp) * per_row + 4 * router + 2 * (4 * h + cfg.num_attention_heads)
        visible = depth if cfg.is_full(i) else min(depth, cfg.sliding_window)
        kv += visible * cfg.kv_size * 2  # K and V, one byte each
    head = 2 * h * (cfg.vocab_size + 2)  # LM head, embedding row, final norm
    return {"weights": weights + head, "kv": kv, "total": weights + head + kv}
