"""BeamConfig: the single source of truth for Beam's architecture facts.

Every field of transformers' `BeamConfig` (model type `beam`, the canonical implementation;
shared/BEAM_SPEC.md "Config") is a field here, with its `config.json` name and default.
Everything else in beam-trt (converter, kernels, engine, serving, the TRT-LLM adapter) derives
shapes and sizes from this object and never re-states them. A field this project does not
know is kept (`unknown_fields`), written back by `to_hf` and reported, never dropped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .config_json import ConfigError, read_raw, split_fields

SLIDING = "sliding_attention"
FULL = "full_attention"
DENSE = "dense"
SPARSE = "sparse"
DEFAULT_ROPE_THETA = 10000.0  # transformers' `default_theta`

KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1.0 / 16}  # NVFP4: 4 bits + one FP8 scale per 16

# SSMax on full (NoPE) layers: s(p) = exp(0.1 * log1p((p + 1) / 2048)), fixed constants with no
# config field (transformers' compute_attention_scaling).
SSMAX_BASE = 2048.0
SSMAX_EXPONENT = 0.1

def default_layer_types(num_hidden_layers: int) -> tuple[str, ...]:
    """Every sixth layer runs full attention, and so does the last one (transformers' rule)."""
    return tuple(
        FULL if (i + 1) % 6 == 0 or i == num_hidden_layers - 1 else SLIDING
        for i in range(num_hidden_layers)
    )


def default_mlp_layer_types(num_hidden_layers: int) -> tuple[str, ...]:
    """Three dense layers, then sparse (transformers' default)."""
    dense = min(3, num_hidden_layers)
    return (DENSE,) * dense + (SPARSE,) * (num_hidden_layers - dense)


def default_rope_parameters(theta: float = DEFAULT_ROPE_THETA) -> dict:
    return {SLIDING: {"rope_type": "default", "rope_theta": theta}, FULL: None}


@dataclass(frozen=True)
class BeamConfig:
    vocab_size: int = 151936
    hidden_size: int = 5120
    intermediate_size: int = 20480
    moe_intermediate_size: int = 2560
    num_hidden_layers: int = 52
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()  # () -> default_layer_types
    mlp_layer_types: tuple[str, ...] = ()  # () -> default_mlp_layer_types
    num_experts: int = 256
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    final_logit_softcapping: float | None = 30.0
    sliding_window: int | None = 512
    rope_parameters: dict | None = field(default=None, hash=False)  # None -> default
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    use_cache: bool = True
    output_router_logits: bool = False
    # Token ids are tokenizer facts, carried so a config.json round-trips.
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: str | None = None  # the checkpoint's dtype as transformers records it
    # Fields of config.json this project does not know: kept, written back, reported.
    unknown_fields: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        layers = tuple(self.layer_types) if self.layer_types else default_layer_types(n)
        mlps = tuple(self.mlp_layer_types) if self.mlp_layer_types else default_mlp_layer_types(n)
        object.__setattr__(self, "layer_types", layers)
        object.__setattr__(self, "mlp_layer_types", mlps)
        if self.rope_parameters is None:
            object.__setattr__(self, "rope_parameters", default_rope_parameters())
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        positive = [
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "num_experts", "num_experts_per_tok", "n_group", "topk_group",
            "max_position_embeddings",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ["rms_norm_eps", "routed_scaling_factor"]:
            if not float(getattr(self, name)) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        cap = self.final_logit_softcapping
        if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
            raise ConfigError(f"final_logit_softcapping must be > 0 or null, got {cap!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act must be 'silu' (Beam's SwiGLU), got {self.hidden_act!r}")
        if self.attention_bias:
            raise ConfigError("attention_bias must be false: Beam's attention projections have "
                              "no bias")
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings must be false for Beam (lm_head is its own "
                              "tensor; vLLM and SGLang refuse tied Beam checkpoints too)")
        self._validate_layer_lists()
        self._validate_rope()
        self._validate_moe()

    def _validate_layer_lists(self) -> None:
        n = self.num_hidden_layers
        for name, allowed in (("layer_types", (SLIDING, FULL)), ("mlp_layer_types", (DENSE, SPARSE))):
            kinds = getattr(self, name)
            if len(kinds) != n:
                raise ConfigError(f"{name} has {len(kinds)} entries but num_hidden_layers is {n}")
            bad = sorted({str(t) for t in kinds if t not in allowed})
            if bad:
                raise ConfigError(f"{name} has unknown kinds {bad}; allowed: "
                                  f"{', '.join(repr(a) for a in allowed)}")
        if self.sliding_layers and not (isinstance(self.sliding_window, int)
                                        and not isinstance(self.sliding_window, bool)
                                        and self.sliding_window > 0):
            raise ConfigError(f"sliding_window must be a positive integer when layer_types has "
                              f"{SLIDING!r} layers, got {self.sliding_window!r}")

    def _validate_rope(self) -> None:
        rope = self.rope_parameters
        if not isinstance(rope, Mapping) or set(rope) - {SLIDING, FULL}:
            raise ConfigError(
                f"rope_parameters must map layer types ({SLIDING!r}, {FULL!r}) to their RoPE "
                f"parameters, got {rope!r}")
        if rope.get(FULL) is not None:
            raise ConfigError(f"rope_parameters[{FULL!r}] must be null: Beam's full layers use "
                              f"no RoPE (NoPE with SSMax), got {rope[FULL]!r}")
        if self.sliding_layers:
            params = rope.get(SLIDING)
            if not isinstance(params, Mapping) or params.get("rope_type", "default") != "default":
                raise ConfigError(f"rope_parameters[{SLIDING!r}] must be default RoPE "
                                  f"({{'rope_type': 'default', 'rope_theta': ...}}), got {params!r}")
            theta = params.get("rope_theta")
            if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
                raise ConfigError(f"rope_parameters[{SLIDING!r}].rope_theta must be > 0, "
                                  f"got {theta!r}")

    def _validate_moe(self) -> None:
        if self.num_experts % self.n_group:
            raise ConfigError(
                f"num_experts ({self.num_experts}) is not divisible by n_group ({self.n_group})")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group}) > n_group ({self.n_group})")
        if self.experts_per_group < 2:
            raise ConfigError(
                f"num_experts / n_group = {self.experts_per_group}: a group score sums the "
                "2 best experts of a group, so each group needs at least 2")
        if self.num_experts_per_tok > self.topk_group * self.experts_per_group:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in the "
                f"kept groups (topk_group * num_experts / n_group = "
                f"{self.topk_group * self.experts_per_group})")

    # ------------------------------------------------------------------ derived facts
    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_group

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_gate_size(self) -> int:
        """Width of the packed q/k/v/gate projection: q, k, v, then the gate (Hq·D)."""
        return 2 * self.q_size + 2 * self.kv_size

    @property
    def rope_theta(self) -> float:
        """The sliding layers' RoPE base (full layers have none)."""
        params = self.rope_parameters.get(SLIDING) or {}
        return float(params.get("rope_theta", DEFAULT_ROPE_THETA))

    def is_full(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == SPARSE

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == DENSE)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == SPARSE)

    def residual_coeffs(self, sublayer: int) -> tuple[float, float]:
        """(a_k, b_k) of sublayer k (k = 2i attention, 2i + 1 FFN of layer i):
        h = rnd(rnd(b_k · y) + rnd(a_k · h)), computed as transformers' depth_scaled_residual_add
        with idx = k + 2: a = sqrt((idx - 1) / idx), b = 1 / sqrt(idx)."""
        idx = sublayer + 2
        return math.sqrt((idx - 1) / idx), 1.0 / math.sqrt(idx)

    # parameter counts --------------------------------------------------------
    @property
    def attention_params(self) -> int:
        h = self.hidden_size
        return (
            3 * h * self.q_size  # q_proj, gate_proj, o_proj
            + 2 * h * self.kv_size  # k_proj, v_proj
            + self.num_attention_heads  # gate_bias
            + 2 * self.head_dim  # q_norm, k_norm
        )

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def router_params(self) -> int:
        return self.num_experts * (self.hidden_size + 1)  # weight + e_score_correction_bias

    def layer_params(self, layer: int, active: bool = False) -> int:
        norms = 4 * self.hidden_size
        if self.is_moe(layer):
            experts = self.num_experts_per_tok if active else self.num_experts
            ffn = experts * self.expert_params + self.router_params
        else:
            ffn = self.dense_mlp_params
        return self.attention_params + norms + ffn

    @property
    def total_params(self) -> int:
        embed_and_head = 2 * self.vocab_size * self.hidden_size + self.hidden_size
        return embed_and_head + sum(self.layer_params(i) for i in range(self.num_hidden_layers))

    @property
    def active_params(self) -> int:
        embed_and_head = 2 * self.vocab_size * self.hidden_size + self.hidden_size
        return embed_and_head + sum(
            self.layer_params(i, active=True) for i in range(self.num_hidden_layers))

    # KV cache ---------------------------------------------------------------
    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """Bytes of KV that grow with context: only full layers keep every token."""
        return len(self.full_layers) * 2 * self.kv_size * _kv_bytes(kv_dtype)

    @property
    def window(self) -> int:
        """Keys a sliding layer keeps per sequence (0 when there is no sliding layer)."""
        return self.sliding_window if self.sliding_layers else 0

    def sliding_kv_bytes_per_sequence(self, kv_dtype: str = "bf16") -> int:
        """Fixed KV of the sliding layers for one sequence (their last `sliding_window` keys)."""
        return len(self.sliding_layers) * self.window * 2 * self.kv_size * _kv_bytes(kv_dtype)

    def kv_bytes(self, context: int, kv_dtype: str = "bf16") -> int:
        """KV bytes of one sequence of `context` tokens (full layers + sliding windows)."""
        window = min(context, self.window)
        sliding = len(self.sliding_layers) * window * 2 * self.kv_size * _kv_bytes(kv_dtype)
        return context * self.kv_bytes_per_token(kv_dtype) + sliding

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_hf(cls, source: str | Path | Mapping[str, Any]) -> "BeamConfig":
        """Build from a config.json path, a checkpoint directory, or a dict. Unknown keys are
        kept in `unknown_fields` (see `report_unknown`); a v1 config is refused."""
        raw, where = read_raw(source)
        names = {f.name for f in dataclasses.fields(cls)} - {"unknown_fields"}
        kwargs, unknown = split_fields(raw, names, where)
        try:
            return cls(**kwargs, unknown_fields=unknown)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except TypeError as exc:  # a value of the wrong JSON type reaching a comparison
            raise ConfigError(f"{where}: {exc}") from None

    def report_unknown(self) -> str | None:
        """One line naming the config.json fields this project does not know, or None."""
        if not self.unknown_fields:
            return None
        return ("config.json has fields beam-trt does not know (kept, written back, not used): "
                + ", ".join(sorted(self.unknown_fields)))

    def to_hf(self, dtype: str | None = None) -> dict[str, Any]:
        """The config.json dict, as transformers' BeamConfig writes it (plus architectures)."""
        out: dict[str, Any] = {"architectures": ["BeamForCausalLM"], "model_type": "beam"}
        for f in dataclasses.fields(self):
            if f.name == "unknown_fields":
                continue
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        if dtype is not None:
            out["dtype"] = dtype
        if out["dtype"] is None:
            del out["dtype"]
        out.update(self.unknown_fields)
        return out

    def replace(self, **changes: Any) -> "BeamConfig":
        return dataclasses.replace(self, **changes)


def _kv_bytes(kv_dtype: str) -> int:
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ConfigError(f"kv dtype must be one of {sorted(KV_DTYPE_BYTES)}, got {kv_dtype!r}")
    return KV_DTYPE_BYTES[kv_dtype]


# The tiny preset exercises every feature on short sequences and is a plain transformers
# BeamConfig (spec "Presets"): dense layers in a non-prefix pattern (0 and 3), three full
# layers, a window of 8 (< test lengths), 4 groups with 2 kept (whole groups dropped), 2 query
# heads per KV head, softcap on. SSMax's constants are fixed, so its scale is near 1 at
# tiny-test lengths (1.072 at position 2047): the 2K-token tests give it its power.
_TINY_LAYER_TYPES = (SLIDING, FULL, SLIDING, SLIDING, FULL, FULL)
_TINY_MLP_LAYER_TYPES = (DENSE, SPARSE, SPARSE, DENSE, SPARSE, SPARSE)

PRESETS: dict[str, BeamConfig] = {
    "beam-1.0-501b": BeamConfig(max_position_embeddings=1048576),
    "tiny": BeamConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=_TINY_LAYER_TYPES,
        mlp_layer_types=_TINY_MLP_LAYER_TYPES,
        num_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        sliding_window=8,
        max_position_embeddings=4096,
    ),
}


def preset(name: str) -> BeamConfig:
    """Exact-key preset lookup (no fuzzy matching)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
