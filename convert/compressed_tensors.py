"""`--format compressed-tensors`: the checkpoint the compressed-tensors library writes for its
FP8_DYNAMIC scheme (what llm-compressor's `oneshot(scheme="FP8_DYNAMIC")` saves and SGLang /
vLLM load), made through the library itself:

- each quantized Linear's `weight_scale` is the library's `calculate_qparams` on the weight's
  per-row min / max (its min-max observer's inputs) and `weight` is
  `FloatQuantizationCompressor.compress` of it: float8_e4m3fn [N, K] and a scale [N, 1] in the
  model dtype (BF16), per unit, so the stream holds one tensor group at a time;
- config.json's `quantization_config` is the library's `ModelCompressor.update_config` of a
  `QuantizationConfig` with the FP8_DYNAMIC preset on `Linear` targets and `ignore` = the
  Linears the recipe leaves in BF16 (lm_head in the shipped `fp8-dynamic`), status compressed.
Activations are quantized per token at run time: no calibration, no input_scale.
"""

from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from .errors import ConvertError

FORMAT = "fp8_channel"  # the recipe format this layout writes (all others refused)
PRESET = "FP8_DYNAMIC"


@lru_cache(maxsize=1)
def scheme():
    try:
        from compressed_tensors.quantization import preset_name_to_scheme
    except ImportError as exc:  # the `convert` extra
        raise ConvertError("--format compressed-tensors needs the compressed-tensors package "
                           "(pip install 'beam-trt[convert]')") from exc
    return preset_name_to_scheme(PRESET, ["Linear"])


def encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One BF16 weight [N, K] -> (float8_e4m3fn [N, K], weight_scale [N, 1] BF16), by the
    library's own functions."""
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    s = scheme()
    scale, _ = calculate_qparams(weight.amin(1, keepdim=True), weight.amax(1, keepdim=True),
                                 s.weights)
    out = FloatQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, s)
    return out["weight"].contiguous(), out["weight_scale"].contiguous()


def check_formats(formats: dict[str, str]) -> None:
    bad = sorted({f for f in formats.values() if f not in (FORMAT, "none")})
    if bad:
        raise ConvertError(f"--format compressed-tensors writes {PRESET} ({FORMAT}) Linears "
                           f"only; the recipe asks for {', '.join(bad)} (use --format hf)")


def quantization_config(config_json: dict, ignore: list[str]) -> dict:
    """config.json with the `quantization_config` the library writes for this checkpoint."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    # the group's format as ModelCompressor.from_pretrained_model infers it for these modules
    group = scheme().model_copy(update={"format": "float-quantized"})
    qcfg = QuantizationConfig(config_groups={"group_0": group}, ignore=ignore,
                              format="float-quantized",
                              quantization_status=QuantizationStatus.COMPRESSED)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config_json))
        ModelCompressor(quantization_config=qcfg).update_config(tmp)
        return json.loads((Path(tmp) / "config.json").read_text())
