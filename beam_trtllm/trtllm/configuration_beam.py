"""Beam's Hugging Face config as TensorRT-LLM's model sees it. Needs only `transformers`.

transformers >= 5.24 ships the canonical `BeamConfig` for `model_type: "beam"`, and TRT-LLM's
`ModelConfig.from_pretrained` gets it from `AutoConfig`: that class is used as is and is never
replaced (replacing it would change how every other user of "beam" in the process reads a
config). Older transformers releases (TRT-LLM may pin one) have no "beam";
`register_hf_config()` then registers `BeamHfConfig`, a plain `PretrainedConfig` carrying the
same canonical fields, so the checkpoint still reads.

Either way the model reads the architecture through `beam_config(pretrained_config)`: the
project's validated `BeamConfig`, so a config.json that contradicts itself is refused with the
field named before TRT-LLM builds anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from beam_trtllm.config import BeamConfig, ConfigError

# The canonical fields BeamHfConfig sets itself; token ids and the dtype are PretrainedConfig
# fields too, left to it.
_OWN_FIELDS = tuple(f.name for f in dataclasses.fields(BeamConfig)
                    if f.name not in ("unknown_fields", "dtype")
                    and not f.name.endswith("_token_id"))


class BeamHfConfig(PretrainedConfig):
    """The fallback "beam" config for transformers releases without one: the canonical fields
    (those of transformers' BeamConfig), validated by `BeamConfig`."""

    model_type = "beam"

    def __init__(self, **kwargs: Any) -> None:
        try:  # validate first (every key: a v1 field is refused too), naming the field
            beam = BeamConfig.from_hf({**kwargs, "model_type": "beam"})
        except ConfigError as exc:
            raise ConfigError(f"Beam config.json: {exc}") from None
        for name in _OWN_FIELDS:
            kwargs.pop(name, None)
        dtype = kwargs.pop("torch_dtype", None) or kwargs.pop("dtype", None) or "bfloat16"
        kwargs.setdefault("architectures", ["BeamForCausalLM"])
        kwargs["tie_word_embeddings"] = beam.tie_word_embeddings
        super().__init__(**kwargs)
        for name in _OWN_FIELDS:
            value = getattr(beam, name)
            object.__setattr__(self, name, list(value) if isinstance(value, tuple) else value)
        _set_dtype(self, dtype)


def _set_dtype(config: PretrainedConfig, dtype: Any) -> None:
    """TRT-LLM reads `torch_dtype`; transformers 5 renamed it `dtype` (the old name is a property
    that warns). Store the torch.dtype under whichever the installed transformers keeps."""
    import torch

    value = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if isinstance(getattr(type(config), "torch_dtype", None), property):
        config.dtype = value  # transformers >= 5: torch_dtype is an alias of dtype
    else:
        config.torch_dtype = value


def beam_config(pretrained_config: Any) -> BeamConfig:
    """The validated BeamConfig of any config object or dict carrying Beam's HF fields
    (transformers' BeamConfig, BeamHfConfig, or a plain dict in tests)."""
    raw = pretrained_config if isinstance(pretrained_config, dict) else pretrained_config.to_dict()
    # Every key, not only the known ones: a v1 field kept as a plain attribute (transformers'
    # config keeps unknown keys) is refused instead of read as the default of its successor.
    return BeamConfig.from_hf({**raw, "model_type": "beam"})


def installed_beam_config_class() -> type | None:
    """The config class transformers maps "beam" to in this process, or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING["beam"] if "beam" in CONFIG_MAPPING else None


def register_hf_config() -> type:
    """Make `AutoConfig.from_pretrained(ckpt)` able to read a Beam checkpoint in this process,
    and return the class it will use: transformers' own BeamConfig when it has one (never
    replaced), else BeamHfConfig, registered here."""
    existing = installed_beam_config_class()
    if existing is not None:
        return existing
    AutoConfig.register("beam", BeamHfConfig)
    return BeamHfConfig
