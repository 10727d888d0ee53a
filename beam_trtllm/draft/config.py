"""DraftConfig: the config.json of a DFlash2 drafter directory (`DFlash2BeamDraftModel`), read
as vLLM 0.33 and SGLang 0.5.23 read it (shared/research/dflash2.md §1).

Top-level layer fields are transformers' names; the drafter's own fields live under
`dflash_config`. The rules are the stricter engine's where the two differ, so a directory
this accepts loads in both:
- vLLM asserts every `layer_types[i] == "sliding_attention"` and `is_causal` false, and reads
  `target_layer_ids`, `conv_kernel_size`, `conv_group_size`, `selector_rank`,
  `selector_top_k` and `final_logit_softcapping` with `[...]` (a missing key is an error);
- `mask_token_id` is looked up in vLLM's order (dflash_config, top level, then the
  `dspark_noise_token_id` / `pard_token` / `ptd_token_id` aliases);
- `block_size` (anchor included) is SGLang's: dflash_config, then top level, else 16.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

ARCHITECTURE = "DFlash2BeamDraftModel"
SLIDING = "sliding_attention"
DEFAULT_BLOCK_SIZE = 16  # SGLang's when neither dflash_config nor the top level sets one
MASK_TOKEN_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")
# dflash_config keys vLLM reads with [...] (a KeyError there, a named refusal here)
VLLM_REQUIRED = ("target_layer_ids", "conv_kernel_size", "conv_group_size", "selector_rank",
                 "selector_top_k", "final_logit_softcapping")


class DraftError(ValueError):
    """A drafter directory, config field or tensor that does not fit; the message names it."""


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    sliding_window: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    final_logit_softcapping: float
    mask_token_id: int
    output_multiplier: float = 1.0
    num_target_layers: int | None = None  # SGLang's optional dflash_config field

    def __post_init__(self) -> None:
        self._validate()

    @property
    def num_draft_tokens(self) -> int:
        """N: the block's mask rows (the anchor is the block's first row)."""
        return self.block_size - 1

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    # ------------------------------------------------------------------ checks
    def _validate(self) -> None:
        positive = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                    "max_position_embeddings", "sliding_window", "conv_kernel_size",
                    "conv_group_size", "selector_rank", "selector_top_k")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DraftError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftError(f"num_attention_heads {self.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise DraftError(f"head_dim {self.head_dim} must be even (RoPE pairs)")
        if self.block_size < 2:
            raise DraftError(f"block_size {self.block_size} must count the anchor and "
                             "at least one draft")
        if self.hidden_size % self.conv_group_size:
            raise DraftError(f"dflash_config.conv_group_size {self.conv_group_size} "
                             f"must divide hidden_size {self.hidden_size}")
        if self.selector_top_k > self.vocab_size:
            raise DraftError(f"dflash_config.selector_top_k {self.selector_top_k} "
                             f"exceeds vocab_size {self.vocab_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DraftError(f"mask_token_id {self.mask_token_id} is not a token id of "
                             f"the vocabulary (vocab_size {self.vocab_size})")
        if not self.final_logit_softcapping > 0:
            raise DraftError(f"dflash_config.final_logit_softcapping must be > 0, got "
                             f"{self.final_logit_softcapping!r}")
        if not self.output_multiplier > 0:
            raise DraftError(f"dflash_config.output_multiplier must be > 0 (the top-k "
                             f"is taken before it), got {self.output_multiplier!r}")
        ids = self.target_layer_ids
        if not ids or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
            raise DraftError(f"dflash_config.target_layer_ids must be non-negative "
                             f"layer indices, got {list(ids)}")
        if list(ids) != sorted(set(ids)):
            raise DraftError(f"dflash_config.target_layer_ids {list(ids)} must be "
                             "sorted and without duplicates (SGLang's capture requires it)")
        if self.num_target_layers is not None and max(ids) >= self.num_target_layers:
            raise DraftError(f"dflash_config.target_layer_ids {list(ids)} out of range "
                             f"for num_target_layers {self.num_target_layers}")

    def check_target(self, cfg) -> None:
        """Refuse a drafter that does not fit the target `cfg` (a beam_trtllm BeamConfig)."""
        if self.vocab_size != cfg.vocab_size:
            raise DraftError(f"drafter vocab_size {self.vocab_size} != the target's "
                             f"{cfg.vocab_size} (the codebooks and the shared head are [V, .])")
        if self.hidden_size != cfg.hidden_size:
            raise DraftError(f"drafter hidden_size {self.hidden_size} != the target's "
                             f"{cfg.hidden_size} (it takes the target's embed_tokens / lm_head)")
        bad = [i for i in self.target_layer_ids if i >= cfg.num_hidden_layers]
        if bad:
            raise DraftError(f"drafter dflash_config.target_layer_ids {list(self.target_layer_ids)}"
                             f": {bad} out of range for a target of {cfg.num_hidden_layers} layers")
        if self.num_target_layers not in (None, cfg.num_hidden_layers):
            raise DraftError(f"drafter dflash_config.num_target_layers {self.num_target_layers} "
                             f"!= the target's num_hidden_layers {cfg.num_hidden_layers}")
        if self.mask_token_id >= cfg.vocab_size:
            raise DraftError(f"drafter mask_token_id {self.mask_token_id} >= the target's "
                             f"vocab_size {cfg.vocab_size}")

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> "DraftConfig":
        _check_layout(d, source)
        dc = d["dflash_config"]
        try:
            fields = dict(
                hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
                head_dim=d["head_dim"], intermediate_size=d["intermediate_size"],
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), vocab_size=d["vocab_size"],
                max_position_embeddings=d.get("max_position_embeddings", 32768),
                rope_theta=_rope_theta(d, source), sliding_window=d["sliding_window"],
            )
        except KeyError as exc:
            raise DraftError(f"{source}: missing field {exc.args[0]}") from None
        layer_ids = dc["target_layer_ids"]
        if not isinstance(layer_ids, list):
            raise DraftError(f"{source}: dflash_config.target_layer_ids must be a list, got "
                             f"{layer_ids!r}")
        try:
            fields.update(_dflash_fields(d, dc, layer_ids, source))
        except DraftError:
            raise
        except (TypeError, ValueError) as exc:
            raise DraftError(f"{source}: dflash_config: {exc}") from None
        try:
            return cls(**fields)
        except DraftError as exc:
            raise DraftError(f"{source}: {exc}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> "DraftConfig":
        """A drafter dir or its config.json (read as the target's is: config_json.read_raw)."""
        from ..config_json import ConfigError, read_raw

        try:
            raw, where = read_raw(Path(path))
        except ConfigError as exc:
            raise DraftError(f"drafter config: {exc}") from None
        return cls.from_dict(raw, where)

    def to_dict(self) -> dict[str, Any]:
        """config.json as vLLM and SGLang read it (transformers loads it as a `beam` config)."""
        a = asdict(self)
        dflash = {k: a[k] for k in ("block_size", "conv_kernel_size", "conv_group_size",
                                    "selector_rank", "selector_top_k",
                                    "final_logit_softcapping", "mask_token_id",
                                    "output_multiplier")}
        dflash["target_layer_ids"] = list(self.target_layer_ids)
        dflash["sample_from_anchor"] = False
        if self.num_target_layers is not None:
            dflash["num_target_layers"] = self.num_target_layers
        top = {k: a[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "intermediate_size",
                                 "rms_norm_eps", "vocab_size", "max_position_embeddings",
                                 "sliding_window", "block_size", "mask_token_id")}
        return {"architectures": [ARCHITECTURE], "model_type": "beam", **top,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
                "layer_types": [SLIDING] * self.num_hidden_layers, "is_causal": False,
                "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
                "dtype": "bfloat16", "dflash_config": dflash}

    def replace(self, **changes: Any) -> "DraftConfig":
        import dataclasses

        return dataclasses.replace(self, **changes)


def _check_layout(d: Mapping[str, Any], source: str) -> None:
    """The fields whose values vLLM asserts, and the dflash_config keys it requires."""
    arch = d.get("architectures") or []
    if ARCHITECTURE not in arch:
        raise DraftError(f"{source}: architectures {arch} does not name {ARCHITECTURE}")
    dc = d.get("dflash_config")
    if not isinstance(dc, Mapping):
        raise DraftError(f"{source}: missing dflash_config (the drafter's own fields)")
    missing = [k for k in VLLM_REQUIRED if k not in dc]
    if missing:
        raise DraftError(f"{source}: dflash_config lacks {', '.join(missing)} (vLLM requires "
                         "them)")
    if dc.get("sample_from_anchor", False):
        raise DraftError(f"{source}: dflash_config.sample_from_anchor must be false (vLLM)")
    n = d.get("num_hidden_layers")
    types = d.get("layer_types")
    if not isinstance(types, list) or len(types) != n or any(t != SLIDING for t in types):
        raise DraftError(f"{source}: layer_types must list {SLIDING!r} for each of the "
                         f"{n} layers (vLLM asserts it), got {types!r}")
    if d.get("is_causal", True) is not False:
        raise DraftError(f"{source}: is_causal must be false (the drafter's attention is "
                         f"non-causal; SGLang takes a missing one as causal), got "
                         f"{d.get('is_causal')!r}")
    for name, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if name in d and d[name] != want:
            raise DraftError(f"{source}: {name} {d[name]!r} is not supported (only {want!r})")


def _dflash_fields(d: Mapping[str, Any], dc: Mapping[str, Any], layer_ids: list,
                   source: str) -> dict[str, Any]:
    return dict(
        target_layer_ids=tuple(layer_ids),
        block_size=int(dc.get("block_size", d.get("block_size", DEFAULT_BLOCK_SIZE))),
        conv_kernel_size=dc["conv_kernel_size"], conv_group_size=dc["conv_group_size"],
        selector_rank=dc["selector_rank"], selector_top_k=dc["selector_top_k"],
        final_logit_softcapping=float(dc["final_logit_softcapping"]),
        mask_token_id=_mask_token_id(d, source),
        output_multiplier=float(dc.get("output_multiplier", 1.0)),
        num_target_layers=dc.get("num_target_layers"),
    )


def _rope_theta(d: Mapping[str, Any], source: str) -> float:
    """rope_parameters (flat, or per layer type as transformers nests them) or rope_theta."""
    rope = d.get("rope_parameters")
    if rope is None:
        return float(d.get("rope_theta", 10000.0))
    if isinstance(rope, Mapping) and SLIDING in rope:
        rope = rope[SLIDING]
    if not isinstance(rope, Mapping) or rope.get("rope_type", "default") != "default":
        raise DraftError(f"{source}: rope_parameters {rope!r}: only rope_type 'default' is "
                         "supported")
    return float(rope.get("rope_theta", 10000.0))


def _mask_token_id(d: Mapping[str, Any], source: str) -> int:
    dc = d["dflash_config"]
    for where, key in [(dc, "mask_token_id")] + [(d, k) for k in MASK_TOKEN_KEYS]:
        if where.get(key) is not None:
            value = where[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise DraftError(f"{source}: mask_token_id must be an integer, got {value!r}")
            return value
    raise DraftError(f"{source}: no mask_token_id (dflash_config.mask_token_id, or top-level "
                     f"{' / '.join(MASK_TOKEN_KEYS)})")
