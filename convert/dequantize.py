"""`convert.dequant(dir)`: a quantized checkpoint (either layout) back to the BF16-layout state
dict of the input (the canonical names and shapes of `expected_tensors`, experts per expert;
router FP32, everything else BF16), which `beam_trtllm.hf_model.model_from_state_dict` loads
into transformers' BeamForCausalLM. Used by `beam-trt verify`, the engine's tests (the
canonical model on the dequantized weights) and the kernels' references. Decoding is
`beam_trtllm.quant_formats` (the kernels' decoders).

`QuantizedCheckpoint` reads one stored tensor at a time (rank files are reassembled per
tensor), so `verify` can walk a model far larger than memory."""

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


class QuantizedCheckpoint:
    def __init__(self, path: str | Path):
        self.dir = Path(path)
        try:
            self.config_json = json.loads((self.dir / "config.json").read_text())
            self.cfg = BeamConfig.from_hf(self.config_json)
        except (OSError, ValueError, ConfigError) as exc:
            raise ConvertError(f"{self.dir / 'config.json'}: {exc}") from exc
        ranks = sorted(self.dir.glob("rank*.safetensors"), key=lambda p: int(p.stem[4:]))
        self.mapping = None
        if ranks and "mapping" in self.config_json:
            m = self.config_json["mapping"]
            self.mapping = Mapping(m["tp_size"], m["moe_ep_size"])
            self.files = [TensorFile(p) for p in ranks]
        else:
            self.files = [TensorFile(p) for p in self._hf_files()]
        qcfg = self.config_json.get("quantization_config") or {}
        # compressed-tensors FP8_DYNAMIC: per-channel scales [N, 1] in the model dtype
        self.compressed_tensors = qcfg.get("quant_method") == "compressed-tensors"
        self.where: dict[str, list[tuple[int, TensorFile]]] = {}
        for r, f in enumerate(self.files):
            for n in f.specs:
                self.where.setdefault(n, []).append((r, f))

    def _hf_files(self) -> list[Path]:
        if (self.dir / INDEX_NAME).is_file():
            names = set(json.loads((self.dir / INDEX_NAME).read_text())["weight_map"].values())
            return [self.dir / n for n in sorted(names)]
        if (self.dir / SINGLE_NAME).is_file():
            return [self.dir / SINGLE_NAME]
        raise ConvertError(f"{self.dir}: no safetensors weights")

    def names(self) -> list[str]:
        return list(self.where)

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ConvertError(f"{self.dir}: tensor {name} is missing")
        holders = self.where[name]
        if self.mapping is None:
            return holders[0][1].read(name)
        pieces = {r: f.read(name) for r, f in holders}
        r0 = holders[0][0]
        shape = full_shape(name, pieces[r0].shape, self.cfg, self.mapping, r0)
        return unshard(name, pieces, shape, self.cfg, self.mapping)

    def dequant_tensor(self, name: str) -> torch.Tensor:
        """One tensor of the BF16 layout (`...weight` of a quantized Linear is decoded: FP32,
        or for compressed-tensors the library's BF16 decompression)."""
        w = self.tensor(name)
        module = name[: -len(".weight")]
        if w.dtype == torch.uint8:
            return qf.dequantize_nvfp4(w, self.tensor(module + ".weight_scale"),
                                       self.tensor(module + ".weight_scale_2"), torch.float32)
        if w.dtype == torch.float8_e4m3fn and self.compressed_tensors:
            # the library's decompression (in the scale's dtype), bit for bit
            return qf.dequantize_fp8_channel(w, self.tensor(module + ".weight_scale"))
        if w.dtype == torch.float8_e4m3fn:
            return qf.dequantize_fp8(w, self.tensor(module + ".weight_scale"), torch.float32)
        return w

    def close(self) -> None:
        for f in self.files:
            f.close()


def dequant(ckpt: str | Path) -> dict[str, torch.Tensor]:
    q = QuantizedCheckpoint(ckpt)
    out = {}
    for name, (shape, dtype) in expected_tensors(q.cfg).items():
        out[name] = q.dequant_tensor(name).to(dtype)
        if tuple(out[name].shape) != shape:
            raise ConvertError(f"{ckpt}: tensor {name} decodes to {list(out[name].shape)}, "
                               f"config.json implies {list(shape)}")
    q.close()
    return out
