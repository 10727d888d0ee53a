"""TP / EP sharding for the `trtllm` layout (`rank{r}.safetensors`, TRT-LLM's Mapping).

world = tp; moe_ep = ep, moe_tp = tp // ep; rank r has moe_ep_rank = r % ep and
moe_tp_rank = r // ep (tensorrt_llm.Mapping). Rules, by module:
- q_proj and the attention's output gate self_attn.gate_proj ([Hq*D, H], D rows a head):
  output rows by query heads; self_attn.gate_bias ([Hq]) by query heads; o_proj: input
  columns by query heads;
- k_proj, v_proj: output rows by KV heads; when tp > num_key_value_heads, KV head
  r // (tp / Hkv) is replicated on the tp / Hkv ranks whose query heads read it;
- dense MLP and lm_head: gate/up/lm_head rows, down columns, split tp ways;
- experts: expert e lives on ep rank e // (E / ep), its gate/up rows and down columns split
  moe_tp ways;
- everything else (embedding, norms, router, per-tensor scales, KV scales) is replicated.
A quantized tensor is split along the same logical dimension: NVFP4 packed weight and block
scale with the weight (columns / 2 and / 16), the FP8 block scale [nb,1,kb,1] by blocks.
A split that would cut a head, a 16-block or a 128-block is refused, naming --tp / --ep.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from beam_trtllm.config import BeamConfig

from .errors import ConvertError

_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.")


@dataclass(frozen=True)
class Mapping:
    tp: int
    ep: int

    @property
    def world(self) -> int:
        return self.tp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    def moe_ep_rank(self, r: int) -> int:
        return r % self.ep

    def moe_tp_rank(self, r: int) -> int:
        return r // self.ep

    def to_json(self) -> dict:
        return {"world_size": self.tp, "tp_size": self.tp, "pp_size": 1,
                "moe_tp_size": self.moe_tp, "moe_ep_size": self.ep}


def check_mapping(cfg: BeamConfig, tp: int, ep: int) -> Mapping:
    if tp < 1 or ep < 1:
        raise ConvertError(f"--tp {tp} --ep {ep}: both must be >= 1")
    if tp % ep:
        raise ConvertError(f"--ep {ep} must divide --tp {tp} (moe_tp = tp / ep)")
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if hq % tp:
        raise ConvertError(f"--tp {tp} does not divide num_attention_heads ({hq})")
    if (tp <= hkv and hkv % tp) or (tp > hkv and tp % hkv):
        raise ConvertError(f"--tp {tp}: KV heads ({hkv}) can be neither split evenly nor "
                           "replicated evenly (tp must divide or be a multiple of them)")
    if cfg.num_experts % ep:
        raise ConvertError(f"--ep {ep} does not divide num_experts ({cfg.num_experts})")
    return Mapping(tp, ep)


def _module_rule(name: str, cfg: BeamConfig, m: Mapping, r: int):
    """(orientation, parts, index) for rank r, None = replicate, "absent" = not on rank r."""
    if (hit := _EXPERT.match(name)) is not None:
        e, proj = int(hit.group(1)), hit.group(2)
        if e // (cfg.num_experts // m.ep) != m.moe_ep_rank(r):
            return "absent"
        return ("col" if proj == "down" else "row", m.moe_tp, m.moe_tp_rank(r))
    if ".self_attn." in name:
        if ".k_proj." in name or ".v_proj." in name:
            if name.endswith(("k_scale", "v_scale")):
                return None
            parts = min(m.tp, cfg.num_key_value_heads)
            return ("row", parts, r // (m.tp // parts))
        if ".q_proj." in name or ".gate_proj." in name or name.endswith(".gate_bias"):
            return ("row", m.tp, r)  # query heads; tp divides them (check_mapping)
        if ".o_proj." in name:
            return ("col", m.tp, r)
        return None
    if name.startswith("lm_head.") or re.search(r"\.mlp\.(gate|up)_proj\.", name):
        return ("row", m.tp, r)
    if re.search(r"\.mlp\.down_proj\.", name):
        return ("col", m.tp, r)
    return None


def _dim(name: str, ndim: int, orient: str) -> int | None:
    if ndim == 0:
        return None  # per-tensor scales: replicated
    if ndim == 4:  # fp8_pb_wo block scale [nb, 1, kb, 1]
        return 0 if orient == "row" else 2
    return 0 if orient == "row" else 1


def placement(name: str, shape, cfg: BeamConfig, m: Mapping, r: int):
    """None (absent on rank r), "full", or (dim, parts, index)."""
    rule = _module_rule(name, cfg, m, r)
    if rule == "absent":
        return None
    if rule is None or rule[1] == 1:
        return "full"
    orient, parts, index = rule
    dim = _dim(name, len(shape), orient)
    if dim is None:
        return "full"
    if shape[dim] % parts:
        raise ConvertError(f"--tp {m.tp} --ep {m.ep}: tensor {name} {list(shape)} cannot be split "
                           f"{parts} ways along dim {dim} (a head, 16- or 128-block would be cut)")
    return (dim, parts, index)


def full_shape(name: str, piece_shape, cfg: BeamConfig, m: Mapping, r: int):
    """The unsharded shape of a tensor from its piece on rank r."""
    rule = _module_rule(name, cfg, m, r)
    if rule in (None, "absent") or rule[1] == 1:
        return tuple(piece_shape)
    orient, parts, _ = rule
    dim = _dim(name, len(piece_shape), orient)
    if dim is None:
        return tuple(piece_shape)
    return tuple(s * parts if d == dim else s for d, s in enumerate(piece_shape))


def take(tensor: torch.Tensor, where) -> torch.Tensor:
    if where == "full":
        return tensor
    dim, parts, index = where
    size = tensor.shape[dim] // parts
    return tensor.narrow(dim, index * size, size).contiguous()


def rank_shape(shape, where) -> tuple[int, ...]:
    if where == "full":
        return tuple(shape)
    dim, parts, _ = where
    return tuple(s // parts if d == dim else s for d, s in enumerate(shape))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def unshard(name: str, pieces: dict[int, torch.Tensor], shape, cfg: BeamConfig, m: Mapping):
    """Reassemble one tensor from its rank pieces, checking replicas are identical."""
    by_index: dict[int, torch.Tensor] = {}
    dim = None
    for r, piece in sorted(pieces.items()):
        where = placement(name, shape, cfg, m, r)
        if where == "full":
            where = (0, 1, 0)
        dim, _, index = where
        if index in by_index and not torch.equal(_bytes(by_index[index]), _bytes(piece)):
            raise ConvertError(f"tensor {name}: replicas on different ranks differ")
        by_index.setdefault(index, piece)
    parts = [by_index[i] for i in sorted(by_index)]
    if len(parts) == 1:
        return parts[0]
    dtype = parts[0].dtype  # cat on raw bytes: not every op has a float8 kernel
    return torch.cat([p.view(torch.uint8) for p in parts], dim=dim).view(dtype)
