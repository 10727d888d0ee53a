"""BeamConfig: the single source of truth for Beam's architecture facts.

Every field of the spec's config table (``shared/BEAM_SPEC.md``) is a field here, with the
Hugging Face name. Everything else in beam-trt (reference model, converter, kernels, engine,
serving) derives shapes and sizes from this object and never re-states them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

SLIDING = "sliding_attention"
FULL = "full_attention"

KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1.0 / 16}  # NVFP4: 4 bits + one FP8 scale per 16


class ConfigError(ValueError):
    """A Beam config that is malformed or contradicts itself; the message names the field."""


def default_layer_types(num_hidden_layers: int) -> tuple[str, ...]:
    """Spec rule: layer i is full when (i + 1) % 6 == 0 or it is the last layer."""
    return tuple(
        FULL if (i + 1) % 6 == 0 or i == num_hidden_layers - 1 else SLIDING
        for i in range(num_hidden_layers)
    )


@dataclass(frozen=True)
class BeamConfig:
    vocab_size: int = 262144
    hidden_size: int = 5120
    intermediate_size: int = 24576
    moe_intermediate_size: int = 2560
    num_hidden_layers: int = 52
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    first_k_dense_replace: int = 3
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    sliding_window: int = 512
    layer_types: tuple[str, ...] = field(default=())  # () -> the spec's default rule
    rope_theta: float = 10000.0
    ssmax_base: float = 2048.0
    ssmax_exponent: float = 0.1
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    residual_scaling: str = "depth"
    # Token ids are tokenizer facts, carried so a config.json round-trips.
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers))
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        positive = [
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
            "sliding_window", "max_position_embeddings",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ["rope_theta", "ssmax_base", "rms_norm_eps", "routed_scaling_factor"]:
            if not float(getattr(self, name)) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in (SLIDING, FULL)})
        if bad:
            raise ConfigError(f"layer_types has unknown kinds {bad}; allowed: {SLIDING!r}, {FULL!r}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace ({self.first_k_dense_replace}) must be in "
                f"[0, num_hidden_layers={self.num_hidden_layers}]"
            )
        self._validate_moe()
        if self.residual_scaling != "depth":
            raise ConfigError(f"residual_scaling must be 'depth', got {self.residual_scaling!r}")
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings must be false for Beam (lm_head is its own tensor)")

    def _validate_moe(self) -> None:
        if self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"n_routed_experts ({self.n_routed_experts}) is not divisible by "
                f"n_group ({self.n_group})"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group}) > n_group ({self.n_group})")
        if self.experts_per_group < 2:
            raise ConfigError(
                f"n_routed_experts / n_group = {self.experts_per_group}: a group score sums the "
                "2 best experts of a group, so each group needs at least 2"
            )
        if self.num_experts_per_tok > self.topk_group * self.experts_per_group:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in the "
                f"kept groups (topk_group * n_routed_experts / n_group = "
                f"{self.topk_group * self.experts_per_group})"
            )

    # ------------------------------------------------------------------ derived facts
    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_full(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense_replace))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense_replace, self.num_hidden_layers))

    def residual_coeffs(self, sublayer: int) -> tuple[float, float]:
        """(a_k, b_k) for sublayer k: h = a_k * h + b_k * sublayer_output (unit-variance rule)."""
        return ((sublayer + 1) / (sublayer + 2)) ** 0.5, (1.0 / (sublayer + 2)) ** 0.5

    # parameter counts --------------------------------------------------------
    @property
    def attention_params(self) -> int:
        h = self.hidden_size
        return (
            2 * h * self.q_size  # q_proj, o_proj
            + 2 * h * self.kv_size  # k_proj, v_proj
            + h * self.num_attention_heads  # g_proj
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
        return self.n_routed_experts * (self.hidden_size + 1)  # weight + correction bias

    def layer_params(self, layer: int, active: bool = False) -> int:
        norms = 4 * self.hidden_size
        if self.is_moe(layer):
            experts = self.num_experts_per_tok if active else self.n_routed_experts
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
            self.layer_params(i, active=True) for i in range(self.num_hidden_layers)
        )

    # KV cache ---------------------------------------------------------------
    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """Bytes of KV that grow with context: only full layers keep every token."""
        return len(self.full_layers) * 2 * self.kv_size * _kv_bytes(kv_dtype)

    def sliding_kv_bytes_per_sequence(self, kv_dtype: str = "bf16") -> int:
        """Fixed KV of the sliding layers for one sequence (their last `sliding_window` keys)."""
        return len(self.sliding_layers) * self.sliding_window * 2 * self.kv_size * _kv_bytes(kv_dtype)

    def kv_bytes(self, context: int, kv_dtype: str = "bf16") -> int:
        """KV bytes of one sequence of `context` tokens (full layers + sliding windows)."""
        window = min(context, self.sliding_window)
        sliding = len(self.sliding_layers) * window * 2 * self.kv_size * _kv_bytes(kv_dtype)
        return context * self.kv_bytes_per_token(kv_dtype) + sliding

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_hf(cls, source: str | Path | Mapping[str, Any]) -> "BeamConfig":
        """Build from a config.json path, a checkpoint directory, or a dict; unknown keys ignored."""
        if isinstance(source, Mapping):
            raw, where = dict(source), "config"
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ConfigError(f"{path}: no such config file")
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
            where = str(path)
        model_type = raw.get("model_type", "beam")
        if model_type != "beam":
            raise ConfigError(f"{where}: model_type is {model_type!r}, expected 'beam'")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names}
        if "layer_types" in kwargs and not isinstance(kwargs["layer_types"], (list, tuple)):
            raise ConfigError(f"{where}: layer_types must be a list of strings")
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def to_hf(self) -> dict[str, Any]:
        """The config.json dict (HF style, with model_type and architectures)."""
        out: dict[str, Any] = {"architectures": ["BeamForCausalLM"], "model_type": "beam"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = list(value)
            if value is None:
                continue
            out[f.name] = value
        out["torch_dtype"] = "bfloat16"
        return out

    def replace(self, **changes: Any) -> "BeamConfig":
        return dataclasses.replace(self, **changes)


def _kv_bytes(kv_dtype: str) -> int:
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ConfigError(f"kv dtype must be one of {sorted(KV_DTYPE_BYTES)}, got {kv_dtype!r}")
    return KV_DTYPE_BYTES[kv_dtype]


# The tiny preset exercises every feature on short sequences (spec "Presets"): one dense layer,
# three full layers, a window of 8 (< test lengths), 4 groups with 2 kept (whole groups dropped),
# 2 query heads per KV head, and ssmax_base = 4 so the SSMax scale is 1.5 at position 256.
_TINY_LAYER_TYPES = (SLIDING, FULL, SLIDING, SLIDING, FULL, FULL)

PRESETS: dict[str, BeamConfig] = {
    "beam-1.0-501b": BeamConfig(),
    "tiny": BeamConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        first_k_dense_replace=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        sliding_window=8,
        layer_types=_TINY_LAYER_TYPES,
        ssmax_base=4.0,
        max_position_embeddings=4096,
    ),
}


def preset(name: str) -> BeamConfig:
    """Exact-key preset lookup (no fuzzy matching)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
