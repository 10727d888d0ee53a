"""Hugging Face checkpoint layout for Beam: expected tensors, strict loading, sharded writing.

A checkpoint is `config.json` plus either `model.safetensors` or shards
`model-0000k-of-0000n.safetensors` listed in `model.safetensors.index.json`. Names are those
transformers' `BeamForCausalLM.save_pretrained` writes (shared/BEAM_SPEC.md "Weights on disk").
Experts come per expert (what transformers saves) or fused (`mlp.experts.gate_up_proj`
[E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I], as vLLM and SGLang also
read them); a fused checkpoint is seen through per-expert *views* (`fused_expert_views`), so
every reader downstream handles one layout. Float tensors may be FP32, BF16 or FP16.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import BeamConfig

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_V1_GATE = re.compile(r"^model\.layers\.\d+\.self_attn\.g_proj\.weight$")

Infos = dict[str, tuple[tuple[int, ...], torch.dtype]]


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
        out[p + "self_attn.gate_proj.weight"] = ((cfg.q_size, h), bf16)
        out[p + "self_attn.gate_bias"] = ((cfg.num_attention_heads,), bf16)
        out[p + "self_attn.q_norm.weight"] = ((d,), bf16)
        out[p + "self_attn.k_norm.weight"] = ((d,), bf16)
        out[p + "self_attn.o_proj.weight"] = ((h, cfg.q_size), bf16)
        out[p + "post_attention_layernorm.weight"] = ((h,), bf16)
        out[p + "pre_feedforward_layernorm.weight"] = ((h,), bf16)
        out[p + "post_feedforward_layernorm.weight"] = ((h,), bf16)
        if cfg.is_moe(i):
            out[p + "mlp.gate.weight"] = ((cfg.num_experts, h), fp32)
            out[p + "mlp.gate.e_score_correction_bias"] = ((cfg.num_experts,), fp32)
            for e in range(cfg.num_experts):
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


def is_v1_checkpoint(names: Iterable[str]) -> str | None:
    """The first v1 tensor name (beam-trt's pre-canonical per-head `g_proj` gate), or None."""
    return next((n for n in names if _V1_GATE.match(n)), None)


def v1_error(where: str, name: str) -> str:
    return (f"{where}: tensor {name} is the per-head g_proj gate of beam-trt's pre-canonical "
            "Beam (v1), which no published checkpoint has: canonical Beam has "
            "self_attn.gate_proj.weight [Hq*D, H] and self_attn.gate_bias [Hq]. Re-create the "
            "checkpoint with transformers' BeamForCausalLM or a current `beam-trt init-tiny`")


def fused_expert_views(infos: Infos) -> dict[str, tuple[str, int, int, int]]:
    """Per-expert names of fused expert tensors: view name -> (fused name, expert, first row,
    row count). gate_up_proj [E, 2I, H] holds expert e's gate rows [0, I) then up rows [I, 2I)."""
    views: dict[str, tuple[str, int, int, int]] = {}
    for name, (shape, _) in infos.items():
        m = _FUSED.match(name)
        if not m or len(shape) != 3:
            continue
        prefix, kind = m.groups()
        for e in range(shape[0]):
            if kind == "down_proj":
                views[f"{prefix}.{e}.down_proj.weight"] = (name, e, 0, shape[1])
            else:
                inner = shape[1] // 2
                views[f"{prefix}.{e}.gate_proj.weight"] = (name, e, 0, inner)
                views[f"{prefix}.{e}.up_proj.weight"] = (name, e, inner, inner)
    return views


def with_views(infos: Infos) -> Infos:
    """`infos` with every fused expert tensor replaced by its per-expert views."""
    views = fused_expert_views(infos)
    out = {n: v for n, v in infos.items() if not _FUSED.match(n) or len(v[0]) != 3}
    for view, (src, _, _, rows) in views.items():
        shape, dtype = infos[src]
        out[view] = ((rows, shape[2]), dtype)
    return out


def check_state_dict(cfg: BeamConfig, found: Infos, where: str = "checkpoint") -> None:
    """Refuse a v1, missing, extra, mis-shaped or non-float tensor, naming it (the float dtype
    is cast on load). `found` may hold fused experts; they are checked through their views."""
    v1 = is_v1_checkpoint(found)
    if v1:
        raise CheckpointError(v1_error(where, v1))
    found = with_views(found)
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
                f"config.json implies {list(shape)}")
        if found[name][1] not in FLOAT_DTYPES:
            raise CheckpointError(f"{where}: tensor {name} has dtype {found[name][1]}; an "
                                  "unquantized Beam checkpoint holds FP32, BF16 or FP16 tensors")


# ---------------------------------------------------------------------------- reading
def weight_map(ckpt_dir: str | Path) -> dict[str, Path]:
    """tensor name -> safetensors file (as stored), from the index or the single file."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / INDEX_NAME
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
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


_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32,
    "I64": torch.int64, "BOOL": torch.bool,
}


def _dtype(name: str, path: Path, tensor: str) -> torch.dtype:
    if name not in _ST_DTYPES:
        raise CheckpointError(f"{path}: tensor {tensor} has unsupported dtype {name}")
    return _ST_DTYPES[name]


class SafetensorsCheckpoint:
    """Lazy access to a checkpoint's tensors by name, fused experts seen as per-expert views.
    `infos` holds (shape, dtype) of every tensor from the headers; `get` reads one tensor."""

    def __init__(self, ckpt_dir: str | Path):
        self.dir = Path(ckpt_dir)
        self.files = weight_map(self.dir)
        self._handles: dict[Path, object] = {}
        stored = self._stored_infos()
        self.views = fused_expert_views(stored)
        self.stored = stored
        self.infos = with_views(stored)

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = _open(path)
        return self._handles[path]

    def _stored_infos(self) -> Infos:
        by_file: dict[Path, list[str]] = {}
        for name, path in self.files.items():
            by_file.setdefault(path, []).append(name)
        infos = {}
        for path, names in by_file.items():
            f = self._handle(path)
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{path}: index lists {name} but the file lacks it")
                sl = f.get_slice(name)
                infos[name] = (tuple(sl.get_shape()), _dtype(sl.get_dtype(), path, name))
        return infos

    def dtype(self, name: str) -> torch.dtype | None:
        return self.infos[name][1] if name in self.infos else None

    def get(self, name: str) -> torch.Tensor:
        if name not in self.infos:
            raise CheckpointError(f"{self.dir}: missing tensor {name}")
        src, expert, row, rows = self.views.get(name, (name, None, 0, 0))
        path = self.files[src]
        try:
            if expert is None:
                return self._handle(path).get_tensor(name)
            return self._handle(path).get_slice(src)[expert, row:row + rows].contiguous()
        except SafetensorError as exc:  # truncated data is only found on read
            raise CheckpointError(f"{path}: cannot read tensor {src} ({exc})") from exc

    def close(self) -> None:
        self._handles.clear()


def load_state_dict(ckpt_dir: str | Path, cfg: BeamConfig) -> dict[str, torch.Tensor]:
    """Validated full state dict of an unquantized checkpoint, per-expert names, as stored
    (FP32, BF16 or FP16; names and shapes checked before any tensor is read)."""
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    check_state_dict(cfg, ckpt.stored, where=str(ckpt_dir))
    return {name: ckpt.get(name) for name in ckpt.infos}


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
