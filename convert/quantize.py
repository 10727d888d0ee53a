"""The quantize stage: one work unit (a copied tensor, a group of Linears, a layer's KV scales)
in, its output tensors out, with ModelOpt's math from `beam_trtllm.quant_formats`."""

from __future__ import annotations

import torch

from beam_trtllm import quant_formats as qf

from .calibrate import Calibration
from .errors import ConvertError
from .plan import Unit


def _amax(name: str, weight: torch.Tensor) -> torch.Tensor:
    lo, hi = torch.aminmax(weight)
    amax = torch.maximum(lo.abs(), hi.abs()).float().cpu()
    if not torch.isfinite(amax):
        raise ConvertError(f"tensor {name} holds inf or NaN values; the input is corrupted")
    return amax


def _input_amax(unit: Unit, calib: Calibration | None) -> torch.Tensor | None:
    if calib is None:
        return None
    missing = [m for m in unit.modules if m not in calib.input_amax]
    if missing:
        raise ConvertError(f"calibration recorded no input for {missing[0]}")
    return torch.stack([calib.input_amax[m] for m in unit.modules]).max()  # fused: shared


def quantize_unit(unit: Unit, tensors: dict[str, torch.Tensor], calib: Calibration | None,
                  device: str = "cpu", threads: int = 1) -> list[tuple[str, torch.Tensor]]:
    if unit.kind == "copy":
        (name,) = unit.inputs
        return [(name, tensors[name])]
    if unit.kind == "kv":
        k_amax, v_amax = calib.kv_amax[unit.layer]
        return [(unit.outputs[0][0], qf.kv_cache_scale(k_amax)),
                (unit.outputs[1][0], qf.kv_cache_scale(v_amax))]
    weights = {m: tensors[m + ".weight"].to(device) for m in unit.modules}
    amaxes = {m: _amax(m + ".weight", w) for m, w in weights.items()}
    act = _input_amax(unit, calib) if unit.fmt in ("fp8", "nvfp4") else None
    out: list[tuple[str, torch.Tensor]] = []
    if unit.fmt == "none":
        return [(m + ".weight", w.cpu()) for m, w in weights.items()]
    if unit.fmt in ("nvfp4", "w4a16_nvfp4"):
        scale_2 = torch.stack(list(amaxes.values())).max() / (qf.E2M1_MAX * qf.FP8_MAX)
        for m, w in weights.items():
            packed, scale, _ = qf.quantize_nvfp4(w, scale_2.to(w.device), threads=threads)
            out += [(m + ".weight", packed.cpu()), (m + ".weight_scale", scale.cpu()),
                    (m + ".weight_scale_2", scale_2.reshape(()).clone())]
            if act is not None:
                out.append((m + ".input_scale", qf.nvfp4_activation_scale(act)))
    elif unit.fmt == "fp8":  # fused only for an expert's gate/up: one gate_up_proj quantizer
        shared = torch.stack(list(amaxes.values())).max() if unit.fused else None
        for m, w in weights.items():
            q, scale = qf.quantize_fp8(w, amaxes[m] if shared is None else shared)
            out += [(m + ".weight", q.cpu()), (m + ".weight_scale", scale)]
            if act is not None:
                out.append((m + ".input_scale", qf.fp8_activation_scale(act)))
    else:  # fp8_pb_wo; a fused group only exists for one-block weights: they share the max
        # Encoded on the CPU even with --device cuda: the H200 run of bench/convert_bench.py
        # found CUDA bytes != CPU (= ModelOpt) bytes for this format and the cause is not yet
        # known, so the GPU path is not used until it is shown byte-identical.
        weights = {m: w.cpu() for m, w in weights.items()}
        shared = (torch.stack([a.cpu() for a in amaxes.values()]).max().reshape(1, 1)
                  if unit.fused else None)
        for m, w in weights.items():
            q, scale = qf.quantize_fp8_block(w, shared)
            out += [(m + ".weight", q.cpu()), (m + ".weight_scale", qf.fp8_block_scale_on_disk(scale.cpu()))]
    return out
