"""compressed-tensors' own flow on a Beam checkpoint: the oracle for `beam-trt build` /
`convert --format compressed-tensors` (nothing of beam-trt's writes these files).

`ct_export` does what llm-compressor's `oneshot(scheme="FP8_DYNAMIC")` + `save_pretrained` do
with the library: the checkpoint's Linears as `nn.Linear` modules under their checkpoint names
(per expert, as published FP8 checkpoints store experts), `apply_quantization_config` with the
FP8_DYNAMIC preset and an `ignore` list, each weight's per-channel scale from the library's
`calculate_qparams` on the row min / max (what its min-max observer feeds it),
`ModelCompressor.compress_model`, the compressed state dict saved, and `update_config` writing
`quantization_config` into config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

SIDE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "chat_template.jinja")
LINEAR_SUFFIXES = ("_proj.weight", "lm_head.weight")


def fp8_dynamic_config(ignore, preset: str = "FP8_DYNAMIC"):
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    return QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))


def _tree(state: dict[str, torch.Tensor]) -> nn.Module:
    """An nn.Module whose named parameters are `state`, Linears as nn.Linear."""
    root = nn.Module()
    for name, t in state.items():
        *path, leaf = name.split(".")
        parent = root
        linear = name.endswith(LINEAR_SUFFIXES)
        for i, part in enumerate(path):
            if not hasattr(parent, part):
                last = linear and i == len(path) - 1
                parent.add_module(part, nn.Linear(t.shape[1], t.shape[0], bias=False,
                                                  dtype=t.dtype) if last else nn.Module())
            parent = getattr(parent, part)
        if linear:
            parent.weight.data.copy_(t)
        else:
            parent.register_parameter(leaf, nn.Parameter(t.clone(), requires_grad=False))
    return root


def observe_weight_scales(model: nn.Module) -> int:
    """Each quantized Linear's weight_scale from the library's calculate_qparams on the
    per-row min / max; returns how many Linears are quantized."""
    from compressed_tensors.quantization.utils import calculate_qparams

    n = 0
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        w = module.weight.data
        scale, zp = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True),
                                      scheme.weights)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zp)
        n += 1
    return n


def ct_export(ckpt_dir: Path, out_dir: Path, ignore=("lm_head",), preset="FP8_DYNAMIC") -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from safetensors.torch import save_file

    from beam_trtllm.checkpoint import SafetensorsCheckpoint

    ckpt = SafetensorsCheckpoint(ckpt_dir)
    model = _tree({name: ckpt.get(name) for name in ckpt.infos})
    ckpt.close()
    apply_quantization_config(model, fp8_dynamic_config(ignore, preset))
    observe_weight_scales(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in SIDE:
        if (Path(ckpt_dir) / name).is_file():
            shutil.copyfile(Path(ckpt_dir) / name, out_dir / name)
    compressor.update_config(str(out_dir))
    return out_dir


def ct_decompress(out_dir: Path) -> dict[str, torch.Tensor]:
    """Every quantized Linear's weight as the library decompresses it (module -> tensor)."""
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    qcfg = QuantizationConfig.model_validate(
        json.loads((out_dir / "config.json").read_text())["quantization_config"])
    scheme = qcfg.config_groups["group_0"]
    state = load_file(str(out_dir / "model.safetensors"))
    out = {}
    for name in state:
        if name.endswith(".weight_scale"):
            module = name[: -len(".weight_scale")]
            sd = {"weight": state[module + ".weight"], "weight_scale": state[name]}
            out[module] = FloatQuantizationCompressor.decompress(sd, scheme)["weight"]
    return out


def ct_quantize_weight(weight: torch.Tensor):
    """One BF16 weight [N, K] through the library: (fp8 [N, K], BF16 scale [N, 1])."""
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    scale, _ = calculate_qparams(weight.amin(1, keepdim=True), weight.amax(1, keepdim=True),
                                 scheme.weights)
    out = FloatQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    return out["weight"], out["weight_scale"]
