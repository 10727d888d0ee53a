"""Tuned launch shapes: a process-wide table the Triton launchers consult before their default
tables (docs/ENGINE.md "Kernel autotuning").

The table maps (op family, shape key) to a launch configuration that a device search
(`beam_trtllm/engine/autotune.py`) measured faster than the default on this GPU and checked to
compute the same result:

    ("linear_fp8",   m_bucket, N, K)                               -> GemmConfig
    ("linear_nvfp4", m_bucket, N, K, act dtype)                    -> GemmConfig
    ("moe_fp8",      pairs_bucket, E, I, H)                         -> {"w13": GemmConfig|None,
    ("moe_nvfp4",    pairs_bucket, E, I, H, act dtype)                 "w2": GemmConfig|None}
    ("attention_decode", batch_bucket, capacity, Hq, Hkv, D, q dtype, kv dtype) -> dict of
                                                                       DECODE_CONFIG overrides

Buckets are the next power of two of the token count (m), of the (token, expert) pairs, or of
the decode batch: every shape of a bucket takes the entry tuned at its largest engine size. A
launch shape never changes what a kernel computes beyond FP32 summation order, so any entry is
valid for every shape of its key; FP8 families have no dtype in the key (their operands are
FP8 codes; the engine's outputs are BF16, the dtype the search validates).

With nothing installed every lookup returns None and the launchers behave exactly as before.
Lookups happen on the host when a launcher runs (or when a CUDA graph captures it), so a table
must be installed before the engine captures its graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch

from ._decode_config import DECODE_CONFIG, DECODE_POW2, FP8_FORMS, FP8_SETTINGS
from ._moe_common import GemmConfig, tail_m_fits
from .registry import PluginError

FORMAT = "beam-trt-tuned-kernels"
LINEAR_FAMILIES = ("linear_fp8", "linear_nvfp4")
MOE_FAMILIES = ("moe_fp8", "moe_nvfp4")
DECODE_FAMILY = "attention_decode"
FAMILIES = LINEAR_FAMILIES + MOE_FAMILIES + (DECODE_FAMILY,)
KEY_LENGTH = {"linear_fp8": 4, "linear_nvfp4": 5, "moe_fp8": 5, "moe_nvfp4": 6,
              DECODE_FAMILY: 8}

_TABLE: dict[tuple, object] = {}


class TuningError(PluginError):
    """A tuned-kernel table that cannot be installed; the message names the entry."""


def bucket(n: int) -> int:
    """The next power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------- the table
def lookup(key: tuple):
    """The installed configuration of `key`, or None."""
    return _TABLE.get(tuple(key)) if _TABLE else None


def install(table: dict) -> int:
    """Add the entries of a table document ({"entries": [...]}, see `to_json`) to the process
    table (an entry replaces one of the same key); returns how many were installed. Every entry
    is validated first, so a bad table installs nothing."""
    parsed = from_json(table)
    _TABLE.update(parsed)
    return len(parsed)


def clear() -> None:
    _TABLE.clear()


def installed() -> dict:
    """A copy of the installed table."""
    return dict(_TABLE)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Run with an empty table (the search times the launchers' own defaults), then restore."""
    saved = dict(_TABLE)
    _TABLE.clear()
    try:
        yield
    finally:
        _TABLE.clear()
        _TABLE.update(saved)


# ---------------------------------------------------------------------------- launcher hooks
def tuned_linear(op: str, m: int, n: int, k: int, dtype: torch.dtype | None = None):
    """GemmConfig for linear_* with m tokens of [N, K] weights, or None (the default table)."""
    if not _TABLE:
        return None
    key = (op, bucket(m), n, k) if dtype is None else (op, bucket(m), n, k, dtype_name(dtype))
    return _TABLE.get(key)


def tuned_moe(op: str, numel: int, experts: int, inner: int, hidden: int, config13, config2,
              dtype: torch.dtype | None = None):
    """(config13, config2) for moe_*: the caller's own overrides win; else the tuned pair for
    this many (token, expert) pairs (an entry's None keeps that GEMM's default)."""
    if not _TABLE or config13 is not None or config2 is not None:
        return config13, config2
    key = (op, bucket(numel), experts, inner, hidden)
    entry = _TABLE.get(key if dtype is None else key + (dtype_name(dtype),))
    return (entry["w13"], entry["w2"]) if entry else (None, None)


def tuned_decode(q: torch.Tensor, k_cache: torch.Tensor, cache_index: torch.Tensor):
    """DECODE_CONFIG overrides for a pure decode step of this shape, or None."""
    if not _TABLE:
        return None
    b, hq, d = q.shape
    capacity = cache_index.shape[1] * k_cache.shape[1]
    return _TABLE.get(decode_key(b, capacity, hq, k_cache.shape[2], d, q.dtype, k_cache.dtype))


def decode_key(batch: int, capacity: int, hq: int, hkv: int, d: int, q_dtype, kv_dtype) -> tuple:
    return (DECODE_FAMILY, bucket(batch), capacity, hq, hkv, d, dtype_name(q_dtype),
            dtype_name(kv_dtype))


# ---------------------------------------------------------------------------- JSON
def config_to_json(config):
    """GemmConfig -> its fields; a MoE pair -> {"w13": ..., "w2": ...}; a decode dict as is."""
    if config is None:
        return None
    if isinstance(config, GemmConfig):
        return dataclasses.asdict(config)
    if set(config) == {"w13", "w2"}:
        return {part: config_to_json(c) for part, c in config.items()}
    return dict(config)


def to_json(entries: dict) -> dict:
    """{key tuple: config} -> {"entries": [{"key": [...], "config": {...}}, ...]} (sorted)."""
    return {"entries": [{"key": list(k), "config": config_to_json(entries[k])}
                        for k in sorted(entries, key=repr)]}


def from_json(table: dict) -> dict:
    """The inverse of `to_json`, validating every entry (TuningError names the bad one)."""
    if not isinstance(table, dict) or not isinstance(table.get("entries"), list):
        raise TuningError("tuned-kernel table: expected an object with an 'entries' list")
    out = {}
    for i, entry in enumerate(table["entries"]):
        where = f"tuned-kernel table entry {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), list) or not entry["key"]:
            raise TuningError(f"{where}: expected {{'key': [...], 'config': ...}}")
        key = tuple(entry["key"])
        family = key[0]
        if not all(isinstance(f, str) or isinstance(f, int) and not isinstance(f, bool) and f > 0
                   for f in key):
            raise TuningError(f"{where}: key fields are names and positive integers, got {list(key)}")
        if family not in FAMILIES:
            raise TuningError(f"{where}: unknown op family {family!r} (known: {', '.join(FAMILIES)})")
        if len(key) != KEY_LENGTH[family]:
            raise TuningError(f"{where}: a {family} key has {KEY_LENGTH[family]} fields, got {list(key)}")
        out[key] = _parse_config(family, entry.get("config"), where)
    return out


def _parse_config(family: str, raw, where: str):
    if family in LINEAR_FAMILIES:
        return _gemm(raw, where)
    if family in MOE_FAMILIES:
        if not isinstance(raw, dict) or set(raw) != {"w13", "w2"}:
            raise TuningError(f"{where}: a {family} config is {{'w13': ..., 'w2': ...}}")
        pair = {part: None if raw[part] is None else _gemm(raw[part], f"{where} {part}")
                for part in ("w13", "w2")}
        w13, w2 = pair["w13"], pair["w2"]
        if w13 is not None and w2 is not None and \
                (w13.block_m, w13.tail_m) != (w2.block_m, w2.tail_m):
            raise TuningError(f"{where}: w13 and w2 share one token sort; block_m / tail_m "
                              f"{w13.block_m} / {w13.tail_m} != {w2.block_m} / {w2.tail_m}")
        return pair
    if not isinstance(raw, dict) or not raw:
        raise TuningError(f"{where}: an {family} config is a non-empty object")
    for name, value in raw.items():
        if name not in DECODE_CONFIG and name != "splits":
            raise TuningError(f"{where}: unknown {family} setting {name!r}")
        _positive_int(value, f"{where} {name}")
        if name in DECODE_POW2:  # (tile widths: tl.arange's)
            _power_of_two(value, where, name)
        if name == "fp8_operands" and value not in FP8_FORMS:
            raise TuningError(f"{where}: fp8_operands must be one of {FP8_SETTINGS}, got {value}")
    return dict(raw)


def _gemm(raw, where: str) -> GemmConfig:
    fields = {f.name for f in dataclasses.fields(GemmConfig)}
    if not isinstance(raw, dict) or not set(raw) <= fields:
        raise TuningError(f"{where}: a GemmConfig has fields {sorted(fields)}, got {raw!r}")
    try:
        config = GemmConfig(**raw)
    except TypeError as exc:
        raise TuningError(f"{where}: {exc}") from exc
    for name in ("block_m", "block_n", "block_k", "num_warps", "group_m"):
        value = getattr(config, name)
        _positive_int(value, f"{where} {name}")
        _power_of_two(value, where, name)
    _positive_int(config.num_stages, f"{where} num_stages")
    if not isinstance(config.swap, bool):
        raise TuningError(f"{where}: swap must be true or false, got {config.swap!r}")
    tail = config.tail_m
    if isinstance(tail, bool) or not isinstance(tail, int) or \
            not tail_m_fits(tail, config.block_m):
        raise TuningError(f"{where}: tail_m must be 0 or a power of two from 16 to below "
                          f"block_m={config.block_m}, got {tail!r}")
    return config




def _power_of_two(value: int, where: str, name: str) -> None:
    if value & (value - 1):
        raise TuningError(f"{where}: {name} must be a power of two, got {value}")


def _positive_int(value, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TuningError(f"{where}: expected a positive integer, got {value!r}")
