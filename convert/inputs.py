"""The BF16 input checkpoint: config, shard map, validated before any work, read per tensor."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from beam_trtllm.checkpoint import INDEX_NAME, SINGLE_NAME, expected_tensors
from beam_trtllm.config import BeamConfig, ConfigError

from .errors import ConvertError
from .st_io import NAMES, TensorFile

# Files a server needs besides the weights (Dynamo's frontend reads the first four).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "tokenizer.model")


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
        self.files = {p: TensorFile(p) for p in self._shard_paths()}
        self.where: dict[str, TensorFile] = {}
        self._map_tensors()
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
                self.where[name] = f
        if self.index is not None:
            for name, fname in self.index.items():
                if name not in self.where:
                    raise ConvertError(f"{self.dir / fname}: lacks tensor {name} listed in {INDEX_NAME}")

    def _check_against_config(self) -> None:
        expected = expected_tensors(self.cfg)
        for name, (shape, dtype) in expected.items():
            if name not in self.where:
                raise ConvertError(f"{self.dir}: missing tensor {name} (config.json implies it)")
            f = self.where[name]
            got_dtype, got_shape = f.specs[name]
            if got_shape != shape:
                raise ConvertError(f"{f.path}: tensor {name} has shape {list(got_shape)}, "
                                   f"config.json implies {list(shape)}")
            if got_dtype != dtype:
                raise ConvertError(f"{f.path}: tensor {name} has dtype {NAMES[got_dtype]}, "
                                   f"expected {NAMES[dtype]}")
        for name, f in self.where.items():
            if name not in expected:
                raise ConvertError(f"{f.path}: unknown tensor name {name} (not a Beam tensor "
                                   "for this config.json)")

    def read(self, name: str) -> torch.Tensor:
        return self.where[name].read(name)

    def nbytes(self, name: str) -> int:
        return self.where[name].offsets[name][1]

    def fingerprint(self) -> dict:
        """Cheap identity of the input (sizes, header hashes) for resume checks and the manifest."""
        return {p.name: {"size": f.size, "header_sha256": hashlib.sha256(f.header_bytes).hexdigest()}
                for p, f in self.files.items()}

    def close(self) -> None:
        for f in self.files.values():
            f.close()
