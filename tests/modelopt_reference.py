"""ModelOpt 0.47's own flow on the tiny reference model: the oracle for `beam-trt convert`.

`mtq.quantize` (max calibration) + `export_hf_checkpoint` need a model with `config`,
`device` and `save_pretrained` (shared/research/modelopt.md §2.1): `ShimBeam` adds them to
the reference model. Two more shims make ModelOpt see Beam as it sees HF models:
- the router gets `top_k` / `num_experts`, so ModelOpt registers the MoE block and syncs the
  experts' input amax over the layer (its `layer_sync_moe_local_experts_amax`);
- `BeamAttention` is registered with ModelOpt's `QuantModuleRegistry` as a QuantModule that
  owns `k_bmm_quantizer` / `v_bmm_quantizer` (as its HF `_QuantAttention` does) and feeds them
  the reference's `kv_observer` tensors, so FP8_KV_CFG calibrates K/V amax and the exporter
  writes `k_proj.k_scale` / `v_proj.v_scale`. (`register_attention_for_kv_quant` rewrites
  matmul/SDPA calls; the reference attention uses einsum, so it does not apply.)
NVFP4 fake quantization has no CPU path (modelopt.md §1); max calibration and the export do
not need it, so nothing here runs it.
"""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

from beam_trtllm.config import BeamConfig
from beam_trtllm.reference import BeamForCausalLM


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
    if recipe == "nvfp4":  # attention projections in FP8, everything else NVFP4
        fp8 = {"num_bits": (4, 3), "axis": None}
        for q in ("weight_quantizer", "input_quantizer"):
            entries.append({"quantizer_name": f"*self_attn.[qkvo]_proj.{q}", "cfg": dict(fp8)})
    entries.append({"quantizer_name": "*g_proj*", "enable": False})
    if weight_only:
        entries.append({"quantizer_name": "*input_quantizer", "enable": False})
    if kv_fp8:
        entries.extend(copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"]))
    return cfg


class ShimBeam(BeamForCausalLM):
    """The reference model plus what `export_hf_checkpoint` needs from an HF model."""

    beam_config: BeamConfig

    @property
    def device(self):
        return next(self.parameters()).device

    def save_pretrained(self, export_dir, state_dict=None, **_kw):
        out = Path(export_dir)
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(self.beam_config.to_hf(), indent=2))


def _register_attention() -> None:
    from modelopt.torch.quantization.nn import QuantModule, QuantModuleRegistry, TensorQuantizer

    from beam_trtllm.reference import BeamAttention

    if QuantModuleRegistry.get(BeamAttention) is not None:
        return

    @QuantModuleRegistry.register({BeamAttention: "beam.BeamAttention"})
    class _QuantBeamAttention(QuantModule):
        def _setup(self):
            self.k_bmm_quantizer = TensorQuantizer()
            self.v_bmm_quantizer = TensorQuantizer()
            self.kv_observer = self._observe_kv

        def _observe_kv(self, k, v):
            self.k_bmm_quantizer(k)
            self.v_bmm_quantizer(v)


def build_shim(ckpt_dir: Path) -> ShimBeam:
    from beam_trtllm.checkpoint import load_state_dict

    _register_attention()
    cfg = BeamConfig.from_hf(ckpt_dir)
    model = ShimBeam.from_state_dict(cfg, load_state_dict(ckpt_dir, cfg), dtype=torch.bfloat16)
    model.beam_config = cfg
    model.config = types.SimpleNamespace(
        torch_dtype=torch.bfloat16, model_type="beam", architectures=["BeamForCausalLM"],
        tie_word_embeddings=False,
    )
    for layer in model.model.layers:
        if cfg.is_moe(layer.layer_idx):
            layer.mlp.gate.top_k = cfg.num_experts_per_tok
            layer.mlp.gate.num_experts = cfg.n_routed_experts
    return model


def modelopt_export(ckpt_dir: Path, out_dir: Path, recipe: str, kv_fp8: bool, batches) -> Path:
    """Quantize the tiny reference with ModelOpt on `batches` (list of [B, T] ids; None: weights
    only, no forward pass) and export."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model = build_shim(ckpt_dir)

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                m(ids)

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
