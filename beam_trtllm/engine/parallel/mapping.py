"""The layout of a parallel engine: which heads, MLP columns and experts a rank holds.

TensorRT-LLM's Mapping conventions (the converter's `--format trtllm` rank files use them,
convert/shard.py): world = tp; the MoE runs `ep` expert-parallel groups of `moe_tp = tp / ep`
ranks, rank r in expert group r % ep and expert slice r // ep.
- attention: query heads (and the output gate's `gate_proj` rows and `gate_bias`) split tp
  ways; KV heads split tp ways, or, when tp > num_key_value_heads, head r // (tp / Hkv)
  replicated on the tp / Hkv ranks whose query heads read it; q/k norms replicated;
- dense MLP: gate/up rows and down columns split tp ways;
- experts: expert group g holds experts [g·E/ep, (g+1)·E/ep), each expert's gate/up rows and
  down columns split moe_tp ways; the router (FP32) is replicated;
- attention_dp: attention and dense MLPs are not split (each rank runs its own requests with
  its own KV cache); only the MoE is spread over the ranks, over the union of their tokens.
Embedding, norms, LM head: replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import BeamConfig
from ..types import EngineError

PARALLEL_FILE = "parallel.json"
PARALLEL_FORMAT = "beam-trt-parallel-engine"


@dataclass(frozen=True)
class ParallelMapping:
    tp: int = 1
    ep: int = 1
    attention_dp: bool = False
    rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineError(f"--{name} must be a positive integer, got {value!r}")
        if self.tp % self.ep:
            raise EngineError(f"--ep {self.ep} must divide --tp {self.tp} (the MoE runs ep "
                              f"expert groups of tp / ep ranks; world size = tp)")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise EngineError(f"rank {self.rank!r} is outside the world of {self.world} ranks")

    @property
    def world(self) -> int:
        return self.tp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def moe_ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def moe_tp_rank(self) -> int:
        return self.rank // self.ep

    @property
    def attn_tp(self) -> int:
        """Ranks the attention and dense MLPs are split over (1 with attention DP)."""
        return 1 if self.attention_dp else self.tp

    @property
    def attn_rank(self) -> int:
        return 0 if self.attention_dp else self.rank

    def at(self, rank: int) -> "ParallelMapping":
        return ParallelMapping(self.tp, self.ep, self.attention_dp, rank)

    def describe(self) -> str:
        dp = " attention-dp" if self.attention_dp else ""
        return f"tp {self.tp} ep {self.ep}{dp} (moe_tp {self.moe_tp})"

    # -------------------------------------------------------------- what a rank holds
    def check(self, cfg: BeamConfig) -> None:
        """Refuse a layout the model's shapes cannot be split into, naming the field."""
        hq, hkv, tp = cfg.num_attention_heads, cfg.num_key_value_heads, self.attn_tp
        if hq % tp:
            raise EngineError(f"--tp {tp} does not divide num_attention_heads ({hq})")
        if (tp <= hkv and hkv % tp) or (tp > hkv and tp % hkv):
            raise EngineError(f"--tp {tp}: num_key_value_heads ({hkv}) can be neither split "
                              "evenly nor replicated evenly (tp must divide them or be a "
                              "multiple of them)")
        if cfg.dense_layers and cfg.intermediate_size % tp:
            raise EngineError(f"--tp {tp} does not divide intermediate_size "
                              f"({cfg.intermediate_size})")
        if cfg.num_experts % self.ep:
            raise EngineError(f"--ep {self.ep} does not divide num_experts ({cfg.num_experts})")
        if cfg.moe_layers and cfg.moe_intermediate_size % self.moe_tp:
            raise EngineError(f"--tp {self.tp} --ep {self.ep}: moe_tp {self.moe_tp} does not "
                              f"divide moe_intermediate_size ({cfg.moe_intermediate_size})")

    def heads(self, cfg: BeamConfig) -> tuple[range, range]:
        """(query heads, KV heads) of this rank."""
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        tp, r = self.attn_tp, self.attn_rank
        nq = hq // tp
        if tp <= hkv:
            nkv = hkv // tp
            return range(r * nq, (r + 1) * nq), range(r * nkv, (r + 1) * nkv)
        kv = r // (tp // hkv)
        return range(r * nq, (r + 1) * nq), range(kv, kv + 1)

    def experts(self, cfg: BeamConfig) -> range:
        n = cfg.num_experts // self.ep
        return range(self.moe_ep_rank * n, (self.moe_ep_rank + 1) * n)

    def local_config(self, cfg: BeamConfig) -> BeamConfig:
        """The config as this rank's attention sees it (its query and KV heads): what the KV
        cache and its plan are sized by. Everything else keeps the model's values."""
        q, kv = self.heads(cfg)
        return cfg.replace(num_attention_heads=len(q), num_key_value_heads=len(kv))

    # -------------------------------------------------------------- engine.json
    def to_json(self) -> dict:
        return {"tp": self.tp, "ep": self.ep, "attention_dp": self.attention_dp,
                "rank": self.rank, "world": self.world, "moe_tp": self.moe_tp}

    @classmethod
    def from_json(cls, raw: dict, where: str) -> "ParallelMapping":
        try:
            m = cls(int(raw["tp"]), int(raw["ep"]), bool(raw["attention_dp"]), int(raw["rank"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{where}: malformed parallel layout {raw!r} ({exc})") from exc
        if raw.get("world", m.world) != m.world:
            raise EngineError(f"{where}: parallel.world {raw['world']} is not tp {m.tp}")
        return m
