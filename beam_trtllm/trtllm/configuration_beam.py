"""Beam's Hugging Face config class, so `AutoConfig` (which TRT-LLM's `ModelConfig.from_pretrained`
calls) can read a checkpoint whose `model_type` is "beam". Needs only `transformers`.

Every Beam field is validated by `BeamConfig` (the single source of architecture facts): a
config.json that contradicts itself is refused with the field named, before TRT-LLM builds
anything. TRT-LLM's own code reads a few fields under other names; they are derived here:
`num_experts` (create_moe's default expert count), `torch_dtype` (module dtypes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from beam_trtllm.config import BeamConfig, ConfigError

_BEAM_FIELDS = tuple(f.name for f in dataclasses.fields(BeamConfig))
# Token ids are PretrainedConfig fields too: leave them to it.
_OWN_FIELDS = tuple(n for n in _BEAM_FIELDS if not n.endswith("_token_id"))


class BeamHfConfig(PretrainedConfig):
    model_type = "beam"

    def __init__(self, **kwargs: Any) -> None:
        values = {name: kwargs.pop(name) for name in _OWN_FIELDS if name in kwargs}
        token_ids = {n: kwargs.get(n) for n in ("bos_token_id", "eos_token_id", "pad_token_id")
                     if kwargs.get(n) is not None}
        try:  # validate first, so a bad config.json is refused with the field named
            beam = BeamConfig.from_hf({**values, **token_ids, "model_type": "beam"})
        except ConfigError as exc:
            raise ConfigError(f"Beam config.json: {exc}") from None
        dtype = kwargs.pop("torch_dtype", None) or kwargs.pop("dtype", None) or "bfloat16"
        kwargs.setdefault("architectures", ["BeamForCausalLM"])
        kwargs["tie_word_embeddings"] = beam.tie_word_embeddings
        super().__init__(**kwargs)
        for name in _OWN_FIELDS:
            value = getattr(beam, name)
            object.__setattr__(self, name, list(value) if isinstance(value, tuple) else value)
        self.num_experts = beam.n_routed_experts
        _set_dtype(self, dtype)

    def beam_config(self) -> BeamConfig:
        """The validated BeamConfig this HF config describes."""
        return beam_config(self)


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
    """BeamConfig from any config object or dict carrying Beam's HF fields (TRT-LLM hands the
    model a PretrainedConfig; tests hand it a dict)."""
    raw = pretrained_config if isinstance(pretrained_config, dict) else {
        name: getattr(pretrained_config, name) for name in _BEAM_FIELDS
        if getattr(pretrained_config, name, None) is not None}
    return BeamConfig.from_hf({**raw, "model_type": "beam"})


def register_hf_config() -> None:
    """Make `AutoConfig.from_pretrained(ckpt)` return a BeamHfConfig in this process.

    `exist_ok=True` on purpose: recent transformers releases ship their own "beam" config whose
    field and tensor names differ from this project's spec (docs/TRTLLM.md), and a checkpoint
    this project writes must be read with the spec's fields. Only a process that imports the
    TRT-LLM model module (an explicit choice to serve this layout) is affected."""
    AutoConfig.register("beam", BeamHfConfig, exist_ok=True)
