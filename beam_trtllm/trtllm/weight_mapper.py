"""Hugging Face -> TensorRT-LLM weight mapping for Beam, as data plus small pure functions.

Pure torch: nothing here imports TensorRT-LLM, so it is tested on the tiny checkpoint. The
TRT-LLM `BaseWeightMapper` subclass (`hf_weight_mapper.py`) and the model's modules call these
functions, so what is tested here is what TRT-LLM's loader receives.

What TRT-LLM's PyTorch model expects, module by module (TRT-LLM name <- HF names):
- `self_attn.qkv_proj`   <- [q_proj + self_attn.gate_proj, k_proj, v_proj]: one dict per part,
  each with the part's weight and quantization scales (k_proj also `k_scale`, v_proj
  `v_scale`: FP8 KV cache). The attention's output gate rides in the q part, interleaved per
  head (`[q_0; g_0; q_1; g_1; ...]`, D rows each): TRT-LLM's `attn_output_gate` layout, so
  its fused Linear's even row split gives each TP rank the q and gate rows of its own heads.
  When TP exceeds the KV heads, k/v are first duplicated so that every rank holds the KV head
  its query heads read.
- `self_attn`            <- `self_attn.gate_bias` [Hq] (BeamAttention's own parameter; each
  rank keeps its heads' entries, `gate_bias_shard`).
- `mlp.gate_up_proj`     <- [mlp.gate_proj, mlp.up_proj] (dense layers).
- `mlp.experts`          <- every `experts.{e}.{gate,up,down}_proj.*`, renamed `{e}.w1|w3|w2.*`,
  or the fused `experts.gate_up_proj` [E, 2I, H] (gate rows first) / `experts.down_proj`
  [E, H, I], split into the same per-expert keys.
- `mlp.gate`             <- `mlp.gate.{weight, e_score_correction_bias}` (FP32, DeepseekV3Gate).
- everything else keeps its HF name (o_proj, q_norm, k_norm, the four sandwich norms,
  embedding, final norm, lm_head).
Two gates are easy to confuse: `self_attn.gate_proj` (the attention's output gate, [Hq*D, H])
and `mlp.gate_proj` (a dense MLP's SwiGLU gate); `mlp.gate` is the router. Every rule below
matches the full module path, never a bare `gate_proj`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from beam_trtllm.checkpoint import expected_tensors, is_v1_checkpoint, v1_error
from beam_trtllm.config import BeamConfig

from .errors import WeightMappingError

# ------------------------------------------------------------------------------------ data
# TRT-LLM fused module -> the HF modules it is loaded from, in TRT-LLM's part order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
ATTN_GATE = "gate_proj"  # self_attn.gate_proj: merged into qkv_proj's q part, per head
# HF expert projection -> TRT-LLM fused-MoE weight name (w3/w1 are the up/gate halves).
EXPERT_RENAMES: dict[str, str] = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
FUSED_EXPERTS = ("gate_up_proj", "down_proj")  # transformers' in-memory names, also on disk
# Parameters a (possibly quantized) Linear may carry in a ModelOpt unified HF checkpoint.
LINEAR_PARAMS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
KV_CACHE_SCALES = {"k_proj": "k_scale", "v_proj": "v_scale"}  # FP8 KV cache, per layer
# k/v tensors whose rows are head-major (duplicated per KV head when TP > KV heads); scalar
# scales (per-tensor weight_scale, weight_scale_2, input_scale, k_scale, v_scale) are shared.
KV_HEAD_ROW_PARAMS = ("weight", "bias", "weight_scale")
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm")

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)")
_ATTN_LINEAR = re.compile(r"self_attn\.(q_proj|k_proj|v_proj|gate_proj|o_proj)\.(\w+)")
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
    """The TRT-LLM destination of HF tensor `name`; WeightMappingError if Beam has none."""
    if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return Target(name.rsplit(".", 1)[0], None, "weight")
    if name.startswith("lm_head.") and name.split(".", 1)[1] in LINEAR_PARAMS:
        return Target("lm_head", None, name.split(".", 1)[1])  # a recipe that quantizes lm_head
    hit = _LAYER.fullmatch(name)
    if hit is None or int(hit.group(1)) >= cfg.num_hidden_layers:
        raise WeightMappingError(f"tensor {name}: not a Beam tensor (the config has "
                                 f"{cfg.num_hidden_layers} layers)")
    layer, rest = int(hit.group(1)), hit.group(2)
    target = _layer_target(cfg, layer, rest)
    if target is None:
        kind = "MoE" if cfg.is_moe(layer) else "dense"
        raise WeightMappingError(f"tensor {name}: not a Beam tensor of layer {layer} ({kind})")
    return Target(f"model.layers.{layer}.{target.module}", target.part, target.key)


def _layer_target(cfg: BeamConfig, layer: int, rest: str) -> Target | None:
    module, _, param = rest.rpartition(".")
    if module in NORMS:
        return Target(module, None, param) if param == "weight" else None
    if rest == "self_attn.gate_bias":
        return Target("self_attn", None, "gate_bias")
    if (hit := _ATTN_LINEAR.fullmatch(rest)) is not None:
        proj, param = hit.groups()
        if param not in LINEAR_PARAMS and param != KV_CACHE_SCALES.get(proj):
            return None
        if proj in (*FUSED_MODULES["qkv_proj"], ATTN_GATE):
            return Target("self_attn.qkv_proj", proj, param)
        return Target("self_attn.o_proj", None, param)
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
    if rest in (f"mlp.experts.{f}" for f in FUSED_EXPERTS):
        return Target("mlp.experts", None, rest.rsplit(".", 1)[1])
    hit = _EXPERT.fullmatch(rest)
    if hit is None or int(hit.group(1)) >= cfg.num_experts or hit.group(3) not in LINEAR_PARAMS:
        return None
    return Target("mlp.experts", None, rest[len("mlp.experts."):])


def _held_names(cfg: BeamConfig, name: str) -> list[str]:
    """The per-expert names a fused expert tensor stands for; [name] for any other tensor."""
    prefix, _, last = name.rpartition(".")
    if last not in FUSED_EXPERTS or not prefix.endswith(".mlp.experts"):
        return [name]
    projs = ("gate_proj", "up_proj") if last == "gate_up_proj" else ("down_proj",)
    return [f"{prefix}.{e}.{p}.weight" for e in range(cfg.num_experts) for p in projs]


def plan_weights(cfg: BeamConfig, names: Iterable[str], complete: bool = True
                 ) -> dict[str, dict[str | None, dict[str, str]]]:
    """module -> part -> load key -> HF name: every HF tensor placed exactly once.

    Refuses (naming the tensor) a v1 checkpoint, an unknown tensor, two tensors landing on one
    key or holding one expert's weights (fused and per expert), and, when `complete`, a
    missing one: every tensor of the BF16 layout must be present (a quantized checkpoint keeps
    those names and adds scales). TRT-LLM's loader skips what no module asks for, so without
    this check a renamed tensor would silently keep its random init."""
    names = list(names)
    if (v1 := is_v1_checkpoint(names)) is not None:
        raise WeightMappingError(v1_error("checkpoint", v1))
    plan: dict[str, dict[str | None, dict[str, str]]] = {}
    held: dict[str, str] = {}  # per-expert / plain name -> the checkpoint tensor holding it
    for name in names:
        t = target_of(cfg, name)
        slot = plan.setdefault(t.module, {}).setdefault(t.part, {})
        if t.key in slot:
            raise WeightMappingError(f"tensors {slot[t.key]} and {name} both map to "
                                     f"{t.module}[{t.part or ''}].{t.key}")
        for n in _held_names(cfg, name):
            if n in held:
                raise WeightMappingError(f"tensors {held[n]} and {name} both hold {n}")
            held[n] = name
        slot[t.key] = name
    if complete:
        missing = [n for n in expected_tensors(cfg) if n not in held]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise WeightMappingError(f"checkpoint lacks tensor {missing[0]}{more}")
    return plan


# ------------------------------------------------------------------------------ transforms
def _rows_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0, moving raw bytes for 1-byte dtypes (float8 has no cat kernel
    on every build)."""
    if tensors[0].dtype.itemsize != 1:
        return torch.cat(tensors)
    return torch.cat([t.view(torch.uint8) for t in tensors]).view(tensors[0].dtype)


def interleave_heads(q: torch.Tensor, gate: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[q_0; g_0; q_1; g_1; ...]: q's and gate's row blocks of each head, alternating.

    Both are head-row-major with the same shape: a weight [Hq*D, H], an NVFP4 packed weight
    [Hq*D, H/2] and block scale [Hq*D, H/16], a per-channel scale [Hq*D], an FP8 block scale
    [Hq*D/128, H/128] (when D is a multiple of 128)."""
    rows = q.shape[0] // num_heads
    parts = []
    for h in range(num_heads):
        parts += [q[h * rows:(h + 1) * rows], gate[h * rows:(h + 1) * rows]]
    return _rows_cat(parts)


def _requantize_fp8(weight: torch.Tensor, scale: torch.Tensor, new_scale: torch.Tensor):
    """FP8 codes for `new_scale` (>= scale) of the weight `weight * scale`, in FP32 then
    rounded to E4M3 (what TRT-LLM's fused-QKV loader does to k and v, done exactly)."""
    return (weight.float() * (scale.float() / new_scale.float())).to(weight.dtype)


def merge_gate_into_q(q: Mapping[str, torch.Tensor], gate: Mapping[str, torch.Tensor],
                      num_heads: int, where: str) -> dict[str, torch.Tensor]:
    """The q part of TRT-LLM's gated `qkv_proj`: q_proj's and self_attn.gate_proj's tensors
    interleaved per head, and one value for each per-tensor scale.

    Per-tensor scales: equal ones are kept; NVFP4's `weight_scale_2` must be equal (ModelOpt
    gives Linears that read one input one global scale); FP8's differ (ModelOpt never fuses
    them): both weights are re-quantized to the larger `weight_scale`, and the static
    `input_scale` of the shared input is the larger one (TRT-LLM also takes the max over q,
    k and v)."""
    if set(q) != set(gate):
        odd = sorted(set(q) ^ set(gate))[0]
        raise WeightMappingError(f"{where}: q_proj and self_attn.gate_proj differ in tensor "
                                 f"{odd}; both must be quantized the same way")
    out = {k: v for k, v in q.items()}
    g = dict(gate)
    scale_q, scale_g = q.get("weight_scale"), gate.get("weight_scale")
    per_tensor = scale_q is not None and scale_q.numel() == 1 and scale_q.ndim <= 1
    if (per_tensor and q["weight"].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            and not torch.equal(scale_q, scale_g)):
        top = torch.maximum(scale_q.float(), scale_g.float()).to(scale_q.dtype)
        out["weight"] = _requantize_fp8(q["weight"], scale_q, top)
        g["weight"] = _requantize_fp8(gate["weight"], scale_g, top)
        out["weight_scale"] = g["weight_scale"] = top
    for key in q:
        a, b = out[key], g[key]
        if a.numel() == 1 and a.ndim <= 1:
            out[key] = _one_scalar(key, a, b, where)
        elif a.shape != b.shape or a.shape[0] % num_heads:
            raise WeightMappingError(
                f"{where}: {key} of q_proj {list(a.shape)} and self_attn.gate_proj "
                f"{list(b.shape)} cannot be interleaved per head ({num_heads} heads)")
        else:
            out[key] = interleave_heads(a, b, num_heads)
    return out


def _one_scalar(key: str, a: torch.Tensor, b: torch.Tensor, where: str) -> torch.Tensor:
    if torch.equal(a, b):
        return a
    if key == "input_scale":
        return torch.maximum(a, b)
    raise WeightMappingError(f"{where}: q_proj and self_attn.gate_proj have different {key} "
                             f"({float(a)} vs {float(b)}); Linears that share an input must "
                             "share it (ModelOpt's fused-input rule)")


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
    rows = t.shape[0] // num_kv_heads
    return _rows_cat([t[h * rows:(h + 1) * rows] for h in range(num_kv_heads) for _ in range(reps)])


def duplicate_kv_part(part: str, weights: Mapping[str, torch.Tensor], num_kv_heads: int,
                      tp_size: int) -> dict[str, torch.Tensor]:
    """One fused-QKV part's dict with its head-row tensors duplicated (k_proj / v_proj only)."""
    if part not in ("k_proj", "v_proj"):
        return dict(weights)
    return {key: duplicate_kv_heads(value, num_kv_heads, tp_size)
            if key in KV_HEAD_ROW_PARAMS and value.ndim >= 1 else value
            for key, value in weights.items()}


def gate_bias_shard(bias: torch.Tensor, num_heads: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Rank tp_rank's entries of self_attn.gate_bias [Hq]: its query heads, as q_proj's rows."""
    if bias.ndim != 1 or bias.shape[0] != num_heads or num_heads % tp_size:
        raise WeightMappingError(f"self_attn.gate_bias of shape {list(bias.shape)}: expected "
                                 f"[{num_heads}] split evenly over {tp_size} ranks")
    local = num_heads // tp_size
    return bias[tp_rank * local:(tp_rank + 1) * local]


def rename_expert_weights(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`{e}.gate_proj.weight_scale` -> `{e}.w1.weight_scale` (the keys TRT-LLM's MoE loads);
    the fused `gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I] become
    `{e}.w1.weight`, `{e}.w3.weight` and `{e}.w2.weight`."""
    out = {}
    for key, value in weights.items():
        if key in FUSED_EXPERTS:
            out.update(_unfuse_experts(key, value[:]))  # [:]: a lazy slice becomes a tensor
            continue
        hit = re.fullmatch(r"(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)", key)
        if hit is None:
            raise WeightMappingError(f"expert tensor {key}: expected '<e>.<gate|up|down>_proj."
                                     "<param>', 'gate_up_proj' or 'down_proj'")
        out[f"{hit.group(1)}.{EXPERT_RENAMES[hit.group(2)]}.{hit.group(3)}"] = value
    return out


def _unfuse_experts(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    if value.ndim != 3 or (key == "gate_up_proj" and value.shape[1] % 2):
        raise WeightMappingError(f"fused expert tensor {key} of shape {list(value.shape)}: "
                                 "expected [E, 2I, H] (gate_up_proj) or [E, H, I] (down_proj)")
    if key == "down_proj":
        return {f"{e}.w2.weight": value[e] for e in range(value.shape[0])}
    inner = value.shape[1] // 2
    out = {}
    for e in range(value.shape[0]):
        out[f"{e}.w1.weight"], out[f"{e}.w3.weight"] = value[e, :inner], value[e, inner:]
    return out


# ------------------------------------------------------------------- the whole mapping, pure
def module_loads(cfg: BeamConfig, tensors: Mapping[str, torch.Tensor], tp_size: int = 1,
                 complete: bool = True) -> dict[str, list[dict[str, torch.Tensor]]]:
    """TRT-LLM module path -> the list of dicts its `load_weights(weights=...)` receives
    (one dict per fused part, in part order; one dict otherwise), with every transform applied:
    the output gate merged into the q part, KV duplication for `tp_size`, expert renames."""
    plan = plan_weights(cfg, tensors.keys(), complete)
    out: dict[str, list[dict[str, torch.Tensor]]] = {}
    for module, parts in plan.items():
        short = module.rsplit(".", 1)[-1]
        if short in FUSED_MODULES:
            loads = [duplicate_kv_part(p, {k: tensors[n] for k, n in parts.get(p, {}).items()},
                                       cfg.num_key_value_heads, tp_size)
                     for p in FUSED_MODULES[short]]
            if short == "qkv_proj":
                gate = {k: tensors[n] for k, n in parts.get(ATTN_GATE, {}).items()}
                loads[0] = merge_gate_into_q(loads[0], gate, cfg.num_attention_heads, module)
            out[module] = loads
            continue
        loaded = {k: tensors[n] for k, n in parts[None].items()}
        out[module] = [rename_expert_weights(loaded) if short == "experts" else loaded]
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
            out[key] = _rows_cat(values)
        elif all(torch.equal(v, values[0]) for v in values[1:]):
            out[key] = values[0]
        elif key == "weight_scale_2":
            raise WeightMappingError(f"{module}: parts have different weight_scale_2 "
                                     f"{[float(v) for v in values]}; NVFP4 Linears that share "
                                     "an input must share it (ModelOpt's fused-input rule)")
        else:
            out[key] = torch.stack(values)
    return out
