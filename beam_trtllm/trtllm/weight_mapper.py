"""Hugging Face -> TensorRT-LLM weight mapping for Beam, as data plus small pure functions.

Pure torch: nothing here imports TensorRT-LLM, so it is tested on the tiny checkpoint. The
TRT-LLM `BaseWeightMapper` subclass (`hf_weight_mapper.py`) and the model's modules call these
functions, so what is tested here is what TRT-LLM's loader receives.

What TRT-LLM's PyTorch model expects, module by module (TRT-LLM name <- HF names):
- `self_attn.qkv_proj`   <- [q_proj, k_proj, v_proj]: one dict per part, each with the part's
  weight and quantization scales (k_proj also `k_scale`, v_proj `v_scale`: FP8 KV cache).
  TRT-LLM's fused Linear splits each part by rank and concatenates them. When TP exceeds the
  KV heads, k/v are first duplicated so that every rank holds the KV head its query heads read.
- `mlp.gate_up_proj`     <- [gate_proj, up_proj] (dense layers).
- `mlp.experts`          <- every `experts.{e}.{gate,up,down}_proj.*`, renamed `{e}.w1|w3|w2.*`.
- `mlp.gate`             <- `mlp.gate.{weight, e_score_correction_bias}` (FP32, DeepseekV3Gate).
- `post_attention_layernorm`, `post_feedforward_layernorm` <- the same names, with the residual
  coefficient b_k folded in (see `fold_residual_scale`).
- everything else keeps its HF name (g_proj, o_proj, q_norm, k_norm, the pre-norms, embedding,
  final norm, lm_head).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from beam_trtllm.checkpoint import expected_tensors
from beam_trtllm.config import BeamConfig

from .errors import WeightMappingError

# ------------------------------------------------------------------------------------ data
# TRT-LLM fused module -> the HF modules it is loaded from, in TRT-LLM's part order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# HF expert projection -> TRT-LLM fused-MoE weight name (w3/w1 are the up/gate halves).
EXPERT_RENAMES: dict[str, str] = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# Post-norms that carry a residual coefficient: name -> sublayer offset within the layer.
POST_NORMS: dict[str, int] = {"post_attention_layernorm": 0, "post_feedforward_layernorm": 1}
# Parameters a (possibly quantized) Linear may carry in a ModelOpt unified HF checkpoint.
LINEAR_PARAMS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
KV_CACHE_SCALES = {"k_proj": "k_scale", "v_proj": "v_scale"}  # FP8 KV cache, per layer
# k/v tensors whose rows are head-major (duplicated per KV head when TP > KV heads); scalar
# scales (per-tensor weight_scale, weight_scale_2, input_scale, k_scale, v_scale) are shared.
KV_HEAD_ROW_PARAMS = ("weight", "bias", "weight_scale")

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)")
_ATTN_LINEAR = re.compile(r"self_attn\.(q_proj|k_proj|v_proj|g_proj|o_proj)\.(\w+)")
_DENSE_LINEAR = re.compile(r"mlp\.(gate_proj|up_proj|down_proj)\.(\w+)")


@dataclass(frozen=True)
class Target:
    """Where one HF tensor goes: the TRT-LLM module, the fused part (HF module name) or None,
    and the key under which the module's `load_weights` receives it."""

    module: str
    part: str | None
    key: str


# ------------------------------------------------------------------------------ name mapping
def target_of(cfg: BeamConfig, name: str) -> Target:
    """The TRT-LLM destination of HF tensor `name`; WeightMappingError if Beam has no such tensor."""
    if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return Target(name.rsplit(".", 1)[0], None, "weight")
    if name.startswith("lm_head.") and name.split(".", 1)[1] in LINEAR_PARAMS:
        return Target("lm_head", None, name.split(".", 1)[1])  # a recipe that quantizes lm_head
    hit = _LAYER.fullmatch(name)
    if hit is None or int(hit.group(1)) >= cfg.num_hidden_layers:
        raise WeightMappingError(f"tensor {name}: not a Beam tensor ({_layers_hint(cfg)})")
    prefix, rest = f"model.layers.{hit.group(1)}.", hit.group(2)
    target = _layer_target(cfg, int(hit.group(1)), rest)
    if target is None:
        raise WeightMappingError(f"tensor {name}: not a Beam tensor of layer {hit.group(1)} "
                                 f"({'MoE' if cfg.is_moe(int(hit.group(1))) else 'dense'})")
    return Target(prefix + target.module, target.part, target.key)


def _layers_hint(cfg: BeamConfig) -> str:
    return f"the config has {cfg.num_hidden_layers} layers"


def _layer_target(cfg: BeamConfig, layer: int, rest: str) -> Target | None:
    module, _, param = rest.rpartition(".")
    if module in ("input_layernorm", "pre_feedforward_layernorm", *POST_NORMS,
                  "self_attn.q_norm", "self_attn.k_norm"):
        return Target(module, None, param) if param == "weight" else None
    if (hit := _ATTN_LINEAR.fullmatch(rest)) is not None:
        proj, param = hit.groups()
        if param not in LINEAR_PARAMS and param != KV_CACHE_SCALES.get(proj):
            return None
        if proj in FUSED_MODULES["qkv_proj"]:
            return Target("self_attn.qkv_proj", proj, param)
        return Target(f"self_attn.{proj}", None, param)
    if cfg.is_moe(layer):
        return _moe_target(cfg, rest)
    if (hit := _DENSE_LINEAR.fullmatch(rest)) is not None and hit.group(2) in LINEAR_PARAMS:
        proj, param = hit.groups()
        if proj in FUSED_MODULES["gate_up_proj"]:
            return Target("mlp.gate_up_proj", proj, param)
        return Target("mlp.down_proj", None, param)
    return None


def _moe_target(cfg: BeamConfig, rest: str) -> Target | None:
    if rest in ("mlp.gate.weight", "mlp.gate.e_score_correction_bias"):
        return Target("mlp.gate", None, rest.rsplit(".", 1)[1])
    hit = _EXPERT.fullmatch(rest)
    if hit is None or int(hit.group(1)) >= cfg.n_routed_experts or hit.group(3) not in LINEAR_PARAMS:
        return None
    e, proj, param = hit.groups()
    return Target("mlp.experts", None, f"{e}.{EXPERT_RENAMES[proj]}.{param}")


def plan_weights(cfg: BeamConfig, names: Iterable[str], complete: bool = True
                 ) -> dict[str, dict[str | None, dict[str, str]]]:
    """module -> part -> load key -> HF name: every HF tensor placed exactly once.

    Refuses (naming the tensor) an unknown tensor, two tensors landing on one key, and, when
    `complete`, a missing one: every tensor of the BF16 layout must be present (a quantized
    checkpoint keeps those names and adds scales). TRT-LLM's loader skips what no module asks
    for, so without this check a renamed tensor would silently keep its random init."""
    plan: dict[str, dict[str | None, dict[str, str]]] = {}
    seen = set()
    for name in names:
        if name in seen:
            raise WeightMappingError(f"tensor {name}: listed twice")
        seen.add(name)
        t = target_of(cfg, name)
        slot = plan.setdefault(t.module, {}).setdefault(t.part, {})
        if t.key in slot:
            raise WeightMappingError(f"tensors {slot[t.key]} and {name} both map to "
                                     f"{t.module}[{t.part or ''}].{t.key}")
        slot[t.key] = name
    if complete:
        missing = [n for n in expected_tensors(cfg) if n not in seen]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise WeightMappingError(f"checkpoint lacks tensor {missing[0]}{more}")
    return plan


# ------------------------------------------------------------------------------ transforms
def post_norm_scale(cfg: BeamConfig, module: str) -> float | None:
    """b_k of a post-norm module path (`model.layers.{i}.post_*_layernorm`), None otherwise."""
    hit = re.fullmatch(r"model\.layers\.(\d+)\.(post_attention_layernorm|post_feedforward_layernorm)",
                       module)
    if hit is None:
        return None
    return cfg.residual_coeffs(2 * int(hit.group(1)) + POST_NORMS[hit.group(2)])[1]


def fold_residual_scale(weight: torch.Tensor, b: float) -> torch.Tensor:
    """The post-norm weight with the residual coefficient b_k folded in, kept in FP32.

    b * RMSNorm(y; w) = RMSNorm(y; b * w): RMSNorm multiplies its weight in after normalising,
    so a per-sublayer constant on its output is a constant on the weight. FP32 keeps b * w
    exact to FP32 rounding (a BF16 copy would round every element by up to 2^-9)."""
    return weight.float() * b


def duplicate_kv_heads(t: torch.Tensor, num_kv_heads: int, tp_size: int) -> torch.Tensor:
    """Repeat each KV head's rows tp_size / num_kv_heads times (TP > KV heads), so that the even
    split over tp_size ranks gives rank r the KV head its query heads read (r // reps).

    Works on any head-row-major tensor: a BF16/FP8 weight [Hkv*D, H], an NVFP4 packed weight
    [Hkv*D, H/2] (uint8) and its block scale [Hkv*D, H/16] (float8), a per-channel scale [Hkv*D]."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise WeightMappingError(f"tensor_parallel_size {tp_size} does not divide the "
                                     f"{num_kv_heads} KV heads")
        return t
    if tp_size % num_kv_heads:
        raise WeightMappingError(f"tensor_parallel_size {tp_size} is not a multiple of the "
                                 f"{num_kv_heads} KV heads, so they cannot be replicated evenly")
    if t.ndim == 0 or t.shape[0] % num_kv_heads:
        raise WeightMappingError(f"a KV tensor of shape {list(t.shape)} has no {num_kv_heads} "
                                 "equal head row blocks")
    reps = tp_size // num_kv_heads
    heads = t.reshape(num_kv_heads, t.shape[0] // num_kv_heads, *t.shape[1:])
    # repeat_interleave has no float8 kernel on every build: move raw bytes.
    raw = heads.view(torch.uint8) if t.dtype.itemsize == 1 else heads
    out = raw.repeat_interleave(reps, dim=0).reshape(t.shape[0] * reps, *t.shape[1:])
    return out.view(t.dtype) if t.dtype.itemsize == 1 else out


def duplicate_kv_part(part: str, weights: Mapping[str, torch.Tensor], num_kv_heads: int,
                      tp_size: int) -> dict[str, torch.Tensor]:
    """One fused-QKV part's dict with its head-row tensors duplicated (k_proj / v_proj only)."""
    if part not in ("k_proj", "v_proj"):
        return dict(weights)
    return {key: duplicate_kv_heads(value, num_kv_heads, tp_size)
            if key in KV_HEAD_ROW_PARAMS and value.ndim >= 1 else value
            for key, value in weights.items()}


def rename_expert_weights(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`{e}.gate_proj.weight_scale` -> `{e}.w1.weight_scale` (the keys TRT-LLM's MoE loads)."""
    out = {}
    for key, value in weights.items():
        hit = re.fullmatch(r"(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)", key)
        if hit is None:
            raise WeightMappingError(f"expert tensor {key}: expected '<e>.<gate|up|down>_proj.<param>'")
        out[f"{hit.group(1)}.{EXPERT_RENAMES[hit.group(2)]}.{hit.group(3)}"] = value
    return out


# ------------------------------------------------------------------- the whole mapping, pure
def module_loads(cfg: BeamConfig, tensors: Mapping[str, torch.Tensor], tp_size: int = 1,
                 complete: bool = True) -> dict[str, list[dict[str, torch.Tensor]]]:
    """TRT-LLM module path -> the list of dicts its `load_weights(weights=...)` receives
    (one dict per fused part, in part order; one dict otherwise), with every transform applied:
    KV duplication for `tp_size`, expert renames, b_k folded into the post-norms."""
    plan = plan_weights(cfg, tensors.keys(), complete)
    out: dict[str, list[dict[str, torch.Tensor]]] = {}
    for module, parts in plan.items():
        short = module.rsplit(".", 1)[-1]
        if short in FUSED_MODULES:
            out[module] = [duplicate_kv_part(p, {k: tensors[n] for k, n in parts.get(p, {}).items()},
                                             cfg.num_key_value_heads, tp_size)
                           for p in FUSED_MODULES[short]]
            continue
        loaded = {k: tensors[n] for k, n in parts[None].items()}
        if (b := post_norm_scale(cfg, module)) is not None:
            loaded["weight"] = fold_residual_scale(loaded["weight"], b)
        out[module] = [loaded]
    return out


def fuse_parts(parts: list[Mapping[str, torch.Tensor]], module: str) -> dict[str, torch.Tensor]:
    """What a TP-1 fused Linear holds: weights and block scales stacked by rows; a per-tensor
    scalar kept once when the parts agree, else stacked `[parts]` (FP8 per-tensor weight
    scales differ per Linear; TRT-LLM's loader reconciles them).

    NVFP4's `weight_scale_2` must agree: ModelOpt gives Linears that read one input a shared
    global scale (its fused-input rule) and the fused FP4 GEMM has room for one, so unequal
    ones mean a checkpoint not made that way, refused rather than silently mis-scaled."""
    out: dict[str, torch.Tensor] = {}
    keys = list(dict.fromkeys(k for p in parts for k in p))
    for key in keys:
        values = [p[key] for p in parts if key in p]
        if values[0].ndim >= 1:
            raw = [v.view(torch.uint8) if v.dtype.itemsize == 1 else v for v in values]
            cat = torch.cat(raw, dim=0)
            out[key] = cat.view(values[0].dtype) if values[0].dtype.itemsize == 1 else cat
        elif all(torch.equal(v, values[0]) for v in values[1:]):
            out[key] = values[0]
        elif key == "weight_scale_2":
            raise WeightMappingError(f"{module}: parts have different weight_scale_2 "
                                     f"{[float(v) for v in values]}; NVFP4 Linears that share "
                                     "an input must share it (ModelOpt's fused-input rule)")
        else:
            out[key] = torch.stack(values)
    return out
