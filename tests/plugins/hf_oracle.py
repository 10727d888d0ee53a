"""transformers' canonical Beam modules (`transformers.models.beam.modeling_beam`) built for
the plugin tests: the oracle the ops' references are checked against. Weights are seeded at
the scales of a trained layer (projections N(0, 1/fan_in), norm weights 1 + 0.1 N, a nonzero
gate_bias and e_score_correction_bias), in the model dtype (the router FP32, as transformers
keeps it).

transformers is imported when a test asks for it (`modeling()`): a test that needs the oracle
is skipped where the installed transformers has no `beam` model (the H200 image's 5.17), and
the kernel tests in the same files still run there."""

from __future__ import annotations

import contextlib

import pytest
import torch

from beam_trtllm.config import FULL, SLIDING, BeamConfig
from beam_trtllm.hf_model import hf_config


def modeling():
    """transformers.models.beam.modeling_beam, or the calling test skipped without it."""
    return pytest.importorskip("transformers.models.beam.modeling_beam",
                               reason="transformers >= 5.24 (the canonical Beam) is the oracle")


def _init_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Seeded weights of one transformers Beam module (in place), by parameter role."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name or "layernorm" in name:
                value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif leaf == "gate_bias":
                value = 0.5 * torch.randn(p.shape, generator=gen)
            else:  # [..., out, in] projections (the experts' fused tensors too)
                value = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
            p.copy_(value.to(p.dtype))
        for name, buf in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))


def attention(cfg: BeamConfig, layer: int, dtype=torch.float32, seed: int = 0):
    """transformers' BeamAttention of `layer` (eager attention), seeded weights in `dtype`."""
    attn = modeling().BeamAttention(hf_config(cfg), layer).to(dtype)
    _init_(attn, torch.Generator().manual_seed(seed))
    return attn.eval().requires_grad_(False)


def moe(cfg: BeamConfig, dtype=torch.float32, seed: int = 0):
    """transformers' BeamMoE, experts in `dtype`, the router FP32."""
    block = modeling().BeamMoE(hf_config(cfg))
    block.experts.to(dtype)
    _init_(block, torch.Generator().manual_seed(seed))
    return block.eval().requires_grad_(False)


def decoder_layer(cfg: BeamConfig, layer: int, dtype=torch.float32, seed: int = 0):
    block = modeling().BeamDecoderLayer(hf_config(cfg), layer).to(dtype)
    _init_(block, torch.Generator().manual_seed(seed))
    if cfg.mlp_layer_types[layer] == "sparse":
        block.mlp.gate.float()
    return block.eval().requires_grad_(False)


def position_inputs(cfg: BeamConfig, layer: int, x: torch.Tensor, positions: torch.Tensor):
    """(position_embeddings, attention_scaling) of `layer` as BeamModel.forward makes them:
    RoPE cos/sin on sliding layers, the SSMax scale on full ones. positions [B, T]."""
    mb = modeling()
    if cfg.is_full(layer):
        return None, mb.compute_attention_scaling(positions)
    return mb.BeamRotaryEmbedding(hf_config(cfg))(x, positions, SLIDING), None


def mask(cfg: BeamConfig, layer: int, x: torch.Tensor, positions: torch.Tensor,
         and_mask_function=None) -> torch.Tensor:
    """BeamModel's eager attention mask of `layer` (causal, sliding on sliding layers) for x
    [B, T, H] at positions [B, T], optionally narrowed by `and_mask_function(b, h, q, kv)`."""
    from transformers import masking_utils

    make = masking_utils.create_causal_mask if cfg.layer_types[layer] == FULL else \
        masking_utils.create_sliding_window_causal_mask
    return make(config=hf_config(cfg), inputs_embeds=x, attention_mask=None, cache=None,
                position_ids=positions, and_mask_function=and_mask_function)


def attention_forward(cfg: BeamConfig, attn, x: torch.Tensor, positions: torch.Tensor,
                      and_mask_function=None) -> torch.Tensor:
    """BeamAttention.forward of x [B, T, H] at positions [B, T], no cache -> [B, T, H]."""
    pe, scaling = position_inputs(cfg, attn.layer_idx, x, positions)
    m = mask(cfg, attn.layer_idx, x, positions, and_mask_function)
    return attn(x, position_embeddings=pe, attention_mask=m, attention_scaling=scaling)[0]


@contextlib.contextmanager
def _captured_attention():
    """Within the block BeamAttention's eager attention records (query, key, value) [B, heads,
    T, D] and returns ones, so that the gated output o_proj receives is sigmoid(gate) itself."""
    seen, mb = {}, modeling()
    original = mb.eager_attention_forward

    def capture(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        seen.update(q=query, k=key, v=value)
        ones = torch.ones_like(query).transpose(1, 2)  # [B, T, Hq, D], as the real one returns
        return ones, None

    mb.eager_attention_forward = capture
    try:
        yield seen
    finally:
        mb.eager_attention_forward = original


def projections(cfg: BeamConfig, attn, x: torch.Tensor, positions: torch.Tensor):
    """What BeamAttention.forward computes before its attention, from its own forward: q
    (normed, RoPE'd or SSMax-scaled) [B, T, Hq, D], k [B, T, Hkv, D] (as cached), v, and the
    output gate sigmoid(gate_proj(x) + gate_bias) [B, T, Hq, D], in the model dtype."""
    pe, scaling = position_inputs(cfg, attn.layer_idx, x, positions)
    gated = {}
    hook = attn.o_proj.register_forward_pre_hook(lambda mod, args: gated.update(g=args[0]))
    try:
        with _captured_attention() as seen:
            attn(x, position_embeddings=pe, attention_mask=None, attention_scaling=scaling)
    finally:
        hook.remove()
    b, t = x.shape[:2]
    gate = gated["g"].view(b, t, -1, attn.head_dim)
    return (seen["q"].transpose(1, 2), seen["k"].transpose(1, 2), seen["v"].transpose(1, 2),
            gate)


def packed_projection(attn, x: torch.Tensor) -> torch.Tensor:
    """qkvg = [q_proj(x) | k_proj(x) | v_proj(x) | gate_proj(x)], each the module's own GEMM
    (so beam::qk_prep gets exactly the values BeamAttention normalises)."""
    return torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.gate_proj(x)], -1)
