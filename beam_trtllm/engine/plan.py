"""Build options and the KV memory plan of an engine (what `beam-trt build` decides once).

Names follow TensorRT-LLM's where one exists (`max_batch_size`, `max_seq_len`,
`max_num_tokens`, `tokens_per_block` is our `block_size`, `kv_cache_config.dtype`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..config import KV_DTYPE_BYTES, BeamConfig
from .types import EngineError

TARGETS = ("cpu", "sm90", "sm100")
ACT_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}  # --dtype -> its unquantized KV dtype
GIB = 1 << 30
DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DRAFT_QUANTS = ("auto", "bf16", "fp8")  # --draft-quant (engine/draft_build.py)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BuildOptions:
    target: str = "cpu"
    max_batch: int = 8
    max_seq_len: int = 4096
    max_num_tokens: int = 512        # tokens per step (prefill chunks + decodes)
    kv_dtype: str | None = None      # None: fp8 if the checkpoint has KV scales, else bf16
    kv_memory_gib: float | None = None  # None: room for max_batch sequences of max_seq_len
    block_size: int = 32
    cuda_graph_batch_sizes: tuple[int, ...] = field(default=())
    autotune: str = "auto"           # kernel search on a matching GPU: auto | quick | off
    dtype: str = "bfloat16"          # activations and unquantized weights; float32: CPU only
    draft_tokens: int = 0            # speculative decoding: drafts per step (0: no drafter)
    draft_quant: str = "auto"        # the drafter's weights: auto (fp8 iff the target's are
                                     # quantized) | bf16 (as stored) | fp8 (per channel)

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise EngineError(f"--target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        for flag, value in (("--max-batch", self.max_batch), ("--max-seq-len", self.max_seq_len),
                            ("--max-num-tokens", self.max_num_tokens),
                            ("--block-size", self.block_size)):
            if not isinstance(value, int) or value < 1:
                raise EngineError(f"{flag} must be a positive integer, got {value!r}")
        if self.autotune not in ("auto", "quick", "off"):
            raise EngineError(f"--autotune must be auto, quick or off, got {self.autotune!r}")
        if self.dtype not in ACT_DTYPES:
            raise EngineError(f"--dtype must be one of {', '.join(ACT_DTYPES)}, got {self.dtype!r}")
        if self.dtype == "float32" and self.target != "cpu":
            raise EngineError("--dtype float32 builds a CPU engine for numerics checks; GPU "
                              "targets run bfloat16 (the kernels' launch shapes are tuned for it)")
        kv_allowed = ("fp32", "fp8") if self.dtype == "float32" else ("bf16", "fp8")
        if self.kv_dtype is not None and self.kv_dtype not in kv_allowed:
            raise EngineError(f"--kv-dtype must be {' or '.join(kv_allowed)} for a {self.dtype} "
                              f"engine, got {self.kv_dtype!r}")
        if not isinstance(self.draft_tokens, int) or self.draft_tokens < 0:
            raise EngineError(f"--draft-tokens must be an integer >= 0, got {self.draft_tokens!r}")
        if self.draft_quant not in DRAFT_QUANTS:
            raise EngineError(f"--draft-quant must be one of {', '.join(DRAFT_QUANTS)}, got "
                              f"{self.draft_quant!r}")
        if self.kv_memory_gib is not None and not self.kv_memory_gib > 0:
            raise EngineError(f"--kv-memory must be > 0 GiB, got {self.kv_memory_gib!r}")
        if self.max_num_tokens < self.max_batch:
            raise EngineError(f"--max-num-tokens ({self.max_num_tokens}) must be >= --max-batch "
                              f"({self.max_batch}) so every running sequence decodes each step")
        if not self.cuda_graph_batch_sizes:
            sizes = tuple(s for s in DEFAULT_GRAPH_SIZES if s < self.max_batch) + (self.max_batch,)
            object.__setattr__(self, "cuda_graph_batch_sizes", sizes if self.target != "cpu" else ())
        object.__setattr__(self, "cuda_graph_batch_sizes",
                           tuple(sorted(set(int(s) for s in self.cuda_graph_batch_sizes))))
        if any(s < 1 or s > self.max_batch for s in self.cuda_graph_batch_sizes):
            raise EngineError(f"--cuda-graph-batch-sizes {list(self.cuda_graph_batch_sizes)} must "
                              f"lie in [1, --max-batch={self.max_batch}]")

    def to_json(self) -> dict:
        out = asdict(self)
        out["cuda_graph_batch_sizes"] = list(self.cuda_graph_batch_sizes)
        return out


@dataclass(frozen=True)
class KVPlan:
    block_size: int
    num_blocks: int              # paged blocks shared by every full layer
    max_seqs: int                # ring rows of the sliding layers (+1 scratch row)
    kv_dtype: str
    bytes_per_block: int         # all full layers, K and V
    ring_bytes: int              # all sliding layers' rings, K and V
    full_bytes: int

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.full_bytes + self.ring_bytes

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(max_tokens=self.max_tokens, total_bytes=self.total_bytes)
        return out

    @classmethod
    def from_json(cls, raw: dict) -> "KVPlan":
        names = ("block_size", "num_blocks", "max_seqs", "kv_dtype", "bytes_per_block",
                 "ring_bytes", "full_bytes")
        return cls(**{k: raw[k] for k in names})


def kv_plan(cfg: BeamConfig, opts: BuildOptions, kv_dtype: str) -> KVPlan:
    """How many full-attention blocks and ring rows fit (refuses a plan that cannot hold one
    sequence of --max-seq-len)."""
    elem = KV_DTYPE_BYTES[kv_dtype]
    per_block = len(cfg.full_layers) * 2 * opts.block_size * cfg.kv_size * elem
    ring_len = cfg.sliding_window + opts.draft_tokens  # kv_cache.py: room for a verify step
    ring = len(cfg.sliding_layers) * 2 * (opts.max_batch + 1) * ring_len * cfg.kv_size * elem
    per_seq_blocks = cdiv(opts.max_seq_len, opts.block_size)
    if opts.kv_memory_gib is None:
        num_blocks = opts.max_batch * per_seq_blocks
    else:
        budget = int(opts.kv_memory_gib * GIB)
        if budget <= ring:
            raise EngineError(f"--kv-memory {opts.kv_memory_gib} GiB does not even hold the "
                              f"sliding-window rings of --max-batch {opts.max_batch} sequences "
                              f"({ring / GIB:.3f} GiB)")
        num_blocks = (budget - ring) // per_block if per_block else per_seq_blocks
    if num_blocks < per_seq_blocks:
        raise EngineError(
            f"--kv-memory {opts.kv_memory_gib} GiB holds {num_blocks} blocks of {opts.block_size} "
            f"tokens, fewer than one --max-seq-len {opts.max_seq_len} sequence needs "
            f"({per_seq_blocks}); raise --kv-memory or lower --max-seq-len")
    return KVPlan(opts.block_size, int(num_blocks), opts.max_batch, kv_dtype, per_block, ring,
                  int(num_blocks) * per_block)
