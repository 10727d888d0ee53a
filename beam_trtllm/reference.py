"""Plain-PyTorch Beam: the numerics oracle every fast path is tested against.

Follows ``shared/BEAM_SPEC.md`` line by line. Norms, softmax, sigmoid, RoPE, SSMax and the
router run in FP32; matmuls run in the model dtype. No kernels, no parallelism, no fusion.
Parameter names are the Hugging Face checkpoint names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .config import BeamConfig

ROUTER_DTYPE = torch.float32


# ---------------------------------------------------------------------------- primitives
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w in FP32, cast back to x.dtype (no `1 + w`)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin of shape [..., head_dim] (FP32) for rotate-half (NeoX) RoPE over all dims."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = theta ** (-exponents / head_dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq  # float64: exact at 1M positions
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [B, T, heads, D]; positions: [B, T]. Rotate-half form, computed in FP32."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def ssmax_scale(positions: torch.Tensor, base: float, exponent: float) -> torch.Tensor:
    """SSMax query scale (1 + p / base) ** exponent in FP32, same shape as positions."""
    return (1.0 + positions.to(torch.float64) / base).pow(exponent).float()


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [B, Tq, Tk]: key j visible to query p iff j <= p and (window: p - j < window)."""
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    visible = diff >= 0
    if window is not None:
        visible &= diff < window
    return visible


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cfg: BeamConfig):
    """DeepSeek-V3 group routing, all FP32. x: [N, H] -> (ids int64 [N, k], weights fp32 [N, k])."""
    scores = torch.sigmoid(x.to(ROUTER_DTYPE) @ weight.to(ROUTER_DTYPE).t())  # [N, E]
    biased = scores + bias.to(ROUTER_DTYPE)
    n = x.shape[0]
    grouped = biased.view(n, cfg.n_group, cfg.experts_per_group)
    group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [N, n_group]
    kept_groups = group_score.topk(cfg.topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(n, -1)
    candidates = biased.masked_fill(~expert_mask, float("-inf"))
    ids = candidates.topk(cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights * cfg.routed_scaling_factor


def residual_add(h: torch.Tensor, y: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """Depth-scaled residual h = a*h + b*y, in FP32, cast back to h.dtype."""
    return (a * h.float() + b * y.float()).to(h.dtype)


# ---------------------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@dataclass
class LayerKV:
    """One layer's cache for `generate`: K/V after norm (+RoPE) and their absolute positions."""

    k: torch.Tensor | None = None  # [B, S, kv_heads, D]
    v: torch.Tensor | None = None
    pos: torch.Tensor | None = None  # [B, S]
    keep_last: int | None = None  # sliding layers keep only the last `sliding_window` keys

    def append(self, k, v, pos):
        if self.k is None:
            self.k, self.v, self.pos = k, v, pos
        else:
            self.k = torch.cat([self.k, k], 1)
            self.v = torch.cat([self.v, v], 1)
            self.pos = torch.cat([self.pos, pos], 1)
        return self.k, self.v, self.pos

    def trim(self):
        if self.keep_last is not None and self.k is not None and self.k.shape[1] > self.keep_last:
            self.k, self.v = self.k[:, -self.keep_last :], self.v[:, -self.keep_last :]
            self.pos = self.pos[:, -self.keep_last :]


@dataclass
class KVCache:
    layers: list[LayerKV] = field(default_factory=list)
    length: int = 0

    @classmethod
    def empty(cls, cfg: BeamConfig) -> "KVCache":
        keep = [None if cfg.is_full(i) else cfg.sliding_window for i in range(cfg.num_hidden_layers)]
        return cls([LayerKV(keep_last=w) for w in keep])


class BeamAttention(nn.Module):
    def __init__(self, cfg: BeamConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.is_full = cfg.is_full(layer_idx)
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.q_size, bias=False)
        self.k_proj = nn.Linear(h, cfg.kv_size, bias=False)
        self.v_proj = nn.Linear(h, cfg.kv_size, bias=False)
        self.g_proj = nn.Linear(h, cfg.num_attention_heads, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        # Called with (k, v) as they enter the cache; the converter uses it for k/v_scale.
        self.kv_observer: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, H] -> q [B,T,Hq,D], k/v [B,T,Hkv,D] (normed, RoPE or SSMax), gate fp32 [B,T,Hq]."""
        cfg, (b, t, _) = self.cfg, x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, cfg.num_attention_heads, cfg.head_dim))
        k = self.k_norm(self.k_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim))
        v = self.v_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim)
        gate = torch.sigmoid(self.g_proj(x).float())
        if self.is_full:  # NoPE + SSMax on the queries only
            scale = ssmax_scale(positions, cfg.ssmax_base, cfg.ssmax_exponent)
            q = (q.float() * scale[:, :, None, None]).to(q.dtype)
        else:
            q = apply_rope(q, positions, cfg.rope_theta)
            k = apply_rope(k, positions, cfg.rope_theta)
        return q, k, v, gate

    def forward(self, x, positions, cache: LayerKV | None = None):
        cfg = self.cfg
        q, k, v, gate = self.project(x, positions)
        if self.kv_observer is not None:
            self.kv_observer(k, v)
        k_pos = positions
        if cache is not None:
            k, v, k_pos = cache.append(k, v, positions)
        window = None if self.is_full else cfg.sliding_window
        visible = attention_mask(positions, k_pos, window)  # [B, Tq, Tk]
        rep = cfg.num_queries_per_kv  # query head h reads KV head h // rep
        kf = k.float().repeat_interleave(rep, dim=2)
        vf = v.float().repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) / math.sqrt(cfg.head_dim)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("bhqk,bkhd->bqhd", probs, vf) * gate[..., None]
        if cache is not None:
            cache.trim()
        return self.o_proj(o.to(x.dtype).flatten(2))


class BeamMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); dense layers and each routed expert."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BeamRouter(nn.Module):
    """`mlp.gate`: FP32 weight [E, H] and FP32 e_score_correction_bias [E]."""

    def __init__(self, cfg: BeamConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(self, x):
        return route(x, self.weight, self.e_score_correction_bias, self.cfg)


class BeamMoE(nn.Module):
    def __init__(self, cfg: BeamConfig):
        super().__init__()
        self.gate = BeamRouter(cfg)
        self.experts = nn.ModuleList(
            BeamMLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts)
        )

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, weights = self.gate(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e](x[token]).float() * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out.to(x.dtype).view(shape)


class BeamDecoderLayer(nn.Module):
    def __init__(self, cfg: BeamConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = BeamAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = BeamMoE(cfg) if cfg.is_moe(layer_idx) else BeamMLP(h, cfg.intermediate_size)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, h, positions, cache: LayerKV | None = None):
        a, b = self.cfg.residual_coeffs(2 * self.layer_idx)
        y = self.self_attn(self.input_layernorm(h), positions, cache)
        h = residual_add(h, self.post_attention_layernorm(y), a, b)
        a, b = self.cfg.residual_coeffs(2 * self.layer_idx + 1)
        y = self.mlp(self.pre_feedforward_layernorm(h))
        return residual_add(h, self.post_feedforward_layernorm(y), a, b)


class BeamModel(nn.Module):
    def __init__(self, cfg: BeamConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(BeamDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class BeamForCausalLM(nn.Module):
    def __init__(self, cfg: BeamConfig):
        super().__init__()
        self.config = cfg
        self.model = BeamModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    # -------------------------------------------------------------- construction
    @classmethod
    def from_state_dict(cls, cfg: BeamConfig, state: dict, dtype=torch.float32):
        """Build from a complete BF16-layout state dict (router kept FP32, the rest in `dtype`)."""
        from .checkpoint import check_state_dict

        check_state_dict(cfg, {k: (tuple(v.shape), v.dtype) for k, v in state.items()})
        with torch.device("meta"):
            model = cls(cfg)
        cast = {k: v.to(ROUTER_DTYPE if ".mlp.gate." in k else dtype) for k, v in state.items()}
        model.load_state_dict(cast, strict=True, assign=True)
        return model.eval().requires_grad_(False)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype=torch.float32):
        """Load a BF16 Hugging Face Beam checkpoint (single file or sharded with an index)."""
        from .checkpoint import load_state_dict

        cfg = BeamConfig.from_hf(path)
        return cls.from_state_dict(cfg, load_state_dict(path, cfg), dtype)

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    # -------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] (FP32). With `cache`, continues at cache.length."""
        b, t = input_ids.shape
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + t, device=input_ids.device).expand(b, t)
        h = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, positions, cache.layers[i] if cache is not None else None)
        if cache is not None:
            cache.length += t
        return self.lm_head(self.model.norm(h)).float()

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | list[int] | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Greedy (temperature 0) or sampled decoding; returns [B, T + generated]."""
        steps = self.stream(
            input_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, use_cache
        )
        new = list(steps)
        if not new:
            return input_ids
        return torch.cat([input_ids, torch.stack(new, 1)], 1)

    @torch.inference_mode()
    def stream(
        self, input_ids, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=None,
        eos_token_id=None, use_cache=True,
    ) -> Iterator[torch.Tensor]:
        """Yield the next token ids [B] one step at a time (stops when every row hit EOS)."""
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        cache = KVCache.empty(self.config) if use_cache else None
        seq, feed = input_ids, input_ids
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        for _ in range(max_new_tokens):
            logits = self(feed, cache)[:, -1] if use_cache else self(seq)[:, -1]
            token = sample(logits, temperature, top_k, top_p, gen)
            yield token
            seq = torch.cat([seq, token[:, None]], 1)
            feed = token[:, None]
            done |= torch.tensor([t in eos for t in token.tolist()])
            if bool(done.all()):
                return


def sample(logits, temperature=0.0, top_k=0, top_p=1.0, generator=None) -> torch.Tensor:
    """logits [B, V] FP32 -> token ids [B]. temperature 0 is greedy (argmax)."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token crossing top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
