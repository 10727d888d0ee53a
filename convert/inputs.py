"""The unquantized input checkpoint: config, shard map, validated before any work, read per tensor.

Accepted as transformers' `BeamForCausalLM.save_pretrained` writes it, and as vLLM and SGLang
also read it (shared/BEAM_SPEC.md "Weights on disk"):
- float tensors in FP32, BF16 or FP16 (each tensor may differ). `read` casts every tensor to the
  dtype the output is written in: BF16, the MoE routers FP32 (`expected_tensors`). That is what
  ModelOpt exports from the model loaded with `dtype=torch.bfloat16` (transformers keeps the
  router in FP32), so an FP32 input converts to the same bytes as its BF16 cast;
- experts per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`) or fused
  (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj`
  [E, H, I]). A fused tensor is seen through per-expert views; each view is a contiguous byte
  range of its file, read alone with pread, so a fused layer is never held whole.
A checkpoint of beam-trt's pre-canonical Beam (v1: per-head `self_attn.g_proj`) is refused with
an error saying what it is.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from beam_trtllm.checkpoint import (FLOAT_DTYPES, INDEX_NAME, SINGLE_NAME, expected_tensors,
                                    fused_expert_views, is_v1_checkpoint, v1_error)
from beam_trtllm.config import BeamConfig, ConfigError

from .errors import ConvertError
from .st_io import NAMES, TensorFile, nbytes_of

# Files a server needs besides the weights (Dynamo's frontend reads the first four).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "tokenizer.model")


@dataclass(frozen=True)
class Source:
    """Where one (per-expert) tensor lives: a stored tensor, or rows of a fused one."""

    file: TensorFile
    stored: str  # the tensor's name in the file
    expert: int | None = None  # fused experts: the expert index ...
    row: int = 0  # ... and its rows [row, row + rows) of the fused tensor
    rows: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.file.specs[self.stored][0]

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.file.specs[self.stored][1]
        return shape if self.expert is None else (self.rows, shape[2])

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)

    def describe(self, name: str) -> str:
        if self.expert is None:
            return f"tensor {name}"
        return (f"tensor {name} (expert {self.expert}, rows {self.row}..{self.row + self.rows - 1} "
                f"of the fused {self.stored})")

    def read(self) -> torch.Tensor:
        if self.expert is None:
            return self.file.read(self.stored)
        return self.file.read_rows(self.stored, self.expert, self.row, self.rows)


class InputCheckpoint:
    def __init__(self, in_dir: str | Path):
        self.dir = Path(in_dir)
        if not self.dir.is_dir():
            raise ConvertError(f"{self.dir}: input checkpoint directory does not exist")
        try:
            self.cfg = BeamConfig.from_hf(self.dir / "config.json")
        except ConfigError as exc:
            raise ConvertError(str(exc)) from exc
        self.config_json = json.loads((self.dir / "config.json").read_text())
        self.expected = expected_tensors(self.cfg)
        self.files = {p: TensorFile(p) for p in self._shard_paths()}
        self.stored: dict[str, TensorFile] = {}  # stored tensor name -> its file
        self._map_tensors()
        self._check_stored()
        self.sources = self._sources()
        self._check_against_config()

    def _shard_paths(self) -> list[Path]:
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                self.index = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise ConvertError(f"{index}: not a valid safetensors index ({exc})") from exc
            paths = sorted({self.dir / f for f in self.index.values()})
            for p in paths:
                if not p.is_file():
                    raise ConvertError(f"{index}: lists shard {p.name}, which is missing")
            return paths
        if (self.dir / SINGLE_NAME).is_file():
            self.index = None
            return [self.dir / SINGLE_NAME]
        raise ConvertError(f"{self.dir}: no {INDEX_NAME} or {SINGLE_NAME}")

    def _map_tensors(self) -> None:
        for f in self.files.values():
            for name in f.specs:
                if self.index is not None and self.dir / self.index.get(name, "") != f.path:
                    raise ConvertError(f"{f.path}: holds tensor {name}, which {INDEX_NAME} "
                                       "does not list for this file")
                self.stored[name] = f
        if self.index is not None:
            for name, fname in self.index.items():
                if name not in self.stored:
                    raise ConvertError(f"{self.dir / fname}: lacks tensor {name} listed in "
                                       f"{INDEX_NAME}")

    def _check_stored(self) -> None:
        """v1 checkpoints, non-float tensors, fused experts of the wrong shape: by stored name."""
        v1 = is_v1_checkpoint(self.stored)
        if v1:
            raise ConvertError(v1_error(str(self.stored[v1].path), v1))
        for name, f in self.stored.items():
            dtype, shape = f.specs[name]
            if dtype not in FLOAT_DTYPES:
                raise ConvertError(f"{f.path}: tensor {name} has dtype {NAMES[dtype]}; an "
                                   "unquantized Beam checkpoint holds F32, BF16 or F16 tensors")
            fused = _fused_shape(self.cfg, name)
            if fused is not None and shape != fused:
                raise ConvertError(f"{f.path}: fused expert tensor {name} has shape "
                                   f"{list(shape)}, config.json implies {list(fused)}")

    def _sources(self) -> dict[str, Source]:
        infos = {n: (f.specs[n][1], f.specs[n][0]) for n, f in self.stored.items()}
        views = fused_expert_views(infos)
        sources = {n: Source(f, n) for n, f in self.stored.items() if n not in
                   {stored for stored, *_ in views.values()}}
        for view, (stored, expert, row, rows) in views.items():
            if view in sources:
                raise ConvertError(f"{self.stored[stored].path}: tensor {view} is stored both "
                                   f"per expert and in the fused {stored}")
            sources[view] = Source(self.stored[stored], stored, expert, row, rows)
        return sources

    def _check_against_config(self) -> None:
        for name, (shape, _) in self.expected.items():
            if name not in self.sources:
                raise ConvertError(f"{self.dir}: missing tensor {name} (config.json implies it)")
            src = self.sources[name]
            if src.shape != shape:
                raise ConvertError(f"{src.file.path}: {src.describe(name)} has shape "
                                   f"{list(src.shape)}, config.json implies {list(shape)}"
                                   f"{_gate_hint(self.cfg, name, src.shape)}")
        for name, src in self.sources.items():
            if name not in self.expected:
                raise ConvertError(f"{src.file.path}: unknown tensor name {name} (not a Beam "
                                   "tensor for this config.json)")

    def read(self, name: str) -> torch.Tensor:
        """The tensor in the dtype the output is written in (BF16; the routers FP32)."""
        return self.read_stored(name).to(self.expected[name][1])

    def read_stored(self, name: str) -> torch.Tensor:
        """The tensor as stored (FP32, BF16 or FP16)."""
        return self.sources[name].read()

    def nbytes(self, name: str) -> int:
        return self.sources[name].nbytes

    def fingerprint(self) -> dict:
        """Cheap identity of the input (sizes, header hashes) for resume checks and the manifest."""
        return {p.name: {"size": f.size,
                         "header_sha256": hashlib.sha256(f.header_bytes).hexdigest()}
                for p, f in self.files.items()}

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _fused_shape(cfg: BeamConfig, name: str) -> tuple[int, ...] | None:
    """The shape config.json implies for a fused expert tensor name, None for other names."""
    parts = name.split(".")
    if len(parts) != 6 or parts[:2] != ["model", "layers"] or parts[3:5] != ["mlp", "experts"]:
        return None
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}.get(parts[5])


def _gate_hint(cfg: BeamConfig, name: str, shape) -> str:
    """Why an attention gate of one row per head is wrong (v1's shape under the canonical name)."""
    per_head = bool(shape) and shape[0] == cfg.num_attention_heads
    if name.endswith(".self_attn.gate_proj.weight") and per_head:
        return (f" (one row per head: canonical Beam's output gate has one row per query "
                f"element, num_attention_heads * head_dim = {cfg.q_size})")
    return ""
