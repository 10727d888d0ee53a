"""Recipes are data: `convert/recipes/<name>.yaml` maps module-name patterns to a tensor format.

A rule list is matched in order (fnmatch on the module name, i.e. the weight name without
`.weight`); the first match wins. Formats: `fp8` (per tensor), `fp8_pb_wo` (128x128 blocks),
`nvfp4`, `fp8_channel` (compressed-tensors FP8_DYNAMIC: per-channel weights, dynamic
per-token activations; `--format compressed-tensors` only), `none` (kept in BF16). Rules only ever see Linear modules: embeddings, the MoE
router `mlp.gate` (weight and bias, FP32), the norms and the attention's `self_attn.gate_bias`
are never quantized, whatever a recipe says. Mind the two gates: `*.self_attn.gate_proj` is
the attention's output gate (a Linear as large as q_proj), `*.mlp.gate_proj` the MLP's.

Without calibration data a recipe runs weight-only: `nvfp4` becomes ModelOpt's `w4a16_nvfp4`
and FP8 Linears carry no `input_scale` (see docs/CONVERT.md).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from .errors import ConvertError

FORMATS = ("fp8", "fp8_pb_wo", "nvfp4", "fp8_channel", "none")
WEIGHT_ONLY = {"nvfp4": "w4a16_nvfp4", "fp8": "fp8", "fp8_pb_wo": "fp8_pb_wo",
               "fp8_channel": "fp8_channel", "none": "none"}  # fp8_channel: dynamic activations


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    rules: tuple[tuple[str, str], ...]
    source: str

    def format_of(self, module: str) -> str:
        for pattern, fmt in self.rules:
            if fnmatch.fnmatchcase(module, pattern):
                return fmt
        return "none"

    def to_json(self) -> dict:
        return {"name": self.name, "description": self.description,
                "rules": [{"match": p, "format": f} for p, f in self.rules], "source": self.source}


def builtin_names() -> list[str]:
    folder = resources.files("convert").joinpath("recipes")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_recipe(name_or_path: str) -> Recipe:
    """A shipped recipe by name (`fp8`, `fp8-block`, `nvfp4`, `nvfp4-all`) or a YAML file path."""
    if name_or_path in builtin_names():
        text = resources.files("convert").joinpath("recipes", f"{name_or_path}.yaml").read_text()
        source = f"builtin:{name_or_path}"
    elif name_or_path.endswith((".yaml", ".yml")) and Path(name_or_path).is_file():
        text, source = Path(name_or_path).read_text(), str(Path(name_or_path).resolve())
    else:
        raise ConvertError(f"--quant {name_or_path!r}: not a shipped recipe "
                           f"({', '.join(builtin_names())}) nor a recipe .yaml file")
    return parse_recipe(text, source)


def parse_recipe(text: str, source: str) -> Recipe:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConvertError(f"{source}: not valid YAML ({exc})") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("rules"), list) or "name" not in raw:
        raise ConvertError(f"{source}: a recipe needs `name` and a `rules` list")
    rules = []
    for i, rule in enumerate(raw["rules"]):
        if not isinstance(rule, dict) or set(rule) != {"match", "format"}:
            raise ConvertError(f"{source}: rules[{i}] must be {{match: PATTERN, format: FORMAT}}")
        if rule["format"] not in FORMATS:
            raise ConvertError(f"{source}: rules[{i}].format {rule['format']!r} is not one of "
                               f"{', '.join(FORMATS)}")
        rules.append((str(rule["match"]), rule["format"]))
    return Recipe(str(raw["name"]), str(raw.get("description", "")), tuple(rules), source)
