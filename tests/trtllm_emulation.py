"""TRT-LLM's Beam data flow in plain torch, for tests/test_trtllm_adapter.py (TensorRT-LLM is not
installable here). What is the adapter's own is called, not copied: the mapped weights
(`weight_mapper.module_loads`), `ops.prep_qkv` / `gated_output` / `swiglu` / `softcap_logits`
and the `beam::` boundary ops. What TRT-LLM would run stands in as:
- its Linears: F.linear on the rows its loader gives a rank (`load_weight_shard`'s rule:
  ceil(n / tp) rows per rank, in order), and a sum over ranks for the row-parallel all-reduce;
- its paged attention kernel: transformers' eager attention function with the Beam mask;
- its fused MoE: a loop over experts, the top-k weights scaled by routed_scaling_factor
  before the FP32 weighted sum (where TRT-LLM's DeepSeek-V3 routing applies it).
The oracle these are compared with is transformers' BeamForCausalLM (`transformers_attention`
runs one of its attention modules with the inputs its model would give it)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.models.beam.modeling_beam import (compute_attention_scaling,
                                                    eager_attention_forward)

import plugins  # noqa: F401  (torch.ops.beam.*)
from beam_trtllm.config import SLIDING, BeamConfig
from beam_trtllm.trtllm.ops import gated_output, prep_qkv, softcap_logits, swiglu
from beam_trtllm.trtllm.weight_mapper import fuse_parts, gate_bias_shard
from plugins._reference import attention_mask, route

_CAPTURE = "beam_trt_capture"
_captured: list[torch.Tensor] = []


def _capturing_eager(module, query, key, value, attention_mask, **kwargs):
    _captured[:] = [query, key, value]
    return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(_CAPTURE, _capturing_eager)


def _additive_mask(positions: torch.Tensor, window: int | None) -> torch.Tensor:
    visible = attention_mask(positions[None], positions[None], window)
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[:, None]


def _flat(heads_first: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] -> [T, H*D]."""
    return heads_first[0].transpose(0, 1).reshape(heads_first.shape[2], -1)


def transformers_attention(hf_model, layer: int, x: torch.Tensor, positions: torch.Tensor):
    """transformers' BeamAttention of `layer` on x [T, H] at `positions` (a chunk with no
    earlier keys) -> (output [T, H], (q, k, v) as its attention function received them,
    flattened to [T, heads*D])."""
    cfg = hf_model.config
    attn = hf_model.model.layers[layer].self_attn
    sliding = cfg.layer_types[layer] == SLIDING
    pos = positions[None]
    rope = hf_model.model.rotary_emb(x[None], pos, SLIDING) if sliding else None
    scaling = None if sliding else compute_attention_scaling(pos)
    mask = _additive_mask(positions, cfg.sliding_window if sliding else None)
    saved, cfg._attn_implementation = cfg._attn_implementation, _CAPTURE
    try:
        with torch.inference_mode():
            out = attn(x[None], rope, mask, attention_scaling=scaling)[0][0]
    finally:
        cfg._attn_implementation = saved
    return out, tuple(_flat(t) for t in _captured)


def _shard(t: torch.Tensor, tp: int, rank: int, dim: int = 0) -> torch.Tensor:
    width = math.ceil(t.shape[dim] / tp)
    return t.narrow(dim, rank * width, min(width, t.shape[dim] - rank * width))


def _attend(q, k, v, positions, heads: int, kv_heads: int, d: int, window):
    """TRT-LLM's attention kernel's place: transformers' eager attention function."""
    t = q.shape[0]
    q, k, v = (a.view(1, t, -1, d).transpose(1, 2) for a in (q, k, v))
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)
    out, _ = eager_attention_forward(module, q, k, v, _additive_mask(positions, window), d**-0.5)
    return out.reshape(t, -1)


def emulated_attention(cfg: BeamConfig, loads, layer: int, x, positions, tp: int):
    """BeamAttention.forward on every TP rank, summed -> (output [T, H], rank 0's q, k, v)."""
    p = f"model.layers.{layer}.self_attn"
    hq, hkv = cfg.num_attention_heads // tp, max(1, cfg.num_key_value_heads // tp)
    window = None if cfg.is_full(layer) else cfg.sliding_window
    dt = x.dtype  # the model dtype: FP32, or BF16 with transformers' rounding points
    qn, kn = (loads[f"{p}.{n}"][0]["weight"].to(dt) for n in ("q_norm", "k_norm"))
    total, first = 0, None
    for r in range(tp):
        w = torch.cat([_shard(part["weight"], tp, r) for part in loads[f"{p}.qkv_proj"]]).to(dt)
        bias = gate_bias_shard(loads[p][0]["gate_bias"], cfg.num_attention_heads, tp, r).to(dt)
        q, k, v, gate = prep_qkv(F.linear(x, w), positions[None], qn, kn, bias, hq, hkv, cfg,
                                 cfg.is_full(layer))
        o = gated_output(_attend(q, k, v, positions, hq, hkv, cfg.head_dim, window), gate)
        total = total + F.linear(o, _shard(loads[f"{p}.o_proj"][0]["weight"], tp, r, 1).to(dt))
        first = first or (q, k, v)
    return total, first


def _moe(cfg: BeamConfig, loads, p: str, x: torch.Tensor) -> torch.Tensor:
    router = loads[p + "mlp.gate"][0]
    ids, weights = route(x, router["weight"], router["e_score_correction_bias"], cfg.n_group,
                         cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    weights = weights * cfg.routed_scaling_factor  # TRT-LLM scales the top-k weights
    experts, out = loads[p + "mlp.experts"][0], torch.zeros(x.shape, dtype=torch.float32)
    for e in ids.unique().tolist():
        tokens, slot = (ids == e).nonzero(as_tuple=True)
        w13 = torch.cat([experts[f"{e}.w1.weight"], experts[f"{e}.w3.weight"]]).float()
        y = F.linear(swiglu(F.linear(x[tokens], w13)), experts[f"{e}.w2.weight"].float())
        out.index_add_(0, tokens, y.float() * weights[tokens, slot, None])
    return out.to(x.dtype)


def _dense(loads, p: str, x: torch.Tensor) -> torch.Tensor:
    gate_up = fuse_parts(loads[p + "mlp.gate_up_proj"], p + "mlp.gate_up_proj")["weight"].float()
    return F.linear(swiglu(F.linear(x, gate_up)), loads[p + "mlp.down_proj"][0]["weight"].float())


def emulated_logits(cfg: BeamConfig, loads, ids: torch.Tensor) -> torch.Tensor:
    """BeamForCausalLM.forward at TP 1 in FP32 on one sequence: ids [T] -> logits [T, V]."""
    def w(module: str) -> torch.Tensor:
        return loads[module][0]["weight"].float()

    eps, positions = cfg.rms_norm_eps, torch.arange(ids.shape[0])
    h = w("model.embed_tokens")[ids]
    x = torch.ops.beam.rmsnorm(h, w("model.layers.0.input_layernorm"), eps)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        last = i == cfg.num_hidden_layers - 1
        nxt = w("model.norm") if last else w(f"model.layers.{i + 1}.input_layernorm")
        y, _ = emulated_attention(cfg, loads, i, x, positions, 1)
        h, x = torch.ops.beam.add_rmsnorm(h, y, w(p + "post_attention_layernorm"),
                                          w(p + "pre_feedforward_layernorm"),
                                          *cfg.residual_coeffs(2 * i), eps)
        y = _moe(cfg, loads, p, x) if cfg.is_moe(i) else _dense(loads, p, x)
        h, x = torch.ops.beam.add_rmsnorm(h, y, w(p + "post_feedforward_layernorm"), nxt,
                                          *cfg.residual_coeffs(2 * i + 1), eps)
    return softcap_logits(F.linear(x, w("lm_head")), cfg.final_logit_softcapping)
