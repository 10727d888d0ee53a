"""The pieces of the TRT-LLM model that are plain torch + `beam::` ops, kept out of
`modeling_beam` (which needs TensorRT-LLM) so they are tested here against transformers'
`BeamForCausalLM` modules. Each rounds where transformers' Beam rounds
(shared/BEAM_SPEC.md "Forward pass, with the rounding points")."""

from __future__ import annotations

import torch

import plugins  # noqa: F401  (registers torch.ops.beam.*)
from beam_trtllm.config import BeamConfig
from plugins._reference import swiglu as _swiglu


def pack_qkvg(qkv: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """TRT-LLM's gated qkv_proj row `[q_0 g_0 q_1 g_1 ... | k | v]` (q and gate interleaved
    per head: the `attn_output_gate` layout) -> `beam::qk_prep`'s row `[q | k | v | g]`."""
    t, qg = qkv.shape[0], 2 * num_heads * head_dim
    heads = qkv[:, :qg].reshape(t, num_heads, 2, head_dim)
    q, gate = heads[:, :, 0].reshape(t, -1), heads[:, :, 1].reshape(t, -1)
    return torch.cat([q, qkv[:, qg:], gate], dim=1)


def prep_qkv(qkv: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor,
             k_norm_weight: torch.Tensor, gate_bias: torch.Tensor, num_heads: int,
             num_kv_heads: int, cfg: BeamConfig, is_full: bool):
    """One rank's gated qkv_proj output -> 2-D q [T, Hq*D], k, v [T, Hkv*D] and the output
    gate [T, Hq*D]: per-head Q/K RMSNorm, RoPE on q and k (sliding) or the SSMax scale on q
    (full), gate = rnd(sigmoid(rnd(g + gate_bias[h]))).

    One `beam::qk_prep` launch on the repacked row. That op can also write K/V into a cache;
    TRT-LLM owns the cache here, so every slot is -1 and the 1-row stand-in caches are neither
    read nor written."""
    d = cfg.head_dim
    qkvg = pack_qkvg(qkv, num_heads, d)
    t = qkvg.shape[0]
    unused = qkvg.new_empty((1, 1, num_kv_heads, d))
    unit = torch.ones((), dtype=torch.float32, device=qkvg.device)
    slots = torch.full((t,), -1, dtype=torch.int64, device=qkvg.device)
    q, k, v, gate = torch.ops.beam.qk_prep(
        qkvg, positions.reshape(-1)[:t], q_norm_weight, k_norm_weight, gate_bias, unused,
        unused.clone(), slots, unit, unit, is_full, cfg.rms_norm_eps, cfg.rope_theta)
    return q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), gate.reshape(t, -1)


def gated_output(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o * gate per element, one rounding to o's dtype (transformers' `attn_output *
    torch.sigmoid(gate)`, the sigmoid being prep_qkv's). attn may hold fewer rows (TRT-LLM's
    attention returns the real tokens only)."""
    t = attn.shape[0]
    return attn.reshape(t, -1) * gate[:t]


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """A fused [gate | up] GEMM output -> silu(gate) * up in FP32, one rounding (transformers'
    BeamMLP); one TP rank's halves are its own gate and up rows."""
    gate, up = gate_up.chunk(2, dim=-1)
    return _swiglu(gate, up)


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """transformers' final logit softcap: tanh(l / cap) * cap in FP32; None = off (the logits
    in FP32 either way)."""
    logits = logits.float()
    return logits if cap is None else torch.tanh(logits / cap) * cap
