"""Reading a Beam config.json into BeamConfig's fields (beam_trtllm/config.py): the file, the
fields it may hold besides the architecture, the refusal of beam-trt's pre-canonical (v1)
configs, and the unknown fields BeamConfig keeps and reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping


class ConfigError(ValueError):
    """A Beam config that is malformed or contradicts itself; the message names the field."""


# Keys of a config.json that describe the file, not the architecture (written by transformers'
# PreTrainedConfig / save_pretrained, or by quantizers): read without a report.
_METADATA_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "quantization_config",
    "_name_or_path", "auto_map",
})
# Fields of this project's v1 config, which no canonical checkpoint has: reading one is an error
# that says what the file is (a v1 config would otherwise read as the wrong model).
_V1_FIELDS = {
    "n_routed_experts": "num_experts", "first_k_dense_replace": "mlp_layer_types",
    "ssmax_base": "(none: SSMax constants are fixed)", "ssmax_exponent": "(none)",
    "residual_scaling": "(none: depth scaling is fixed)",
}


def read_raw(source: str | Path | Mapping[str, Any]) -> tuple[dict, str]:
    """(the config dict, where it came from) of a config.json path, a checkpoint dir or a dict."""
    if isinstance(source, Mapping):
        return dict(source), "config"
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw, str(path)


def split_fields(raw: dict, names: set[str], where: str) -> tuple[dict, dict]:
    """(BeamConfig keyword arguments, unknown fields) of a config dict; refuses another
    model type and a v1 config, naming the field."""
    model_type = raw.get("model_type", "beam")
    if model_type != "beam":
        raise ConfigError(f"{where}: model_type is {model_type!r}, expected 'beam'")
    v1 = sorted(k for k in raw if k in _V1_FIELDS)
    if v1:
        raise ConfigError(
            f"{where}: a config of beam-trt's pre-canonical Beam (v1 field "
            f"{v1[0]!r}; canonical: {_V1_FIELDS[v1[0]]}). That model had a per-head g_proj "
            "gate and no logit softcap; no published Beam checkpoint uses it. Use a "
            "checkpoint saved by transformers' BeamForCausalLM")
    kwargs = {k: v for k, v in raw.items() if k in names}
    if "dtype" not in kwargs and isinstance(raw.get("torch_dtype"), str):
        kwargs["dtype"] = raw["torch_dtype"]
    for name in ("layer_types", "mlp_layer_types"):
        value = kwargs.get(name)
        if value is not None and not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: {name} must be a list of strings")
        if value is None:
            kwargs.pop(name, None)
    unknown = {k: v for k, v in raw.items() if k not in names and k not in _METADATA_KEYS}
    return kwargs, unknown
