"""ModelOpt 0.47's own flow on transformers' Beam: the oracle for `beam-trt convert`.

`modelopt_export` loads the checkpoint as transformers' `BeamForCausalLM` in BF16 (the default
SDPA attention; ModelOpt switches the fused experts to their eager loop itself), runs
`mtq.quantize` with max calibration on the given batches (with `use_cache=False`, as ModelOpt's
own calibration loop does) and `export_hf_checkpoint`. Nothing is patched: ModelOpt registers
the fused experts (`_QuantFusedExperts`) and the attention's KV quantizers (`_QuantAttention`)
by itself. NVFP4 fake quantization has no CPU path (shared/research/modelopt.md §1); max
calibration and the export do not need it, so nothing here runs it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ATTENTION = "sdpa"  # what from_pretrained picks by default; convert/calibrate.py runs the same


def modelopt_config(recipe: str, kv_fp8: bool, weight_only: bool = False) -> dict:
    """The ModelOpt quant config that matches one of our recipes (weight-only: input quantizers
    off, which turns NVFP4 into ModelOpt's W4A16_NVFP4)."""
    import modelopt.torch.quantization as mtq

    base = {
        "fp8": mtq.FP8_DEFAULT_CFG,
        "fp8-block": mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG,
        "nvfp4": mtq.NVFP4_DEFAULT_CFG,
        "nvfp4-all": mtq.NVFP4_DEFAULT_CFG,
    }[recipe]
    cfg = copy.deepcopy(base)
    entries = cfg["quant_cfg"]
    if recipe == "nvfp4":  # attention projections (output gate included) in FP8, the rest NVFP4
        fp8 = {"num_bits": (4, 3), "axis": None}
        for q in ("weight_quantizer", "input_quantizer"):
            entries.append({"quantizer_name": f"*self_attn.*_proj.{q}", "cfg": dict(fp8)})
    if weight_only:
        entries.append({"quantizer_name": "*input_quantizer", "enable": False})
    if kv_fp8:
        entries.extend(copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"]))
    return cfg


def load_bf16(ckpt_dir: Path):
    from transformers import BeamForCausalLM

    return BeamForCausalLM.from_pretrained(ckpt_dir, dtype=torch.bfloat16,
                                           attn_implementation=ATTENTION).eval()


def modelopt_export(ckpt_dir: Path, out_dir: Path, recipe: str, kv_fp8: bool, batches) -> Path:
    """Quantize the checkpoint with ModelOpt on `batches` (list of [B, T] ids; None: weights
    only, no forward pass) and export."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model = load_bf16(ckpt_dir)

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                m(input_ids=ids, use_cache=False)

    cfg = modelopt_config(recipe, kv_fp8, weight_only=batches is None)
    mtq.quantize(model, cfg, forward_loop if batches is not None else None)
    out_dir.mkdir(parents=True, exist_ok=True)
    export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=str(out_dir))
    return out_dir


# ---------------------------------------------------------------------------- one Linear
_LINEAR_CFG = {"fp8": "FP8_DEFAULT_CFG", "fp8_pb_wo": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",
               "nvfp4": "NVFP4_DEFAULT_CFG"}


def export_linear(weight: torch.Tensor, fmt: str, inputs: list[torch.Tensor] | None = None):
    """ModelOpt's own export of one BF16 Linear: max calibration on `inputs`, then the exporter's
    `_export_quantized_weight`. Returns {weight, weight_scale, weight_scale_2?, input_scale?}."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export.unified_export_hf import _export_quantized_weight

    n, k = weight.shape
    linear = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    linear.weight.data.copy_(weight)
    model = torch.nn.Sequential(linear)
    cfg = copy.deepcopy(getattr(mtq, _LINEAR_CFG[fmt]))

    def forward_loop(m):
        with torch.no_grad():
            for x in inputs or []:
                m(x)

    mtq.quantize(model, cfg, forward_loop if inputs else None)
    _export_quantized_weight(model[0], torch.bfloat16)
    names = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    return {n: getattr(model[0], n).detach() for n in names if hasattr(model[0], n)}
