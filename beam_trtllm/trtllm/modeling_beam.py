"""Beam for TensorRT-LLM's PyTorch backend: `BeamForCausalLM`, registered on import.

The model is transformers' `BeamForCausalLM` (shared/BEAM_SPEC.md), on TRT-LLM's paged VSWA
attention and fused MoE. Importing this module needs TensorRT-LLM (and Triton, for the
`beam::` ops); without it the import fails at once with one MissingPackageError naming it.
Written against the TRT-LLM 1.2 / 1.3 PyTorch-backend API (docs/TRTLLM.md lists the files and
what could not be verified here).

Data flow of one decoder layer i, with x the normed input of the next sublayer and h the
stream (a_k, b_k from BeamConfig.residual_coeffs, k = 2i attention, 2i + 1 FFN):

    y     = self_attn(x)                                  TRT-LLM paged (VSWA) attention
    h, x  = beam::add_rmsnorm(h, y, w_post_attn, w_pre_ffn, a_2i, b_2i, eps)
    y     = mlp(x)                                        SwiGLU MLP, or FP32 router + fused MoE
    h, x  = beam::add_rmsnorm(h, y, w_post_ffn, w_next_pre, a_2i+1, b_2i+1, eps)

`add_rmsnorm` is post-norm, h' = rnd(rnd(b * y_n) + rnd(a * h)) and the next pre-norm in one
pass, with transformers' rounding points; TRT-LLM's fused residual RMSNorm adds with unit
coefficients and cannot express it. The last boundary's next pre-norm is the final norm; the
logits are softcapped in FP32 (`final_logit_softcapping`).
"""

from __future__ import annotations

from .errors import TRTLLM_HINT, TrtllmAdapterError, require

require("tensorrt_llm", "beam_trtllm.trtllm.modeling_beam", TRTLLM_HINT)

# TensorRT-LLM imports come after the check above, on purpose (a clear error instead of a
# traceback from deep inside an import chain).
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tensorrt_llm._torch.attention_backend import AttentionMetadata  # noqa: E402
from tensorrt_llm._torch.attention_backend.interface import PredefinedAttentionMask  # noqa: E402
from tensorrt_llm._torch.distributed import AllReduce  # noqa: E402
from tensorrt_llm._torch.model_config import ModelConfig  # noqa: E402
from tensorrt_llm._torch.models.modeling_deepseekv3 import DeepseekV3Gate  # noqa: E402
from tensorrt_llm._torch.models.modeling_utils import (  # noqa: E402
    DecoderModel, DecoderModelForCausalLM, register_auto_model)
from tensorrt_llm._torch.modules.decoder_layer import DecoderLayer  # noqa: E402
from tensorrt_llm._torch.modules.embedding import Embedding  # noqa: E402
from tensorrt_llm._torch.modules.fused_moe import create_moe  # noqa: E402
from tensorrt_llm._torch.modules.gated_mlp import GatedMLP  # noqa: E402
from tensorrt_llm._torch.modules.linear import TensorParallelMode  # noqa: E402
from tensorrt_llm._torch.modules.qk_norm_attention import QKNormRoPEAttention  # noqa: E402
from tensorrt_llm._torch.modules.rms_norm import RMSNorm  # noqa: E402
from tensorrt_llm._torch.utils import AuxStreamType  # noqa: E402
from torch import nn  # noqa: E402
from transformers import PretrainedConfig  # noqa: E402

import plugins  # noqa: E402,F401  (registers torch.ops.beam.*)

from . import hf_weight_mapper  # noqa: E402  (registers the "HF" mapper for Beam)
from .configuration_beam import beam_config, register_hf_config  # noqa: E402
from .ops import gated_output, prep_qkv, softcap_logits, swiglu  # noqa: E402
from .weight_mapper import gate_bias_shard, plan_weights  # noqa: E402

register_hf_config()  # transformers' own "beam" config if it has one; never replaced


class BeamAttention(QKNormRoPEAttention):
    """GQA with per-head Q/K RMSNorm, NeoX RoPE on sliding layers (window passed per call, so
    TRT-LLM's VSWA cache keeps only the window), the SSMax query scale on full (NoPE) layers,
    and the element-wise sigmoid output gate with a bias per head.

    `attn_output_gate=True`: TRT-LLM's fused `qkv_proj` holds q, k, v and the output gate
    (self_attn.gate_proj), one GEMM, the gate rows interleaved per head into the q part
    (weight_mapper.merge_gate_into_q), so TP splits the gate by heads like q. No TRT-LLM
    positional embedding on either layer kind (`pos_embd_params=None`, `skip_rope=True`):
    `beam::qk_prep` does norms, RoPE or SSMax and the gate (with `gate_bias`, this rank's
    heads) as transformers rounds them. With the gate, TRT-LLM's attention never emits an
    FP8/NVFP4 output pre-scaled for o_proj (`_use_quantize_output` is False)."""

    def __init__(self, model_config: ModelConfig[PretrainedConfig], layer_idx: int):
        pc = model_config.pretrained_config
        self.beam = cfg = beam_config(pc)
        self.is_full = cfg.is_full(layer_idx)
        self.attention_window_size = None if self.is_full else cfg.sliding_window
        super().__init__(
            hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            max_position_embeddings=cfg.max_position_embeddings, bias=False,
            pos_embd_params=None, skip_rope=True, fuse_qk_norm_rope=False, layer_idx=layer_idx,
            dtype=pc.torch_dtype, dense_bias=False, config=model_config,
            attn_output_gate=True, rope_fusion=False)
        # This rank's heads' biases (self.num_heads is the per-rank count after __init__).
        self.gate_bias = nn.Parameter(torch.zeros(self.num_heads, dtype=pc.torch_dtype),
                                      requires_grad=False)

    def _use_quantize_output(self) -> bool:
        # The gate multiplies the attention output before o_proj, so the attention kernel must
        # not emit an FP8/NVFP4 tensor pre-scaled for o_proj: o_proj quantizes its own input.
        return False

    def load_weights(self, weights: list[dict], **kwargs: Any) -> None:
        """TRT-LLM's loader hands this module every `self_attn.*` tensor (its sub-Linears and
        norms load their own); it takes `gate_bias`, this rank's heads."""
        bias = weights[0].get("gate_bias")
        if bias is None:
            if kwargs.get("allow_partial_loading"):
                return
            raise TrtllmAdapterError(f"layer {self.layer_idx}: no self_attn.gate_bias tensor")
        shard = gate_bias_shard(bias[:], self.num_heads * self.tp_size, self.tp_size, self.tp_rank)
        self.gate_bias.data.copy_(shard.to(self.gate_bias.dtype))

    def apply_rope(self, q, k, v, position_ids):
        raise TrtllmAdapterError("BeamAttention.apply_rope: Beam's norms, RoPE/SSMax and gate "
                                 "run in BeamAttention.forward (beam::qk_prep)")

    def forward(self, position_ids: Optional[torch.IntTensor], hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata,
                attention_mask=PredefinedAttentionMask.CAUSAL, all_reduce_params=None,
                lora_params: Optional[dict] = None, **kwargs: Any) -> torch.Tensor:
        if lora_params:
            raise TrtllmAdapterError("LoRA is not supported by the Beam TRT-LLM model")
        q, k, v, gate = prep_qkv(self.qkv_proj(hidden_states), position_ids, self.q_norm.weight,
                                 self.k_norm.weight, self.gate_bias, self.num_heads,
                                 self.num_key_value_heads, self.beam, self.is_full)
        q, k, v = self.convert_qkv(q, k, v)
        attn = self.forward_impl(q, k, v, attn_metadata, attention_mask,
                                 self.attention_window_size, None, mrope_config=None)
        return self.o_proj(gated_output(attn, gate), all_reduce_params=all_reduce_params,
                           layer_idx=self.layer_idx)


class BeamMLP(GatedMLP):
    """A dense layer's SwiGLU: TRT-LLM's fused gate_up_proj and down_proj, with the activation
    in FP32 and one rounding (transformers' BeamMLP) instead of GatedMLP's fused kernel."""

    def forward(self, x: torch.Tensor, all_rank_num_tokens=None, final_all_reduce_params=None,
                lora_params: Optional[dict] = None, **kwargs: Any) -> torch.Tensor:
        if lora_params:
            raise TrtllmAdapterError("LoRA is not supported by the Beam TRT-LLM model")
        return self.down_proj(swiglu(self.gate_up_proj(x)),
                              all_reduce_params=final_all_reduce_params)


class BeamGate(DeepseekV3Gate):
    """DeepSeek-V3 group router with an FP32 weight and bias, logits computed in FP32.

    TRT-LLM's routing (sigmoid, +bias for selection, top-2 sum per group, top topk_group
    groups, top-k, renormalised unbiased weights) is Beam's router. It multiplies the top-k
    weights by routed_scaling_factor before the experts' FP32 weighted sum, which is
    transformers' scale of the summed output up to FP32 reassociation (one rounding either
    way). Only the logits GEMM is replaced: TRT-LLM's dsv3_router_gemm_op takes BF16
    activations, and Beam upcasts x and keeps W in FP32."""

    def __init__(self, model_config: ModelConfig[PretrainedConfig]):
        cfg = beam_config(model_config.pretrained_config)
        if model_config.moe_backend.upper() == "TRTLLM":
            raise TrtllmAdapterError(
                "moe_backend TRTLLM stores the router bias in BF16; Beam's router is FP32 "
                "(use moe_config.backend CUTLASS, CUTEDSL or DEEPGEMM)")
        if not cfg.norm_topk_prob:
            raise TrtllmAdapterError("norm_topk_prob false: TRT-LLM's DeepSeek-V3 routing "
                                     "always renormalises the top-k weights")
        super().__init__(cfg.hidden_size, cfg.num_experts, top_k=cfg.num_experts_per_tok,
                         n_group=cfg.n_group, topk_group=cfg.topk_group,
                         routed_scaling_factor=cfg.routed_scaling_factor, dtype=torch.float32,
                         fuse_routing_kernel=True, apply_routing=False,
                         moe_backend=model_config.moe_backend)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states.float(), self.weight.float())


class BeamMoE(nn.Module):
    """Routed experts only: no shared expert (so not Deepseekv3MoE, which always builds one)."""

    def __init__(self, model_config: ModelConfig[PretrainedConfig], layer_idx: int,
                 aux_stream_dict):
        super().__init__()
        cfg = beam_config(model_config.pretrained_config)
        self.gate = BeamGate(model_config)
        self.experts = create_moe(
            routing_method=self.gate.routing_method, num_experts=cfg.num_experts,
            hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size,
            dtype=model_config.pretrained_config.torch_dtype, reduce_results=False,
            model_config=model_config, aux_stream_dict=aux_stream_dict, layer_idx=layer_idx)
        mapping = model_config.mapping
        self.allreduce = None
        if not mapping.enable_attention_dp and mapping.tp_size > 1:
            self.allreduce = AllReduce(mapping=mapping, strategy=model_config.allreduce_strategy)

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        out = self.experts(x, self.gate(x), all_rank_num_tokens=attn_metadata.all_rank_num_tokens,
                           use_dp_padding=False)
        return self.allreduce(out) if self.allreduce is not None else out


class BeamDecoderLayer(DecoderLayer):

    def __init__(self, model_config: ModelConfig[PretrainedConfig], layer_idx: int,
                 aux_stream_dict):
        super().__init__()
        cfg = beam_config(model_config.pretrained_config)
        h, self.eps = cfg.hidden_size, cfg.rms_norm_eps
        dtype = model_config.pretrained_config.torch_dtype
        self.attn_coeffs = cfg.residual_coeffs(2 * layer_idx)
        self.ffn_coeffs = cfg.residual_coeffs(2 * layer_idx + 1)
        self.layer_idx, self.is_moe = layer_idx, cfg.is_moe(layer_idx)
        self.input_layernorm = RMSNorm(hidden_size=h, eps=self.eps, dtype=dtype)
        self.self_attn = BeamAttention(model_config, layer_idx)
        self.post_attention_layernorm = RMSNorm(hidden_size=h, eps=self.eps, dtype=dtype)
        self.pre_feedforward_layernorm = RMSNorm(hidden_size=h, eps=self.eps, dtype=dtype)
        if self.is_moe:
            self.mlp = BeamMoE(model_config, layer_idx, aux_stream_dict)
        else:
            self.mlp = BeamMLP(hidden_size=h, intermediate_size=cfg.intermediate_size, bias=False,
                               dtype=dtype, config=model_config, layer_idx=layer_idx)
        self.post_feedforward_layernorm = RMSNorm(hidden_size=h, eps=self.eps, dtype=dtype)

    def forward(self, position_ids: torch.IntTensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata, residual: Optional[torch.Tensor] = None,
                next_norm_weight: Optional[torch.Tensor] = None, **kwargs: Any):
        """hidden_states: this layer's input_layernorm output; residual: the stream h.
        Returns (the next layer's normed input, or the final-normed output; the new stream)."""
        y = self.self_attn(position_ids=position_ids, hidden_states=hidden_states,
                           attn_metadata=attn_metadata)
        h, x = torch.ops.beam.add_rmsnorm(residual, y, self.post_attention_layernorm.weight,
                                          self.pre_feedforward_layernorm.weight,
                                          *self.attn_coeffs, self.eps)
        y = self.mlp(x, attn_metadata) if self.is_moe else self.mlp(x)
        return torch.ops.beam.add_rmsnorm(h, y, self.post_feedforward_layernorm.weight,
                                          next_norm_weight, *self.ffn_coeffs, self.eps)[::-1]


class BeamModel(DecoderModel):

    def __init__(self, model_config: ModelConfig[PretrainedConfig]):
        super().__init__(model_config)
        cfg = self.beam = beam_config(model_config.pretrained_config)
        dtype = model_config.pretrained_config.torch_dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                      mapping=model_config.mapping,
                                      tensor_parallel_mode=TensorParallelMode.COLUMN,
                                      gather_output=True)
        # One stream per kind the fused-MoE backends may ask for (overlap of chunked MoE etc.).
        aux_streams = {kind: torch.cuda.Stream() for kind in AuxStreamType}
        self.layers = nn.ModuleList(BeamDecoderLayer(model_config, i, aux_streams)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(hidden_size=cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)

    def forward(self, attn_metadata: AttentionMetadata, input_ids: Optional[torch.IntTensor] = None,
                position_ids: Optional[torch.IntTensor] = None,
                inputs_embeds: Optional[torch.FloatTensor] = None, **kwargs: Any) -> torch.Tensor:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x = torch.ops.beam.rmsnorm(h, self.layers[0].input_layernorm.weight, self.beam.rms_norm_eps)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            # The last boundary's "next pre-norm" is the final norm, so x leaves the loop normed.
            nxt = self.norm.weight if i == last else self.layers[i + 1].input_layernorm.weight
            x, h = layer(position_ids=position_ids, hidden_states=x, attn_metadata=attn_metadata,
                         residual=h, next_norm_weight=nxt)
        return x


@register_auto_model("BeamForCausalLM")
class BeamForCausalLM(DecoderModelForCausalLM[BeamModel, PretrainedConfig]):

    def __init__(self, model_config: ModelConfig[PretrainedConfig]):
        cfg = self.beam = beam_config(model_config.pretrained_config)
        super().__init__(BeamModel(model_config), config=model_config,
                         hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """TRT-LLM's lm_head and logits gathering, then the FP32 softcap."""
        logits = super().forward(*args, **kwargs)
        if not isinstance(logits, torch.Tensor):
            raise TrtllmAdapterError(f"BeamForCausalLM.forward: TRT-LLM returned a "
                                     f"{type(logits).__name__}, not the logits tensor the "
                                     "softcap applies to")
        return softcap_logits(logits, self.beam.final_logit_softcapping)

    def load_weights(self, weights, weight_mapper=None, *args: Any, **kwargs: Any):
        # TRT-LLM's loader ignores tensors no module asks for and leaves parameters without a
        # tensor at their init values; check the names first so a renamed or missing tensor is
        # an error naming it (a partial load only checks that every name is a Beam tensor).
        names = weights.keys() if hasattr(weights, "keys") else None
        if names is not None:  # newer layer-wise loaders may hand over a stream instead
            plan_weights(self.beam, names, complete=not kwargs.get("allow_partial_loading", False))
        if weight_mapper is None:  # the legacy path knows no output gate in qkv_proj
            weight_mapper = hf_weight_mapper.BeamHfWeightMapper()
            weight_mapper.init_model_and_config(self, self.model_config)
        return super().load_weights(weights, weight_mapper, *args, **kwargs)
