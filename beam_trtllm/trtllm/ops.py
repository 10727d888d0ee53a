"""The attention-side pieces of the TRT-LLM model that are plain torch + `beam::` ops, kept out
of `modeling_beam` (which needs TensorRT-LLM) so they are tested here against the reference."""

from __future__ import annotations

import torch

import plugins  # noqa: F401  (registers torch.ops.beam.*)
from beam_trtllm.config import BeamConfig


def prep_qkv(qkvg: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor,
             k_norm_weight: torch.Tensor, num_kv_heads: int, cfg: BeamConfig, is_full: bool):
    """Per-head Q/K RMSNorm, then RoPE on q and k (sliding) or the SSMax scale on q (full), of
    one rank's packed projection rows `[q | k | v | g]` -> 2-D q [T, Hq*D], k, v [T, Hkv*D].

    One `beam::qk_prep` launch. That op can also write K/V into a cache; TRT-LLM owns the cache
    here, so every slot is -1 and the 1-row stand-in caches are neither read nor written."""
    t, d = qkvg.shape[0], cfg.head_dim
    unused = qkvg.new_empty((1, 1, num_kv_heads, d))
    unit = torch.ones((), dtype=torch.float32, device=qkvg.device)
    slots = torch.full((t,), -1, dtype=torch.int64, device=qkvg.device)
    q, k, v, _ = torch.ops.beam.qk_prep(
        qkvg, positions.reshape(-1)[:t], q_norm_weight, k_norm_weight, unused, unused.clone(),
        slots, unit, unit, is_full, cfg.rms_norm_eps, cfg.rope_theta, cfg.ssmax_base,
        cfg.ssmax_exponent)
    return q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)


def apply_head_gate(attn: torch.Tensor, gate_logits: torch.Tensor, num_heads: int) -> torch.Tensor:
    """o_h * sigmoid(g_h): one FP32 sigmoid scalar per head and token, before o_proj."""
    t = attn.shape[0]
    gate = torch.sigmoid(gate_logits[:t].float())
    return (attn.view(t, num_heads, -1).float() * gate[..., None]).to(attn.dtype).view(t, -1)
