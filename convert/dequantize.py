"""`convert.dequant(dir)`: a quantized checkpoint (either layout) back to the BF16-layout state
dict of the input (same names and shapes; router FP32, everything else BF16). Used by
`beam-trt verify`, the engine's tests ("the reference on the dequantized weights") and the
kernels' references. Decoding is `beam_trtllm.quant_formats` (the kernels' decoders)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from beam_trtllm import quant_formats as qf
from beam_trtllm.checkpoint import INDEX_NAME, SINGLE_NAME, expected_tensors
from beam_trtllm.config import BeamConfig, ConfigError

from .errors import ConvertError
from .shard import Mapping, full_shape, unshard
from .st_io import TensorFile


def _files(ckpt: Path) -> list[Path]:
    ranks = sorted(ckpt.glob("rank*.safetensors"), key=lambda p: int(p.stem[4:]))
    if ranks:
        return ranks
    if (ckpt / INDEX_NAME).is_file():
        names = set(json.loads((ckpt / INDEX_NAME).read_text())["weight_map"].values())
        return [ckpt / n for n in sorted(names)]
    if (ckpt / SINGLE_NAME).is_file():
        return [ckpt / SINGLE_NAME]
    raise ConvertError(f"{ckpt}: no safetensors weights")


def load_quantized(ckpt: str | Path) -> tuple[BeamConfig, dict[str, torch.Tensor]]:
    """Every stored tensor of an output dir, rank files reassembled into whole tensors."""
    ckpt = Path(ckpt)
    try:
        raw = json.loads((ckpt / "config.json").read_text())
        cfg = BeamConfig.from_hf(raw)
    except (OSError, ValueError, ConfigError) as exc:
        raise ConvertError(f"{ckpt / 'config.json'}: {exc}") from exc
    files = [TensorFile(p) for p in _files(ckpt)]
    if "mapping" not in raw or not files[0].path.name.startswith("rank"):
        return cfg, {n: f.read(n) for f in files for n in f.specs}
    m = raw["mapping"]
    mapping = Mapping(m["tp_size"], m["moe_ep_size"])
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for r, f in enumerate(files):
        for n in f.specs:
            pieces.setdefault(n, {})[r] = f.read(n)
    full = {n: full_shape(n, next(iter(p.values())).shape, cfg, mapping, next(iter(p)))
            for n, p in pieces.items()}
    return cfg, {n: unshard(n, p, full[n], cfg, mapping) for n, p in pieces.items()}


def dequant(ckpt: str | Path) -> dict[str, torch.Tensor]:
    cfg, stored = load_quantized(ckpt)
    out = {}
    for name, (shape, dtype) in expected_tensors(cfg).items():
        module = name[: -len(".weight")]
        if name not in stored:
            raise ConvertError(f"{ckpt}: tensor {name} is missing")
        w = stored[name]
        if w.dtype == torch.uint8:  # NVFP4
            w = qf.dequantize_nvfp4(w, stored[module + ".weight_scale"],
                                    stored[module + ".weight_scale_2"], torch.float32)
        elif w.dtype == torch.float8_e4m3fn:
            w = qf.dequantize_fp8(w, stored[module + ".weight_scale"], torch.float32)
        out[name] = w.to(dtype)
        if tuple(out[name].shape) != shape:
            raise ConvertError(f"{ckpt}: tensor {name} decodes to {list(out[name].shape)}, "
                               f"config.json implies {list(shape)}")
    return out
