"""The distinct kernel problems of an engine (autotune.engine_problems): every GEMM, MoE and
decode-attention shape its layers run, at the token counts its steps use, keyed as
`plugins/tuning.py` looks them up. Formats without a tuning hook (BF16 GEMMs run by torch,
128x128-block FP8) are not listed: they keep their defaults."""

from __future__ import annotations

import torch

from ..config import BeamConfig
from .autotune_cases import ACT_DTYPE, Problem

LINEAR_K = {"self_attn.qkvg_proj": "hidden", "self_attn.o_proj": "attn",
            "mlp.gate_up_proj": "hidden", "mlp.down_proj": "inner"}
TUNED_LINEAR = ("fp8", "nvfp4")
TUNED_EXPERTS = ("fp8", "nvfp4")


def _token_sizes(decode: list[int], prefill: int) -> list[int]:
    """Decode representatives plus the prefill chunk, one per bucket (the largest)."""
    from plugins.tuning import bucket

    reps: dict[int, int] = {}
    for m in [*decode, prefill]:
        reps[bucket(m)] = max(reps.get(bucket(m), 0), m)
    return sorted(reps.values())


# Linears whose single FP8 segment the engine may run split over K at a few tokens
# (BeamModel._split_linear: with SPLIT_CONFIG, a fixed shape, not a tuned one)
SPLIT_LINEARS = ("self_attn.qkvg_proj", "self_attn.o_proj")


def _may_split(name: str, segments: list[dict]) -> bool:
    """As the engine runs them: a split Linear of one segment."""
    return name in SPLIT_LINEARS and len(segments) == 1


def _linear_shapes(cfg: BeamConfig, layer_plan: dict) -> dict:
    """{(format, N, K): (layers using it, Linear names, whether every use may run split-K)}
    of the quantized GEMMs."""
    k_of = {"hidden": cfg.hidden_size, "attn": cfg.num_attention_heads * cfg.head_dim,
            "inner": cfg.intermediate_size}
    shapes: dict[tuple, tuple[int, set, bool]] = {}
    for layer in layer_plan.values():
        for name, segments in layer.items():
            if name not in LINEAR_K:
                continue
            splits = _may_split(name, segments)
            for seg in segments:
                if seg["format"] in TUNED_LINEAR:
                    key = (seg["format"], int(seg["rows"]), k_of[LINEAR_K[name]])
                    uses, names, all_split = shapes.get(key, (0, set(), True))
                    shapes[key] = (uses + 1, names | {name.split(".")[-1]}, all_split and splits)
    return shapes


def linear_problems(cfg: BeamConfig, layer_plan: dict, decode: list[int], prefill: int,
                    cuda: bool, sm_count: int | None = None) -> list[Problem]:
    """The quantized GEMMs at each token count, less those torch._scaled_mm runs and, given
    the device's SM count, those the engine runs split over K (`decode_split_k`)."""
    from plugins.linear_fp8 import decode_split_k, takes_scaled_mm
    from plugins.tuning import bucket, dtype_name

    out = []
    for (fmt, n, k), (uses, names, split) in sorted(_linear_shapes(cfg, layer_plan).items()):
        family = f"linear_{fmt}"
        for m in _token_sizes(decode, prefill):
            if fmt == "fp8" and takes_scaled_mm(m, n, k, torch.empty(n), ACT_DTYPE, cuda):
                continue  # torch._scaled_mm runs these: no launch shape of ours to tune
            if fmt == "fp8" and split and sm_count and decode_split_k(m, n, k, sm_count) > 1:
                continue  # the engine runs these split, in SPLIT_CONFIG's shape
            key = (family, bucket(m), n, k) + (() if fmt == "fp8" else (dtype_name(ACT_DTYPE),))
            out.append(Problem(family, key, f"{family} m={m} N={n} K={k} ({', '.join(sorted(names))})",
                               {"n": n, "k": k, "size": m}, uses))
    return out


def moe_problems(cfg: BeamConfig, layer_plan: dict, decode: list[int], prefill: int) -> list[Problem]:
    from plugins.tuning import bucket, dtype_name

    formats: dict[str, int] = {}
    for layer in layer_plan.values():
        if layer.get("experts") in TUNED_EXPERTS:
            formats[layer["experts"]] = formats.get(layer["experts"], 0) + 1
    e, i, h, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts_per_tok
    out = []
    for fmt, uses in sorted(formats.items()):
        family = f"moe_{fmt}"
        for m in _token_sizes(decode, prefill):
            pairs = m * k
            key = (family, bucket(pairs), e, i, h) + (() if fmt == "fp8" else (dtype_name(ACT_DTYPE),))
            params = {"experts": e, "inner": i, "hidden": h, "top_k": k, "size": pairs}
            out.append(Problem(family, key, f"{family} T={m} ({pairs} pairs) E={e} I={i} H={h}",
                               params, uses))
    return out


def attention_problems(cfg: BeamConfig, options, kv_dtype: str, decode: list[int]) -> list[Problem]:
    """Pure decode steps (the split-KV kernel); the capacity is the CUDA graphs' block table
    (max_seq_len rounded up to blocks) for full layers, the window for sliding ones."""
    from plugins.tuning import DECODE_FAMILY, decode_key, dtype_name

    from .kv_cache import KV_TORCH_DTYPES

    kv = KV_TORCH_DTYPES[kv_dtype]
    bs = options.block_size
    full_cap = -(-options.max_seq_len // bs) * bs
    kinds = [("full", len(cfg.full_layers), full_cap, bs, 0),
             ("sliding", len(cfg.sliding_layers), cfg.sliding_window, cfg.sliding_window,
              cfg.sliding_window)]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = []
    for kind, uses, cap, block, window in kinds:
        if not uses:
            continue
        for b in decode:
            key = decode_key(b, cap, hq, hkv, d, ACT_DTYPE, kv)
            params = {"hq": hq, "hkv": hkv, "d": d, "capacity": cap, "block_size": block,
                      "window": window, "kv_dtype": dtype_name(kv), "size": b}
            out.append(Problem(DECODE_FAMILY, key, f"attention_decode B={b} {kind} "
                               f"capacity={cap} kv={kv_dtype}", params, uses))
    return out


def recipe_plan(cfg: BeamConfig, recipe: str) -> dict:
    """The layer plan a build of a shipped recipe writes (weights.py), for searches without a
    checkpoint (bench/autotune_bench.py): attention projections FP8 W8A8, q/k/v and the output
    gate's gate_proj in one qkvg segment (they share x, hence its input_scale); dense MLP and
    experts FP8 (recipe fp8) or NVFP4 (nvfp4)."""
    if recipe not in ("fp8", "nvfp4"):
        raise ValueError(f"recipe must be fp8 or nvfp4, got {recipe!r}")
    plan = {}
    for i in range(cfg.num_hidden_layers):
        layer = {"self_attn.qkvg_proj": [
                     {"format": "fp8", "rows": cfg.qkv_gate_size,
                      "parts": [f"self_attn.{p}_proj" for p in ("q", "k", "v", "gate")]}],
                 "self_attn.o_proj": [{"format": "fp8", "rows": cfg.hidden_size,
                                       "parts": ["self_attn.o_proj"]}]}
        if cfg.is_moe(i):
            layer["experts"] = recipe
        else:
            layer["mlp.gate_up_proj"] = [{"format": recipe, "rows": 2 * cfg.intermediate_size}]
            layer["mlp.down_proj"] = [{"format": recipe, "rows": cfg.hidden_size}]
        plan[f"layer{i}"] = layer
    return plan
