"""transformers' `BeamForCausalLM`, the canonical Beam, as beam-trt uses it: the numerics oracle
of the tests, the CPU path of `beam-trt generate` for a checkpoint dir, and the model behind
`beam-trt verify`'s logits check (docs/DESIGN.md "The oracle").

beam-trt keeps no hand-written copy of the whole model: transformers' implementation is the one
published with the checkpoint, and vLLM and SGLang agree with it. This module only builds it
(from a checkpoint dir or an in-memory state dict with beam-trt's per-expert names) and streams
tokens from it with the sampling rules of `beam-trt generate`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import torch

from .checkpoint import load_state_dict
from .config import BeamConfig

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def hf_config(cfg: BeamConfig, attn_implementation: str = "eager"):
    """transformers' BeamConfig of `cfg` (every canonical field; unknown fields left out)."""
    from transformers import BeamConfig as HFBeamConfig

    skip = {"architectures", "model_type", "dtype", *cfg.unknown_fields}
    fields = {k: v for k, v in cfg.to_hf().items() if k not in skip}
    hf = HFBeamConfig(**fields)
    hf._attn_implementation = attn_implementation
    return hf


def fuse_experts(state: dict[str, torch.Tensor], cfg: BeamConfig) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> transformers' in-memory fused `mlp.experts.gate_up_proj` [E, 2I, H]
    (gate rows first) and `mlp.experts.down_proj` [E, H, I]; other tensors unchanged."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in state.items():
        m = _EXPERT.match(name)
        if m:
            parts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[name] = t
    for prefix, by in parts.items():
        experts = range(cfg.num_experts)
        out[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([by[(e, "gate")], by[(e, "up")]]) for e in experts])
        out[prefix + ".down_proj"] = torch.stack([by[(e, "down")] for e in experts])
    return out


def model_from_state_dict(cfg: BeamConfig, state: dict[str, torch.Tensor],
                          dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"):
    """transformers' BeamForCausalLM in `dtype` (router FP32, as transformers keeps it) holding
    `state` (beam-trt's per-expert names). Every parameter and buffer must be given."""
    from transformers import BeamForCausalLM

    with torch.device("meta"):
        model = BeamForCausalLM(hf_config(cfg, attn_implementation))
    fused = fuse_experts(state, cfg)
    cast = {k: v.to(torch.float32 if ".mlp.gate." in k else dtype) for k, v in fused.items()}
    model.load_state_dict(cast, strict=False, assign=True)
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()]
               if p.is_meta and "rotary_emb" not in n]
    if missing:
        raise ValueError(f"state dict lacks {missing[0]} (and {len(missing) - 1} more)")
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)  # its buffers, off meta
    return model.eval().requires_grad_(False)


def load_model(ckpt_dir: str | Path, dtype: torch.dtype = torch.float32,
               attn_implementation: str = "eager"):
    """The canonical model of an unquantized checkpoint dir, validated by beam-trt first (so a
    bad checkpoint gets beam-trt's error naming the tensor, not a load report)."""
    cfg = BeamConfig.from_hf(ckpt_dir)
    return model_from_state_dict(cfg, load_state_dict(ckpt_dir, cfg), dtype, attn_implementation)


@torch.inference_mode()
def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [B, T] -> FP32 logits [B, T, V] (softcapped, as the model returns them)."""
    return model(input_ids=input_ids, use_cache=False).logits.float()


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] FP32 -> token ids [B]. temperature 0 is greedy (argmax); top-p keeps the
    token that crosses top_p (the engine's sampler follows the same rule)."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.inference_mode()
def stream(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
           eos_token_id: list[int] | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token ids [B] one step at a time, with transformers' KV cache (stops
    when every row has produced an EOS id)."""
    from transformers import DynamicCache

    eos = set(eos_token_id or [])
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    cache = DynamicCache(config=model.config)
    feed = input_ids
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        out = model(input_ids=feed, cache=cache, use_cache=True)
        token = sample(out.logits[:, -1].float(), temperature, top_k, top_p, gen)
        yield token
        feed = token[:, None]
        done |= torch.tensor([t in eos for t in token.tolist()])
        if bool(done.all()):
            return
