"""TensorRT-LLM LLM-API arguments for Beam (the keys of `--extra-engine-args` / `trtllm-serve
--config` / `LLM(**args)`), per serving role, generated from a BeamConfig and validated.

Why each Beam-specific key is there:
- `kv_cache_config.max_attention_window`: one entry per layer in `layer_types` order (the
  window on sliding layers, max_seq_len on full ones). TRT-LLM only auto-fills it for regular
  "(local, ..., local, global)" patterns; Beam's 43/9 split with a full last layer is not one.
- `cache_transceiver_config.max_tokens_in_buffer` >= the longest prompt (a smaller buffer
  deadlocks disaggregated workers under load: Dynamo known issue #4327), and a finite
  `kv_transfer_timeout_ms` derived from the prompt's KV bytes (a lost NIXL notification
  otherwise hangs a request forever: TRT-LLM #17665).
- `disable_overlap_scheduler` on prefill workers (TRT-LLM does not support it there), block
  reuse off on decode (reuse while a send is in flight can deadlock: TRT-LLM #12542).
- `moe_config.backend`: never TRTLLM, whose DeepSeek-V3 gate keeps the router bias in BF16
  while Beam's router runs entirely in FP32 (shared/BEAM_SPEC.md "Router and experts").
- `trust_remote_code: false`: a canonical checkpoint has no remote code; its `beam` config is
  transformers' own (or the adapter's registered fallback, configuration_beam.py).

Not engine args, so not here: the final logit softcap (`final_logit_softcapping`, applied by
the model in FP32 after TRT-LLM's lm_head) and the routed scale (applied with the router's
top-k weights); both come from config.json.

This is the single implementation; `dynamo_graphs/k8s.py` renders its TRT-LLM manifests with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import yaml

from beam_trtllm.config import SLIDING, BeamConfig

from .errors import LlmArgsError

ROLES = ("agg", "prefill", "decode")
KV_BLOCK_SIZE = 32  # TRT-LLM tokens_per_block: identical on prefill and decode by construction
KV_CACHE_DTYPES = ("fp8", "auto")  # "auto" = the checkpoint's dtype (BF16)
MOE_BACKENDS = ("CUTLASS", "CUTEDSL", "DEEPGEMM", "WIDEEP", "VANILLA")
TRANSCEIVER_BACKENDS = ("NIXL", "UCX", "DEFAULT", "MPI")
MIB = 1 << 20


def max_attention_window(cfg: BeamConfig, max_seq_len: int) -> list[int]:
    """One entry per layer, in `layer_types` order: the window for sliding layers."""
    return [cfg.sliding_window if t == SLIDING else max_seq_len for t in cfg.layer_types]


@dataclass(frozen=True)
class ServingOptions:
    tensor_parallel_size: int = 1
    moe_expert_parallel_size: int | None = None  # None: = tensor_parallel_size (experts by EP)
    enable_attention_dp: bool = False
    max_seq_len: int | None = None  # None: the model's max_position_embeddings
    max_isl: int = 4096  # longest prompt a prefill worker accepts (clamped to max_seq_len)
    kv_cache_dtype: str = "fp8"
    free_gpu_memory_fraction: float = 0.85
    tokens_per_block: int = KV_BLOCK_SIZE
    moe_backend: str = "CUTLASS"
    cache_transceiver_backend: str = "NIXL"
    max_tokens_in_buffer: int | None = None  # None: max_isl
    kv_transfer_timeout_ms: int | None = None  # None: base + KV bytes / minimum bandwidth
    kv_transfer_base_s: float = 5.0
    kv_transfer_min_mib_s: float = 50.0
    decode_max_batch_size: int = 256  # decode max_num_tokens and the largest CUDA graph
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to the max


def _fail(field: str, message: str) -> None:
    raise LlmArgsError(f"{field}: {message}")


def _positive_int(field: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        _fail(field, f"must be a positive integer, got {value!r}")


def check_parallelism(cfg: BeamConfig, tp: int, ep: int) -> None:
    """TP must split the query heads and split or evenly replicate the KV heads; EP must
    divide both TP (moe_tp = tp / ep) and the routed experts."""
    _positive_int("tensor_parallel_size", tp)
    _positive_int("moe_expert_parallel_size", ep)
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if hq % tp:
        _fail("tensor_parallel_size", f"{tp} does not divide num_attention_heads ({hq})")
    if (tp <= hkv and hkv % tp) or (tp > hkv and tp % hkv):
        _fail("tensor_parallel_size", f"{tp}: the {hkv} KV heads can be neither split evenly "
              "nor replicated evenly (it must divide them or be a multiple of them)")
    if tp % ep:
        _fail("moe_expert_parallel_size", f"{ep} must divide tensor_parallel_size {tp}")
    if cfg.num_experts % ep:
        _fail("moe_expert_parallel_size", f"{ep} does not divide num_experts "
              f"({cfg.num_experts})")


def _check_options(cfg: BeamConfig, o: ServingOptions, role: str) -> None:
    if role not in ROLES:
        _fail("role", f"{role!r}; allowed: {', '.join(ROLES)}")
    check_parallelism(cfg, o.tensor_parallel_size,
                      o.moe_expert_parallel_size or o.tensor_parallel_size)
    if o.max_seq_len is not None:
        _positive_int("max_seq_len", o.max_seq_len)
        if o.max_seq_len > cfg.max_position_embeddings:
            _fail("max_seq_len", f"{o.max_seq_len} exceeds max_position_embeddings "
                  f"({cfg.max_position_embeddings})")
    for name in ("max_isl", "tokens_per_block", "decode_max_batch_size"):
        _positive_int(name, getattr(o, name))
    if o.kv_cache_dtype not in KV_CACHE_DTYPES:
        _fail("kv_cache_dtype", f"{o.kv_cache_dtype!r}; allowed: {', '.join(KV_CACHE_DTYPES)}")
    if not 0.0 < o.free_gpu_memory_fraction < 1.0:
        _fail("free_gpu_memory_fraction", f"must be in (0, 1), got {o.free_gpu_memory_fraction}")
    _check_moe_backend(o.moe_backend)
    if o.cache_transceiver_backend not in TRANSCEIVER_BACKENDS:
        _fail("cache_transceiver_backend", f"{o.cache_transceiver_backend!r}; allowed: "
              f"{', '.join(TRANSCEIVER_BACKENDS)}")
    if o.kv_transfer_timeout_ms is not None:
        _positive_int("kv_transfer_timeout_ms", o.kv_transfer_timeout_ms)
    if not (o.kv_transfer_base_s > 0 and o.kv_transfer_min_mib_s > 0):
        _fail("kv_transfer_base_s / kv_transfer_min_mib_s", "must both be > 0 (a finite timeout)")
    _cuda_graph_sizes(o)


def _check_moe_backend(backend: str) -> None:
    if backend == "TRTLLM":
        _fail("moe_backend", "TRTLLM keeps DeepseekV3Gate's e_score_correction_bias in BF16, but "
              "Beam's router runs entirely in FP32; use CUTLASS (or CUTEDSL / DEEPGEMM)")
    if backend not in MOE_BACKENDS:
        _fail("moe_backend", f"{backend!r}; allowed: {', '.join(MOE_BACKENDS)}")


def _cuda_graph_sizes(o: ServingOptions) -> list[int]:
    if o.cuda_graph_batch_sizes is None:
        sizes, b = [], 1
        while b < o.decode_max_batch_size:
            sizes.append(b)
            b *= 2
        return sizes + [o.decode_max_batch_size]
    sizes = list(o.cuda_graph_batch_sizes)
    for s in sizes:
        _positive_int("cuda_graph_batch_sizes", s)
    if not sizes or sizes != sorted(set(sizes)) or sizes[-1] > o.decode_max_batch_size:
        _fail("cuda_graph_batch_sizes", f"{sizes} must be non-empty, strictly increasing and "
              f"at most decode_max_batch_size ({o.decode_max_batch_size})")
    return sizes


def resolved_lengths(cfg: BeamConfig, o: ServingOptions) -> tuple[int, int]:
    """(max_seq_len, max_isl): the model's limit by default; a prompt is at most max_seq_len."""
    max_seq_len = min(cfg.max_position_embeddings, o.max_seq_len or cfg.max_position_embeddings)
    return max_seq_len, min(o.max_isl, max_seq_len)


def transfer_timeout_ms(cfg: BeamConfig, o: ServingOptions, max_isl: int) -> int:
    """A max-length prompt's KV bytes at the minimum bandwidth, plus a base: finite, and
    generous enough that a healthy transfer never trips it."""
    if o.kv_transfer_timeout_ms is not None:
        return o.kv_transfer_timeout_ms
    kv_dtype = "fp8" if o.kv_cache_dtype == "fp8" else "bf16"
    seconds = o.kv_transfer_base_s + cfg.kv_bytes(max_isl, kv_dtype) / (o.kv_transfer_min_mib_s * MIB)
    return int(seconds * 1000)


def engine_args(cfg: BeamConfig, role: str, opts: ServingOptions | None = None) -> dict[str, Any]:
    """TorchLlmArgs for one role, validated."""
    o = opts or ServingOptions()
    _check_options(cfg, o, role)
    max_seq_len, max_isl = resolved_lengths(cfg, o)
    args: dict[str, Any] = {
        "backend": "pytorch",
        "trust_remote_code": False,
        "tensor_parallel_size": o.tensor_parallel_size,
        "moe_expert_parallel_size": o.moe_expert_parallel_size or o.tensor_parallel_size,
        "enable_attention_dp": o.enable_attention_dp,
        "max_seq_len": max_seq_len,
        "max_num_tokens": max(8192, max_isl) if role != "decode" else o.decode_max_batch_size,
        "enable_chunked_prefill": role != "decode",
        # "Overlap scheduler not currently supported in prefill only workers."
        "disable_overlap_scheduler": role == "prefill",
        "moe_config": {"backend": o.moe_backend},
        "kv_cache_config": {
            "dtype": o.kv_cache_dtype,
            "free_gpu_memory_fraction": o.free_gpu_memory_fraction,
            "tokens_per_block": o.tokens_per_block,
            "max_attention_window": max_attention_window(cfg, max_seq_len),
            # Decode never reuses prefixes, and reuse during an in-flight send can deadlock.
            "enable_block_reuse": role != "decode",
        },
    }
    if role != "prefill":  # generation steps run as CUDA graphs (padded to the next size)
        sizes = _cuda_graph_sizes(o)
        args["cuda_graph_config"] = {"enable_padding": True, "batch_sizes": sizes,
                                     "max_batch_size": sizes[-1]}
    if role in ("prefill", "decode"):
        buffer = o.max_tokens_in_buffer if o.max_tokens_in_buffer is not None else max_isl
        _positive_int("max_tokens_in_buffer", buffer)
        if buffer < max_isl:
            _fail("max_tokens_in_buffer", f"{buffer} is smaller than the longest prompt "
                  f"(max_isl {max_isl}); transfers of longer prompts would deadlock")
        args["cache_transceiver_config"] = {
            "backend": o.cache_transceiver_backend,
            "max_tokens_in_buffer": buffer,
            "kv_transfer_timeout_ms": transfer_timeout_ms(cfg, o, max_isl),
        }
    return args


def validate_engine_args(cfg: BeamConfig, role: str, args: Mapping[str, Any]) -> None:
    """Refuse engine args (e.g. a hand-edited YAML) that would serve Beam wrongly."""
    if role not in ROLES:
        _fail("role", f"{role!r}; allowed: {', '.join(ROLES)}")
    tp = args.get("tensor_parallel_size", 1)
    check_parallelism(cfg, tp, args.get("moe_expert_parallel_size", tp))
    max_seq_len = args.get("max_seq_len", cfg.max_position_embeddings)
    _positive_int("max_seq_len", max_seq_len)
    window = (args.get("kv_cache_config") or {}).get("max_attention_window")
    if not isinstance(window, list):
        _fail("kv_cache_config.max_attention_window", "missing: Beam needs the explicit list "
              f"of {cfg.num_hidden_layers} per-layer windows")
    if len(window) != cfg.num_hidden_layers:
        _fail("kv_cache_config.max_attention_window", f"has {len(window)} entries but the model "
              f"has {cfg.num_hidden_layers} layers (TRT-LLM would repeat it cyclically)")
    expected = max_attention_window(cfg, max_seq_len)
    for i, (got, want) in enumerate(zip(window, expected)):
        if got != want:
            _fail(f"kv_cache_config.max_attention_window[{i}]", f"{got}, but layer {i} is "
                  f"{cfg.layer_types[i]} and needs {want}")
    _check_moe_backend((args.get("moe_config") or {}).get("backend", "CUTLASS"))
    if role == "prefill" and args.get("disable_overlap_scheduler") is not True:
        _fail("disable_overlap_scheduler", "must be true on prefill workers")
    if role in ("prefill", "decode"):
        _check_transceiver(args.get("cache_transceiver_config") or {})


def _check_transceiver(ct: Mapping[str, Any]) -> None:
    timeout = ct.get("kv_transfer_timeout_ms")
    if timeout is None:
        _fail("cache_transceiver_config.kv_transfer_timeout_ms",
              "missing: without it a lost transfer notification hangs the request forever")
    _positive_int("cache_transceiver_config.kv_transfer_timeout_ms", timeout)
    _positive_int("cache_transceiver_config.max_tokens_in_buffer", ct.get("max_tokens_in_buffer"))


def check_disagg_pair(prefill: Mapping[str, Any], decode: Mapping[str, Any]) -> None:
    """Prefill and decode must agree on the KV block layout, or transferred blocks are garbage."""
    pk, dk = prefill.get("kv_cache_config", {}), decode.get("kv_cache_config", {})
    for key in ("tokens_per_block", "dtype", "max_attention_window"):
        if pk.get(key) != dk.get(key):
            _fail(f"kv_cache_config.{key}", f"prefill has {pk.get(key)!r}, decode "
                  f"{dk.get(key)!r}; the KV block layout must match")
    pt = prefill.get("cache_transceiver_config", {}).get("backend")
    dt = decode.get("cache_transceiver_config", {}).get("backend")
    if pt != dt:
        _fail("cache_transceiver_config.backend", f"prefill {pt!r} != decode {dt!r}")


def engine_args_yaml(cfg: BeamConfig, role: str, opts: ServingOptions | None = None) -> str:
    header = (f"# TensorRT-LLM engine args for Beam, role {role} "
              "(generated by beam_trtllm.trtllm.llm_args; see docs/TRTLLM.md)\n")
    return header + yaml.safe_dump(engine_args(cfg, role, opts), sort_keys=False,
                                   default_flow_style=None, width=100)
