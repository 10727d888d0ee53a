"""Hugging Face checkpoint layout for Beam: expected tensors, strict loading, sharded writing.

A checkpoint is `config.json` plus either `model.safetensors` or shards
`model-0000k-of-0000n.safetensors` listed in `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import BeamConfig

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the file or tensor."""


def expected_tensors(cfg: BeamConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of a BF16 Beam checkpoint: name -> (shape, dtype), in checkpoint order."""
    bf16, fp32 = torch.bfloat16, torch.float32
    h, d = cfg.hidden_size, cfg.head_dim
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "model.embed_tokens.weight": ((cfg.vocab_size, h), bf16)
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((h,), bf16)
        out[p + "self_attn.q_proj.weight"] = ((cfg.q_size, h), bf16)
        out[p + "self_attn.k_proj.weight"] = ((cfg.kv_size, h), bf16)
        out[p + "self_attn.v_proj.weight"] = ((cfg.kv_size, h), bf16)
        out[p + "self_attn.g_proj.weight"] = ((cfg.num_attention_heads, h), bf16)
        out[p + "self_attn.q_norm.weight"] = ((d,), bf16)
        out[p + "self_attn.k_norm.weight"] = ((d,), bf16)
        out[p + "self_attn.o_proj.weight"] = ((h, cfg.q_size), bf16)
        out[p + "post_attention_layernorm.weight"] = ((h,), bf16)
        out[p + "pre_feedforward_layernorm.weight"] = ((h,), bf16)
        out[p + "post_feedforward_layernorm.weight"] = ((h,), bf16)
        if cfg.is_moe(i):
            out[p + "mlp.gate.weight"] = ((cfg.n_routed_experts, h), fp32)
            out[p + "mlp.gate.e_score_correction_bias"] = ((cfg.n_routed_experts,), fp32)
            for e in range(cfg.n_routed_experts):
                out.update(_mlp(f"{p}mlp.experts.{e}.", h, cfg.moe_intermediate_size))
        else:
            out.update(_mlp(p + "mlp.", h, cfg.intermediate_size))
    out["model.norm.weight"] = ((h,), bf16)
    out["lm_head.weight"] = ((cfg.vocab_size, h), bf16)
    return out


def _mlp(prefix: str, hidden: int, inner: int):
    bf16 = torch.bfloat16
    return {
        prefix + "gate_proj.weight": ((inner, hidden), bf16),
        prefix + "up_proj.weight": ((inner, hidden), bf16),
        prefix + "down_proj.weight": ((hidden, inner), bf16),
    }


def check_state_dict(
    cfg: BeamConfig, found: dict[str, tuple[tuple[int, ...], torch.dtype]], where: str = "checkpoint"
) -> None:
    """Refuse a missing, extra or mis-shaped tensor, naming it (dtype is cast on load)."""
    expected = expected_tensors(cfg)
    missing = [k for k in expected if k not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: missing tensor {missing[0]}{more}")
    extra = sorted(k for k in found if k not in expected)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]}{more}")
    for name, (shape, _) in expected.items():
        if tuple(found[name][0]) != shape:
            raise CheckpointError(
                f"{where}: tensor {name} has shape {list(found[name][0])}, "
                f"config.json implies {list(shape)}"
            )


# ---------------------------------------------------------------------------- reading
def weight_map(ckpt_dir: str | Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index (sharded) or the single file."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / INDEX_NAME
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = {name: ckpt_dir / fname for name, fname in mapping.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise CheckpointError(f"{index}: lists shard {path.name}, which does not exist")
        return files
    single = ckpt_dir / SINGLE_NAME
    if single.is_file():
        with _open(single) as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{ckpt_dir}: no {INDEX_NAME} or {SINGLE_NAME}")


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc


def tensor_infos(ckpt_dir: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) from the file headers, reading no tensor data."""
    by_file: dict[Path, list[str]] = {}
    for name, path in weight_map(ckpt_dir).items():
        by_file.setdefault(path, []).append(name)
    infos = {}
    for path, names in by_file.items():
        with _open(path) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{path}: index lists {name} but the file lacks it")
                sl = f.get_slice(name)
                infos[name] = (tuple(sl.get_shape()), _dtype(sl.get_dtype(), path, name))
    return infos


_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32,
    "I64": torch.int64, "BOOL": torch.bool,
}


def _dtype(name: str, path: Path, tensor: str) -> torch.dtype:
    if name not in _ST_DTYPES:
        raise CheckpointError(f"{path}: tensor {tensor} has unsupported dtype {name}")
    return _ST_DTYPES[name]


def iter_tensors(ckpt_dir: str | Path, names: Iterable[str] | None = None) -> Iterator:
    """Yield (name, tensor) lazily, one file open at a time, in index order."""
    files = weight_map(ckpt_dir)
    wanted = list(files) if names is None else list(names)
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        if name not in files:
            raise CheckpointError(f"{ckpt_dir}: missing tensor {name}")
        by_file.setdefault(files[name], []).append(name)
    for path, group in by_file.items():
        with _open(path) as f:
            for name in group:
                try:
                    yield name, f.get_tensor(name)
                except SafetensorError as exc:  # truncated data is only found on read
                    raise CheckpointError(f"{path}: cannot read tensor {name} ({exc})") from exc


def load_state_dict(ckpt_dir: str | Path, cfg: BeamConfig) -> dict[str, torch.Tensor]:
    """Validated full state dict of a BF16 checkpoint (names and shapes checked before reading)."""
    check_state_dict(cfg, tensor_infos(ckpt_dir), where=str(ckpt_dir))
    return dict(iter_tensors(ckpt_dir))


# ---------------------------------------------------------------------------- writing
def shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split of tensors (in the given order) into shards of at most max_shard_bytes."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes.items():
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def save_sharded(
    state: dict[str, torch.Tensor], out_dir: str | Path, max_shard_bytes: int = 5 << 30
) -> list[Path]:
    """Write shards + index atomically (tmp file, then rename); returns the shard paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {k: v.numel() * v.element_size() for k, v in state.items()}
    plan = shard_plan(sizes, max_shard_bytes)
    paths, mapping = [], {}
    for k, names in enumerate(plan, start=1):
        fname = shard_name(k, len(plan))
        atomic_save(out_dir / fname, {n: state[n].contiguous() for n in names})
        mapping.update({n: fname for n in names})
        paths.append(out_dir / fname)
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": mapping}
    atomic_write_text(out_dir / INDEX_NAME, json.dumps(index, indent=2))
    return paths


def atomic_save(path: Path, tensors: dict[str, torch.Tensor], metadata=None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata or {"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates 0600 files; checkpoints are shared read-only
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
