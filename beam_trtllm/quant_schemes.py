"""The quantization scheme a checkpoint declares, and whether beam-trt runs it.

Read from `config.json["quantization_config"]` (and ModelOpt's `hf_quant_config.json`):
- none: BF16 / FP16 / FP32 (each Linear's format is then read off its tensors);
- ModelOpt (`quant_method: modelopt`): `quant_algo` FP8, NVFP4, W4A16_NVFP4 (NVFP4 weights,
  BF16 activations: what Hopper runs anyway), fp8_pb_wo, or MIXED_PRECISION of those. Refused by
  name: AWQ (NVFP4_AWQ's pre_quant_scale, INT4 W4A16_AWQ / W4A8_AWQ), INT8 SmoothQuant,
  W4A8 and MX formats;
- compressed-tensors (`quant_method: compressed-tensors`): only FP8_DYNAMIC, as published FP8
  Beam checkpoints are (format `float-quantized`, 8-bit float weights per channel, static and
  symmetric; 8-bit float activations per token, dynamic), any number of config groups of that
  scheme, and the `ignore` list (names or `re:` patterns, the library's own matching).
  Refused by name: int weights or activations, group / block / tensor weight strategies,
  static activations, weight-only schemes, output activations, other formats, KV schemes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

MODELOPT_ALGOS = ("FP8", "NVFP4", "W4A16_NVFP4", "fp8_pb_wo", "FP8_PB_WO")
CT_FORMAT = "float-quantized"


class SchemeError(ValueError):
    """A checkpoint whose quantization scheme beam-trt does not run; the message names it."""


@dataclass
class Scheme:
    method: str  # "none" | "modelopt" | "compressed-tensors"
    algo: str = ""  # ModelOpt quant_algo, or "FP8_DYNAMIC"
    targets: list[str] = field(default_factory=list)  # compressed-tensors: the groups' targets
    ignore: list[str] = field(default_factory=list)  # compressed-tensors: modules left unquantized

    def ct_quantized(self, module: str) -> bool:
        """Whether compressed-tensors quantizes Linear `module` (a target, not ignored), by the
        library's own name matching ("Linear" targets every Linear by class)."""
        from compressed_tensors.utils.match import match_name

        if any(match_name(module, pattern) for pattern in self.ignore):
            return False
        return any(t == "Linear" or match_name(module, t) for t in self.targets)

    def describe(self) -> str:
        if self.method == "none":
            return "unquantized"
        if self.method == "modelopt":
            return f"ModelOpt {self.algo or 'weights unquantized'}"
        shown = ", ".join(self.ignore[:3]) + (f", ... ({len(self.ignore)})"
                                              if len(self.ignore) > 3 else "")
        return (f"compressed-tensors FP8_DYNAMIC ({CT_FORMAT}: FP8 weights per channel, FP8 "
                f"activations per token, dynamic; ignore [{shown}])")


def read_scheme(ckpt_dir: str | Path) -> Scheme:
    ckpt_dir = Path(ckpt_dir)
    config = json.loads((ckpt_dir / "config.json").read_text())
    qcfg = config.get("quantization_config")
    hfq_path = ckpt_dir / "hf_quant_config.json"
    if qcfg is None and hfq_path.is_file():
        qcfg = {"quant_method": "modelopt", **json.loads(hfq_path.read_text())["quantization"]}
    if qcfg is None:
        return Scheme("none")
    where = f"{ckpt_dir / 'config.json'}: quantization_config"
    method = qcfg.get("quant_method")
    if method == "modelopt":
        return _modelopt(qcfg, where)
    if method == "compressed-tensors":
        return _compressed_tensors(qcfg, where)
    raise SchemeError(f"{where}: quant_method {method!r} is not one beam-trt builds (modelopt, "
                      "compressed-tensors, or an unquantized checkpoint)")


def _modelopt(q: dict, where: str) -> Scheme:
    algo = q.get("quant_algo")
    algos = [algo]
    if algo == "MIXED_PRECISION":
        algos = sorted({layer.get("quant_algo") for layer in
                        (q.get("quantized_layers") or {}).values()}, key=str)
    for a in algos:
        # quant_algo null: the weights are left unquantized (a recipe that quantizes only
        # the KV cache writes that)
        if a is not None and a not in MODELOPT_ALGOS:
            raise SchemeError(f"{where}: ModelOpt quant_algo {a!r} is not a scheme beam-trt runs "
                              f"({_modelopt_why(str(a))}); supported: FP8, NVFP4, W4A16_NVFP4, "
                              "fp8_pb_wo and MIXED_PRECISION of those")
    kv = q.get("kv_cache_quant_algo")
    if kv not in (None, "FP8"):
        raise SchemeError(f"{where}: ModelOpt kv_cache_quant_algo {kv!r}: only FP8 KV scales "
                          "are read")
    return Scheme("modelopt", algo)


def _modelopt_why(algo: str) -> str:
    if "AWQ" in algo:
        return "AWQ: activation pre_quant_scale and, for W4A16_AWQ / W4A8_AWQ, INT4 weights"
    if algo.startswith("INT8") or algo.startswith("W8A8"):
        return "INT8 SmoothQuant"
    return "no beam:: kernel for it"


def _compressed_tensors(q: dict, where: str) -> Scheme:
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    try:
        config = QuantizationConfig.model_validate(q)
    except ValidationError as exc:
        raise SchemeError(f"{where}: not a compressed-tensors quantization config "
                          f"({exc.errors()[0]['msg']})") from exc
    if q.get("kv_cache_scheme"):
        raise SchemeError(f"{where}: compressed-tensors kv_cache_scheme is not supported "
                          "(FP8 KV needs ModelOpt k_scale / v_scale)")
    targets = []
    for name, group in config.config_groups.items():
        _check_ct_group(f"{where}.config_groups.{name}", group, _v(group.format or config.format))
        targets += list(group.targets)
    return Scheme("compressed-tensors", "FP8_DYNAMIC", targets, list(config.ignore or []))


def _v(field) -> str:
    """An enum field of compressed-tensors' pydantic models as its string (they may store either)."""
    return str(getattr(field, "value", field))


def _check_ct_group(where: str, group, fmt: str) -> None:
    """FP8_DYNAMIC or a SchemeError naming what differs."""
    w, a = group.weights, group.input_activations
    if fmt != CT_FORMAT:
        raise SchemeError(f"{where}: format {fmt!r}; beam-trt runs compressed-tensors "
                          f"{CT_FORMAT!r} FP8 only")
    if w is None:
        raise SchemeError(f"{where}: no weights scheme (activation-only quantization)")
    if _v(w.type) != "float" or w.num_bits != 8:
        raise SchemeError(f"{where}: weights {_v(w.type)}{w.num_bits} (e.g. int8 W8A8); "
                          "beam-trt runs FP8 (float, 8 bits) weights only")
    if _v(w.strategy) != "channel":
        raise SchemeError(f"{where}: weights strategy {_v(w.strategy)!r} "
                          f"(group_size {w.group_size}, block {w.block_structure}); beam-trt "
                          "runs per-channel FP8 weights only (group-wise / block / per-tensor "
                          "compressed-tensors schemes are not supported)")
    if not w.symmetric or w.dynamic:
        raise SchemeError(f"{where}: weights must be static and symmetric")
    if a is None:
        raise SchemeError(f"{where}: weight-only (no input_activations); beam-trt runs FP8 "
                          "weights with dynamic per-token FP8 activations only")
    if _v(a.type) != "float" or a.num_bits != 8:
        raise SchemeError(f"{where}: input_activations {_v(a.type)}{a.num_bits}; beam-trt "
                          "runs FP8 (float, 8 bits) activations only")
    if a.dynamic is not True or _v(a.strategy) != "token":
        raise SchemeError(f"{where}: input_activations {_v(a.strategy)!r}, dynamic "
                          f"{a.dynamic} (static activations); beam-trt runs dynamic per-token "
                          "FP8 activations only")
    if group.output_activations is not None:
        raise SchemeError(f"{where}: output_activations are not supported")
