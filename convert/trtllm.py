"""config.json of the `trtllm` layout: TRT-LLM's PretrainedConfig fields (architecture, dtype,
mapping, quantization, moe) on top of every Beam field of the HF config, so the directory also
carries the facts `BeamConfig.from_hf` needs; `hidden_act` therefore stays the HF "silu" that
BeamConfig requires, not the legacy TRT-LLM checkpoint's "swiglu". Tensor names inside
`rank{r}.safetensors` are the HF names (TRT-LLM has no Beam model class whose legacy names
could be followed, and its legacy TensorRT path is removed upstream:
shared/research/trtllm.md §3.1)."""

from __future__ import annotations

from beam_trtllm.config import BeamConfig

from .shard import Mapping

# tensorrt_llm.layers.moe.ExpertScaleNormalizationMode.DEVICE_LIMITED_RENORM: group-limited
# routing, then renormalised top-k weights (Beam's norm_topk_prob).
DEVICE_LIMITED_RENORM = 4


def trtllm_config(hf_config: dict, cfg: BeamConfig, hf_quant: dict, mapping: Mapping) -> dict:
    out = dict(hf_config)
    out.update({
        "architecture": "BeamForCausalLM",
        "dtype": "bfloat16",
        "logits_dtype": "float32",
        "head_size": cfg.head_dim,
        "norm_epsilon": cfg.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": cfg.rope_theta,
        "use_parallel_embedding": False,
        "mapping": mapping.to_json(),
        "quantization": dict(hf_quant["quantization"]),
        "moe": {"num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
                "normalization_mode": DEVICE_LIMITED_RENORM, "shared_expert_intermediate_size": 0,
                "device_limited_n_group": cfg.n_group, "device_limited_topk_group": cfg.topk_group,
                "device_limited_routed_scaling_factor": cfg.routed_scaling_factor},
    })
    return out
