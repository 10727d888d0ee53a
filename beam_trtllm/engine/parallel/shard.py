"""A checkpoint seen from one rank of a parallel engine: each tensor's piece by the rules of
`mapping.py` (the converter's rules, convert/shard.py, except that the LM head stays whole and
attention DP keeps attention and dense MLPs whole); and the converter's `rank{r}.safetensors`
files read back as one checkpoint, their layout checked against the build's.

A quantized tensor is split along the same logical dimension as its weight: NVFP4 packed
weight and block scale with it (columns / 2 and / 16), FP8 128x128 block scales
[nb, 1, kb, 1] by blocks; per-tensor scales and per-row scales of a column split are whole.
A split that cuts a head, a 16-block or a 128-block is refused, naming --tp / --ep.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ...config import BeamConfig
from ..types import EngineError
from .mapping import ParallelMapping

_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.")
_DENSE = re.compile(r"\.mlp\.(gate|up|down)_proj\.")


def _rule(name: str, cfg: BeamConfig, m: ParallelMapping):
    """(orientation, parts, index) of tensor `name` on m's rank; None = whole."""
    if (hit := _EXPERT.match(name)) is not None:
        return ("col" if hit.group(2) == "down" else "row", m.moe_tp, m.moe_tp_rank)
    tp, r = m.attn_tp, m.attn_rank
    if tp == 1:
        return None
    if ".self_attn." in name:
        if name.endswith(("k_scale", "v_scale")) or not re.search(r"_proj\.|gate_bias$", name):
            return None  # KV scales, q/k norms: whole
        if ".k_proj." in name or ".v_proj." in name:
            parts = min(tp, cfg.num_key_value_heads)
            return ("row", parts, r // (tp // parts))
        if ".o_proj." in name:
            return ("col", tp, r)
        return ("row", tp, r)  # q_proj, the output gate's gate_proj, gate_bias: query heads
    if (hit := _DENSE.search(name)) is not None:
        return ("col" if hit.group(1) == "down" else "row", tp, r)
    return None


def _dim(shape, orient: str) -> int | None:
    if len(shape) == 0:
        return None
    if len(shape) == 4:  # fp8_pb_wo block scale [nb, 1, kb, 1]
        return 0 if orient == "row" else 2
    if orient == "col" and (len(shape) == 1 or shape[1] == 1):
        return None  # a per-output-row scale of a column split: every rank needs it whole
    return 0 if orient == "row" else 1


def placement(name: str, shape, dtype, cfg: BeamConfig, m: ParallelMapping):
    """"whole" or (dim, parts, index) of tensor `name` on m's rank."""
    rule = _rule(name, cfg, m)
    if rule is None or rule[1] == 1:
        return "whole"
    orient, parts, index = rule
    dim = _dim(shape, orient)
    if dim is None:
        return "whole"
    piece = shape[dim] // parts
    if shape[dim] % parts:
        raise EngineError(f"{m.describe()}: tensor {name} {list(shape)} cannot be split {parts} "
                          f"ways along dim {dim} (a head or a quantization block would be cut)")
    if name.endswith(".weight") and dim == 1 and dtype == torch.uint8 and (2 * piece) % 16:
        raise EngineError(f"{m.describe()}: tensor {name} {list(shape)}: a {parts}-way split "
                          "would cut an NVFP4 block of 16 (--tp / --ep)")
    return (dim, parts, index)


def take(tensor: torch.Tensor, where) -> torch.Tensor:
    if where == "whole":
        return tensor
    dim, parts, index = where
    size = tensor.shape[dim] // parts
    return tensor.narrow(dim, index * size, size).contiguous()


class RankView:
    """A checkpoint reader (build.CheckpointReader or RankFilesReader) as one rank sees it:
    `get` returns the rank's piece. 128x128-block FP8 weights must split on block bounds."""

    def __init__(self, reader, cfg: BeamConfig, mapping: ParallelMapping):
        self.reader, self.cfg, self.mapping = reader, cfg, mapping

    @property
    def used(self) -> set[str]:
        return self.reader.used

    def unused(self) -> list[str]:
        return self.reader.unused()

    def dtype(self, name: str):
        return self.reader.dtype(name)

    def get(self, name: str) -> torch.Tensor:
        t = self.reader.get(name)
        where = placement(name, tuple(t.shape), t.dtype, self.cfg, self.mapping)
        if where != "whole" and name.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            scale = name[: -len("weight")] + "weight_scale"
            blocked = self.reader.dtype(scale) is not None and self._scale_rank(scale) in (0, 4)
            if blocked and self.reader.dtype(name[: -len("weight")] + "input_scale") is None \
                    and (t.shape[where[0]] // where[1]) % 128:
                raise EngineError(f"{self.mapping.describe()}: tensor {name} {list(t.shape)}: a "
                                  f"{where[1]}-way split would cut a 128x128 FP8 block")
        return take(t, where)

    def _scale_rank(self, name: str) -> int:
        return len(self.reader.get(name).shape)


# ---------------------------------------------------------------------------- rank files
class RankFilesReader:
    """The converter's `--format trtllm` output (config.json `mapping`, `rank{r}.safetensors`)
    read as one checkpoint: each tensor reassembled from its rank pieces (replicas checked
    equal), by the converter's own rules (convert/shard.py)."""

    def __init__(self, ckpt_dir: Path, cfg: BeamConfig, want: ParallelMapping):
        from safetensors import safe_open

        from convert.shard import full_shape

        self.dir, self.cfg = Path(ckpt_dir), cfg
        self.layout = _rank_files_layout(self.dir, want)
        self.files = [safe_open(str(self.dir / f"rank{r}.safetensors"), framework="pt")
                      for r in range(self.layout.world)]
        self.ranks_of: dict[str, list[int]] = {}
        self.infos: dict[str, tuple[tuple, torch.dtype]] = {}
        for r, f in enumerate(self.files):
            for key in f.keys():
                self.ranks_of.setdefault(key, []).append(r)
                if key not in self.infos:
                    piece = f.get_slice(key)
                    shape = full_shape(key, tuple(piece.get_shape()), cfg, self.layout, r)
                    self.infos[key] = (shape, _DTYPES[piece.get_dtype()])
        self.used: set[str] = set()

    def dtype(self, name: str):
        info = self.infos.get(name)
        return None if info is None else info[1]

    def get(self, name: str) -> torch.Tensor:
        from convert.errors import ConvertError
        from convert.shard import unshard

        if name not in self.infos:
            raise EngineError(f"{self.dir}: rank files have no tensor {name}")
        self.used.add(name)
        pieces = {r: self.files[r].get_tensor(name) for r in self.ranks_of[name]}
        try:
            return unshard(name, pieces, self.infos[name][0], self.cfg, self.layout)
        except ConvertError as exc:
            raise EngineError(f"{self.dir}: {exc}") from exc

    def unused(self) -> list[str]:
        return sorted(set(self.infos) - self.used)

    def check(self, cfg: BeamConfig) -> None:
        from ...checkpoint import expected_tensors

        for name, (shape, _) in expected_tensors(cfg).items():
            if name in self.infos:
                got, dtype = self.infos[name]
                want = (*shape[:-1], shape[-1] // 2) if dtype == torch.uint8 else shape
                if tuple(got) != tuple(want):
                    raise EngineError(f"{self.dir}: tensor {name} has shape {list(got)} across "
                                      f"its rank files, config.json implies {list(want)}")


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "I64": torch.int64,
           "I32": torch.int32}


def is_rank_files(ckpt_dir: Path) -> bool:
    return (Path(ckpt_dir) / "rank0.safetensors").is_file()


def _rank_files_layout(ckpt_dir: Path, want: ParallelMapping):
    """The converter's Mapping of the rank files; refused unless it is the build's layout."""
    from convert.shard import Mapping

    where = f"{ckpt_dir / 'config.json'}"
    mapping = json.loads((ckpt_dir / "config.json").read_text()).get("mapping")
    if not isinstance(mapping, dict):
        raise EngineError(f"{where}: rank files without a `mapping` field (not the converter's "
                          "--format trtllm output)")
    for field, value in (("tp_size", want.tp), ("moe_ep_size", want.ep)):
        if mapping.get(field) != value:
            flag = "--tp" if field == "tp_size" else "--ep"
            raise EngineError(f"{where}: mapping.{field} is {mapping.get(field)!r}, the build "
                              f"asks {flag} {value}: rank files of another layout (convert "
                              f"again with --format trtllm --tp {want.tp} --ep {want.ep}, or "
                              "build from the hf-format checkpoint)")
    layout = Mapping(int(mapping["tp_size"]), int(mapping["moe_ep_size"]))
    missing = [r for r in range(layout.world) if not (ckpt_dir / f"rank{r}.safetensors").is_file()]
    if missing:
        raise EngineError(f"{ckpt_dir}: rank{missing[0]}.safetensors is missing (mapping "
                          f"world_size {layout.world})")
    return layout
