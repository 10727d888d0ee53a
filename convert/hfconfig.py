"""`hf_quant_config.json` and `config.json["quantization_config"]` as ModelOpt 0.47 writes them.

Rules (observed on ModelOpt's own exports of transformers' BeamForCausalLM,
tests/test_convert_modelopt.py): ModelOpt lists quantizable modules in transformers' module
order, and a MoE layer's fused experts are ONE module, `model.layers.{i}.mlp.experts`.
- one format for every quantized module: `quant_algo` is that format ("FP8", "NVFP4" +
  group_size 16, "W4A16_NVFP4", "fp8_pb_wo" in lower case), and `exclude_modules` lists the
  unquantized modules ModelOpt sees (Linears or experts left in BF16, the embedding, the MoE
  routers) summarised with prefix wildcards where no quantized module matches them, sorted;
- several formats: "MIXED_PRECISION" with one `quantized_layers` entry per quantized module in
  module order (so one per layer's experts), and no `exclude_modules` (`ignore: []`);
- `kv_cache_quant_algo` "FP8" with FP8 KV, else null; config.json's copy is the
  compressed-tensors style dict of `convert_hf_quant_config_format`.
"""

from __future__ import annotations

import torch
from torch import nn

from beam_trtllm.config import BeamConfig

from .plan import Plan

MODELOPT_VERSION = "0.47.0"
LAYER_CONFIG = {
    "fp8": {"quant_algo": "FP8"},
    "nvfp4": {"quant_algo": "NVFP4", "group_size": 16},
    "w4a16_nvfp4": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
    "fp8_pb_wo": {"quant_algo": "fp8_pb_wo"},
}
_FP8_GROUP = {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
              "weights": {"dynamic": False, "num_bits": 8, "type": "float"}}


def _fp4_group(weights_only: bool, group_size: int) -> dict:
    w = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size}
    return {"weights": w} if weights_only else {"input_activations": dict(w), "weights": w}


def _group_config(algo: str, group_size: int | None) -> dict | None:
    if algo == "FP8":
        return {k: dict(v) for k, v in _FP8_GROUP.items()}
    if algo in ("NVFP4", "W4A16_NVFP4"):
        return _fp4_group(algo == "W4A16_NVFP4", group_size or 16)
    return None


def summarize_excludes(excluded: list[str], quantized: list[str]) -> list[str]:
    """Prefix-wildcard summary of `excluded`: the shortest `prefix*` (cut at a dot), or
    `prefix.*`, that matches no quantized module; else the exact name. Sorted."""
    blocked = set(quantized)  # patterns that would also match a quantized module
    for q in quantized:
        blocked.update(q[:i] + "*" for i in range(len(q) + 1))
    chosen: set[str] = set()
    for name in excluded:
        options = []
        for i, ch in enumerate(name):
            if ch == ".":
                options += [[name[:i] + "*"], [name[:i], name[:i] + ".*"]]
        options.append([name])
        for option in options:
            if any(p in blocked for p in option):
                continue
            if not all(p in chosen for p in option):
                chosen.update(option[1:] if len(option) == 2 else option)
            break
    return sorted(chosen)


_ATTENTION = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "self_attn.gate_proj"]  # o_proj before the output gate, as modeling_beam has them
# The Linears and the experts of a decoder layer in transformers' module order (named_modules of
# BeamDecoderLayer; written out so that a weight-only conversion need not import transformers'
# model, seconds on the CPU box; tests/test_convert_modelopt.py checks it against transformers).
LAYER_MODULES = {"dense": _ATTENTION + ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
                 "sparse": _ATTENTION + ["mlp.experts"]}


def transformers_layer_modules(cfg: BeamConfig, layer: int) -> list[str]:
    """LAYER_MODULES as transformers' BeamDecoderLayer lists them (what the tests compare)."""
    from transformers.models.beam.modeling_beam import BeamDecoderLayer, BeamExperts

    from beam_trtllm.hf_model import hf_config

    with torch.device("meta"):
        module = BeamDecoderLayer(hf_config(cfg), layer)
    return [n for n, m in module.named_modules() if isinstance(m, (nn.Linear, BeamExperts))]


def modelopt_modules(plan: Plan) -> list[tuple[str, str]]:
    """(module, format) of every module ModelOpt's get_quant_config reports, in its order: the
    embedding, each layer's Linears with its experts as one module, lm_head, then the routers."""
    cfg = plan.cfg
    out = [("model.embed_tokens", "none")]
    for i in range(cfg.num_hidden_layers):
        for name in LAYER_MODULES[cfg.mlp_layer_types[i]]:
            module = f"model.layers.{i}.{name}"
            key = module + ".0.gate_proj" if name == "mlp.experts" else module  # one format a layer
            out.append((module, plan.formats[key]))
    out.append(("lm_head", plan.formats["lm_head"]))
    return out + [(f"model.layers.{i}.mlp.gate", "none") for i in cfg.moe_layers]


def hf_quant_config(plan: Plan) -> dict:
    excluded, layers = [], {}
    for module, fmt in modelopt_modules(plan):
        if fmt == "none":
            excluded.append(module)
        else:
            layers[module] = dict(LAYER_CONFIG[fmt])
    quant: dict = {"quant_algo": None, "kv_cache_quant_algo": None}
    kinds = {str(c) for c in layers.values()}
    if len(kinds) > 1:
        quant["quant_algo"] = "MIXED_PRECISION"
        quant["quantized_layers"] = layers
    elif layers:
        quant.update(next(iter(layers.values())))
        quant["exclude_modules"] = summarize_excludes(excluded, list(layers))
    if plan.kv_fp8:
        quant["kv_cache_quant_algo"] = "FP8"
    return {"producer": {"name": "modelopt", "version": MODELOPT_VERSION}, "quantization": quant}


def quantization_config(hf_quant: dict) -> dict:
    """config.json's `quantization_config` (ModelOpt's convert_hf_quant_config_format)."""
    q = hf_quant["quantization"]
    algo, out = q.get("quant_algo"), {}
    if algo == "MIXED_PRECISION":
        by_config: dict[tuple, list[str]] = {}
        for layer, cfg in q["quantized_layers"].items():
            by_config.setdefault(tuple(sorted(cfg.items())), []).append(layer)
        groups = {}
        for i, (key, names) in enumerate(by_config.items()):
            cfg = dict(key)
            group = _group_config(cfg["quant_algo"], cfg.get("group_size")) or {}
            group["targets"] = sorted(names)
            groups[f"group_{i}"] = group
        out["config_groups"] = groups
        out["quantized_layers"] = q["quantized_layers"]
    elif (group := _group_config(algo, q.get("group_size"))) is not None:
        group["targets"] = ["Linear"]
        out["config_groups"] = {"group_0": group}
    out["ignore"] = q.get("exclude_modules") or []
    if algo:
        out["quant_algo"] = algo
    if q.get("kv_cache_quant_algo") == "FP8":
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    out["producer"] = hf_quant["producer"]
    out["quant_method"] = "modelopt"
    return out
