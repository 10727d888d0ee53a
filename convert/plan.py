"""The conversion plan: every output tensor (name, dtype, shape) and the work units that make them.

Known before any tensor is read, so output headers can be written first and a killed run can
resume at a unit boundary. A unit is one input tensor copied as is, or a group of Linears that
ModelOpt 0.47 quantizes together on transformers' BeamForCausalLM (checked byte for byte by
tests/test_convert_modelopt.py):
- Linears that read one input (q/k/v and the attention's output gate `self_attn.gate_proj` of a
  layer; gate/up of a dense MLP) are fused by ModelOpt's `preprocess_linear_fusion`: in NVFP4
  (and W4A16 NVFP4) they share `weight_scale_2` (the max of their amax) and `input_scale`. FP8
  per tensor: never fused. fp8_pb_wo: fused too, but the rule only acts when the first member's
  weight is a single 128x128 block (`amax.numel() == 1`); for larger weights nothing is shared.
- An expert's gate and up are one fused `gate_up_proj` [2I, H] in transformers, quantized by
  ModelOpt's `_QuantFusedExperts` with ONE weight quantizer and split on export: they share the
  weight amax in every format (NVFP4 `weight_scale_2`, FP8 `weight_scale`). In fp8_pb_wo the
  gate_up block amax is sliced at the gate/up boundary: one shared scale when gate_up is a single
  128x128 block, per-projection scales when I is a multiple of 128; any other I cannot be
  exported by ModelOpt (it fails on the slice) and is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from beam_trtllm.checkpoint import expected_tensors
from beam_trtllm.config import BeamConfig
from beam_trtllm.quant_formats import FP8_BLOCK, NVFP4_BLOCK

from .errors import ConvertError
from .recipe import WEIGHT_ONLY, Recipe

F32, U8, FP8 = torch.float32, torch.uint8, torch.float8_e4m3fn
FUSES = {"nvfp4", "w4a16_nvfp4", "fp8_pb_wo"}
ACT_SCALED = {"fp8", "nvfp4"}  # formats whose Linears carry an input_scale when calibrated


@dataclass
class Unit:
    kind: str  # "copy" | "linear" | "kv"
    inputs: list[str]  # input tensor names read by the unit
    modules: list[str] = field(default_factory=list)  # Linear modules (kind "linear")
    fmt: str = "none"
    outputs: list[tuple[str, torch.dtype, tuple[int, ...]]] = field(default_factory=list)
    layer: int = -1

    @property
    def fused(self) -> bool:
        return len(self.modules) > 1


@dataclass
class Plan:
    cfg: BeamConfig
    recipe: Recipe
    formats: dict[str, str]  # every Linear module -> effective format
    units: list[Unit]
    calibrated: bool
    kv_fp8: bool

    @property
    def outputs(self):
        return [o for u in self.units for o in u.outputs]


def linear_modules(cfg: BeamConfig) -> dict[str, tuple[int, int]]:
    """Linear module name -> weight shape, in checkpoint (= module) order."""
    return {n[: -len(".weight")]: shape for n, (shape, _) in expected_tensors(cfg).items()
            if n.endswith("_proj.weight") or n == "lm_head.weight"}


def input_groups(cfg: BeamConfig) -> list[list[str]]:
    """Linears that read one input tensor (what ModelOpt's export-time dummy forward finds)."""
    out = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        attention = ("q_proj", "k_proj", "v_proj", "gate_proj")  # gate_proj: the output gate
        out.append([p + "self_attn." + proj for proj in attention])
        if not cfg.is_moe(i):
            out.append([p + "mlp.gate_proj", p + "mlp.up_proj"])
    return out


def expert_groups(cfg: BeamConfig) -> list[list[str]]:
    """[gate_proj, up_proj] of every expert: one fused gate_up_proj in transformers."""
    return [[f"model.layers.{i}.mlp.experts.{e}.{proj}" for proj in ("gate_proj", "up_proj")]
            for i in cfg.moe_layers for e in range(cfg.num_experts)]


def _one_format(group: list[str], formats, why: str) -> str | None:
    """The format all quantized members share (None: no member is quantized)."""
    fmts = {formats[m] for m in group if formats[m] != "none"}
    if len(fmts) > 1:
        raise ConvertError(f"recipe gives {', '.join(group)} different formats ({sorted(fmts)}); "
                           f"{why}")
    return fmts.pop() if fmts else None


def _fused_groups(cfg: BeamConfig, formats, shapes) -> dict[str, list[str]]:
    """first member -> group, for groups whose members share scales."""
    fused = {}
    for group in input_groups(cfg):
        fmt = _one_format(group, formats, "Linears that share an input must share a format "
                                          "(ModelOpt fuses them)")
        group = [m for m in group if formats[m] != "none"]  # unquantized members never fuse
        if len(group) < 2 or fmt not in FUSES:
            continue
        n, k = shapes[group[0]]
        if fmt == "fp8_pb_wo" and (n > FP8_BLOCK or k > FP8_BLOCK):
            continue
        fused[group[0]] = group
    for group in expert_groups(cfg):  # one format per layer's experts: _check_expert_formats
        fmt = formats[group[0]]
        if fmt == "none":
            continue
        if fmt == "fp8_pb_wo" and not _gate_up_one_block(cfg):
            if cfg.moe_intermediate_size % FP8_BLOCK:
                raise ConvertError(
                    f"fp8_pb_wo experts: moe_intermediate_size {cfg.moe_intermediate_size} is not "
                    f"a multiple of {FP8_BLOCK}, so the gate/up boundary cuts a 128x128 block of "
                    "the fused gate_up_proj (ModelOpt cannot export that either)")
            continue  # block-aligned: per-projection scales equal ModelOpt's sliced block amax
        fused[group[0]] = group
    return fused


def _gate_up_one_block(cfg: BeamConfig) -> bool:
    return 2 * cfg.moe_intermediate_size <= FP8_BLOCK and cfg.hidden_size <= FP8_BLOCK


def _check_expert_formats(cfg: BeamConfig, formats) -> None:
    """A layer's experts are one module (`mlp.experts`) to ModelOpt: one format for all."""
    for i in cfg.moe_layers:
        prefix = f"model.layers.{i}.mlp.experts."
        fmts = sorted({f for m, f in formats.items() if m.startswith(prefix)})
        if len(fmts) > 1:
            raise ConvertError(f"recipe gives the experts of layer {i} several formats ({fmts}); "
                               f"ModelOpt quantizes a layer's fused experts ({prefix[:-1]}) "
                               "with one format")


def linear_outputs(module: str, fmt: str, shape, dtype, calibrated: bool):
    n, k = shape
    w = module + ".weight"
    if fmt == "none":
        return [(w, dtype, (n, k))]
    if fmt in ("nvfp4", "w4a16_nvfp4"):
        if k % NVFP4_BLOCK:
            raise ConvertError(f"tensor {w}: NVFP4 needs the input dim to be a multiple of "
                               f"{NVFP4_BLOCK}, it is {k}")
        outs = [(w, U8, (n, k // 2)), (module + ".weight_scale", FP8, (n, k // NVFP4_BLOCK)),
                (module + ".weight_scale_2", F32, ())]
    elif fmt == "fp8":
        outs = [(w, FP8, (n, k)), (module + ".weight_scale", F32, ())]
    elif fmt == "fp8_channel":  # compressed-tensors: the scale in the model dtype, [N, 1]
        outs = [(w, FP8, (n, k)), (module + ".weight_scale", dtype, (n, 1))]
    else:  # fp8_pb_wo: ModelOpt keeps the block-amax dims; one block -> 0-d
        nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
        scale_shape = () if nb * kb == 1 else (nb, 1, kb, 1)
        outs = [(w, FP8, (n, k)), (module + ".weight_scale", F32, scale_shape)]
    if calibrated and fmt in ACT_SCALED:
        outs.append((module + ".input_scale", F32, ()))
    return outs


def make_plan(cfg: BeamConfig, recipe: Recipe, calibrated: bool, kv_fp8: bool) -> Plan:
    shapes = linear_modules(cfg)
    formats = {m: recipe.format_of(m) for m in shapes}
    if not calibrated:
        formats = {m: WEIGHT_ONLY[f] for m, f in formats.items()}
    _check_expert_formats(cfg, formats)
    fused = _fused_groups(cfg, formats, shapes)
    member_of = {m: g[0] for g in fused.values() for m in g}
    units: list[Unit] = []
    for name, (shape, dtype) in expected_tensors(cfg).items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        module = name[: -len(".weight")]
        if module not in shapes:
            units.append(Unit("copy", [name], outputs=[(name, dtype, shape)], layer=layer))
            continue
        lead = member_of.get(module, module)
        if lead != module:
            continue  # emitted with its group's first member
        group = fused.get(module, [module])
        unit = Unit("linear", [m + ".weight" for m in group], group, formats[module], layer=layer)
        for m in group:
            unit.outputs += linear_outputs(m, formats[m], shapes[m], dtype, calibrated)
        units.append(unit)
        if kv_fp8 and calibrated and module.endswith("self_attn.q_proj"):
            p = module[: -len("q_proj")]
            units.append(Unit("kv", [], outputs=[(p + "k_proj.k_scale", F32, ()),
                                                 (p + "v_proj.v_scale", F32, ())], layer=layer))
    return Plan(cfg, recipe, formats, units, calibrated, kv_fp8)
