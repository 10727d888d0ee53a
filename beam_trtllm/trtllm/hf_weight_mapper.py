"""TRT-LLM's "HF" weight mapper for Beam, registered for the `BeamForCausalLM` architecture.

Thin on purpose: every transform is a pure function of `weight_mapper.py` (tested without
TRT-LLM); this class only plugs them into TRT-LLM's `BaseWeightMapper` hooks. Imported by
`modeling_beam`; needs TensorRT-LLM.
"""

from __future__ import annotations

from .errors import TRTLLM_HINT, require

require("tensorrt_llm", "beam_trtllm.trtllm.hf_weight_mapper", TRTLLM_HINT)

from tensorrt_llm._torch.models.checkpoints.hf.weight_mapper import HfWeightMapper  # noqa: E402
from tensorrt_llm._torch.models.modeling_utils import register_mapper  # noqa: E402
from tensorrt_llm._torch.modules.fused_moe import MoE  # noqa: E402
from torch import nn  # noqa: E402

from .weight_mapper import (ATTN_GATE, duplicate_kv_part, merge_gate_into_q,  # noqa: E402
                            rename_expert_weights)


@register_mapper("HF", "BeamForCausalLM")
class BeamHfWeightMapper(HfWeightMapper):
    """HfWeightMapper's q/k/v and gate/up fusion, plus Beam's output gate in the q part,
    expert renames and KV duplication.

    The KV duplication replaces TRT-LLM's `_duplicate_kv_weights` callback: the same head
    layout, but it also duplicates head-row scales of any format (FP8 per-channel or block
    scales as well as NVFP4's block scale), where TRT-LLM's only handles NVFP4's."""

    def __init__(self):
        super().__init__()
        self._callbacks = [self._beam_duplicate_kv]

    def _beam_duplicate_kv(self, module: nn.Module, new_name: str, weights: dict) -> dict:
        return duplicate_kv_part(new_name, _tensors(weights), self._num_kv_heads, self._tp_size)

    def apply_callbacks(self, module: nn.Module, module_name: str,
                        module_names_breakdown: list[str], weights: dict) -> list[dict]:
        parts = super().apply_callbacks(module, module_name, module_names_breakdown, weights)
        if module_name != "qkv_proj":
            return parts
        # module_names_breakdown ends with "self_attn": this is the attention's output gate,
        # never a dense MLP's mlp.gate_proj.
        gate_prefix = ".".join(module_names_breakdown + [ATTN_GATE])
        gate = _tensors(self.filter_weights(gate_prefix, weights))
        where = ".".join(module_names_breakdown + [module_name])
        parts[0] = merge_gate_into_q(_tensors(parts[0]), gate,
                                     self.model.config.num_attention_heads, where)
        return parts

    def is_special_instance_module(self, module: nn.Module) -> bool:
        return isinstance(module, MoE)

    def handle_special_instance_module(self, module: nn.Module, module_name: str,
                                       module_weights: dict,
                                       allow_partial_loading: bool = False) -> None:
        extra = {"allow_partial_loading": True} if allow_partial_loading else {}
        module.load_weights(weights=[rename_expert_weights(module_weights)], **extra)


def _tensors(weights: dict) -> dict:
    """Tensors of a weights dict (a lazy safetensors slice becomes a tensor with `[:]`)."""
    return {k: v[:] for k, v in weights.items()}
