"""Beam's forward pass for one engine step, through the `beam::` ops (docs/DESIGN.md §2).

All sequences of a step are flattened into T tokens. Per layer: one packed QKV+gate GEMM,
`qk_prep` (norms, RoPE or SSMax, gate, cache store), `attention` (paged or ring cache plus the
step's own keys), the output projection, one fused `add_rmsnorm` per sublayer boundary, and
either the dense SwiGLU or `group_router` + one `moe_*` call. Activations are BF16 on every
device; the KV cache layout and the restore rule are in `kv_cache.py` and docs/ENGINE.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import BeamConfig
from .kv_cache import KVCache
from .types import EngineError
from .weights import LAYER_NORMS

ACT_DTYPE = torch.bfloat16


def _ops():
    import plugins  # noqa: F401  (registers torch.ops.beam.*)

    return torch.ops.beam


@dataclass
class StepInputs:
    """Device tensors of one step (built by `batch.py`; CUDA graphs replay them in place)."""

    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64
    cu_seqlens: torch.Tensor     # [B+1] int32
    q_start: torch.Tensor        # [B] int32
    hist_full: torch.Tensor      # [B] int32 (zeros)
    hist_sliding: torch.Tensor   # [B] int32 (restore start, see docs/DESIGN.md §3)
    block_table: torch.Tensor    # [B, M] int32
    ring_index: torch.Tensor     # [B, 1] int32
    slot_full: torch.Tensor      # [T] int64, -1: keep (prefix-cached position)
    slot_sliding: torch.Tensor   # [T] int64, -1: written after the attention (multi-token chunk)
    write_rows: torch.Tensor     # [W] int64 token rows stored into the rings after attention
    write_slots: torch.Tensor    # [W] int64
    restore_rows: torch.Tensor   # [R] int64 token rows whose full-layer K/V come from the cache
    restore_slots: torch.Tensor  # [R] int64
    logits_rows: torch.Tensor    # [S] int64 rows whose logits are sampled


def _linear(x: torch.Tensor, segments: list[tuple[str, dict]]) -> torch.Tensor:
    outs = []
    for fmt, w in segments:
        if fmt == "bf16":
            outs.append(F.linear(x, w["weight"]))
        elif fmt == "fp8":
            outs.append(_ops().linear_fp8(x, w["weight"], w["weight_scale"], w["input_scale"]))
        elif fmt == "fp8_block":
            outs.append(_ops().linear_fp8_block(x, w["weight"], w["weight_scale"]))
        elif fmt == "nvfp4":
            outs.append(_ops().linear_nvfp4(x, w["weight"], w["weight_scale"], w["weight_scale_2"]))
        else:
            raise EngineError(f"linear format {fmt!r} has no beam:: op")
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class BeamModel:
    """The repacked weights (on one device) and the step forward."""

    def __init__(self, cfg: BeamConfig, weights: dict[str, torch.Tensor], layer_plan: dict,
                 kv: KVCache):
        self.cfg, self.kv = cfg, kv
        self.ops = _ops()
        take = _Taker(weights)
        self.embed = take("model.embed_tokens.weight")
        self.layers = [self._layer(take, layer_plan.get(f"layer{i}", {}), i)
                       for i in range(cfg.num_hidden_layers)]
        self.final_norm = take("model.norm.weight")
        self.lm_head = take("lm_head.weight")
        take.finish()

    def _layer(self, take: "_Taker", plan: dict, i: int) -> dict:
        p = f"model.layers.{i}."
        layer = {n: take(f"{p}{n}.weight") for n in LAYER_NORMS}
        layer["q_norm"] = take(f"{p}self_attn.q_norm.weight")
        layer["k_norm"] = take(f"{p}self_attn.k_norm.weight")
        names = ["self_attn.qkvg_proj", "self_attn.o_proj"]
        if not self.cfg.is_moe(i):
            names += ["mlp.gate_up_proj", "mlp.down_proj"]
        for name in names:
            if name not in plan:
                raise EngineError(f"engine.json: layer{i} has no plan for {name}")
            layer[name] = [(seg["format"], take.prefix(f"{p}{name}.{s}."))
                           for s, seg in enumerate(plan[name])]
        if self.cfg.is_moe(i):
            layer["router_w"] = take(f"{p}mlp.gate.weight")
            layer["router_b"] = take(f"{p}mlp.gate.e_score_correction_bias")
            layer["experts_fmt"] = plan.get("experts", "bf16")
            layer["experts"] = take.prefix(f"{p}mlp.experts.")
        take.optional(f"{p}self_attn.k_scale")  # consumed by the KV cache, not the model
        take.optional(f"{p}self_attn.v_scale")
        return layer

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, s: StepInputs) -> torch.Tensor:
        """-> logits [S, V] fp32 of the rows in `s.logits_rows`."""
        h = F.embedding(s.input_ids, self.embed)
        x = self.ops.rmsnorm(h, self.layers[0]["input_layernorm"], self.cfg.rms_norm_eps)
        for i in range(len(self.layers)):
            h, x = self.layer(i, h, x, s)
        return self.logits(x, s)

    def layer(self, i: int, h: torch.Tensor, x: torch.Tensor, s: StepInputs):
        """Decoder layer i: (residual stream h, its pre-attention norm x) -> the same for the
        next layer (after the last, x is the final norm's output)."""
        cfg, ops, layer = self.cfg, self.ops, self.layers[i]
        eps = cfg.rms_norm_eps
        y = self._attention(i, layer, x, s)
        a, b = cfg.residual_coeffs(2 * i)
        h, x = ops.add_rmsnorm(h, y, layer["post_attention_layernorm"],
                               layer["pre_feedforward_layernorm"], a, b, eps)
        y = self._ffn(i, layer, x)
        a, b = cfg.residual_coeffs(2 * i + 1)
        nxt = self.layers[i + 1]["input_layernorm"] if i + 1 < len(self.layers) else self.final_norm
        return ops.add_rmsnorm(h, y, layer["post_feedforward_layernorm"], nxt, a, b, eps)

    def logits(self, x: torch.Tensor, s: StepInputs) -> torch.Tensor:
        # As the reference: the LM head's BF16 output, then FP32 for sampling.
        return F.linear(x.index_select(0, s.logits_rows), self.lm_head).float()

    def _attention(self, i: int, layer: dict, x: torch.Tensor, s: StepInputs) -> torch.Tensor:
        cfg, ops, kv = self.cfg, self.ops, self.kv
        full = cfg.is_full(i)
        k_cache, v_cache = kv.layer(i)
        ks, vs = kv.k_scale_t[i], kv.v_scale_t[i]
        qkvg = _linear(x, layer["self_attn.qkvg_proj"])
        q, k, v, gate = ops.qk_prep(qkvg, s.positions, layer["q_norm"], layer["k_norm"], k_cache,
                                    v_cache, s.slot_full if full else s.slot_sliding, ks, vs, full,
                                    cfg.rms_norm_eps, cfg.rope_theta, cfg.ssmax_base,
                                    cfg.ssmax_exponent)
        if full and s.restore_rows.numel():
            # Prefix restore: these positions' exact K/V are in the cache; the recomputed ones
            # are exact only from restore start + (sliding layers below) * (window - 1).
            k[s.restore_rows] = _from_cache(k_cache, s.restore_slots, ks, k.dtype)
            v[s.restore_rows] = _from_cache(v_cache, s.restore_slots, vs, v.dtype)
        if full:
            o = ops.attention(q, k, v, gate, k_cache, v_cache, s.cu_seqlens, s.q_start, s.hist_full,
                              s.block_table, 0, ks, vs)
        else:
            o = ops.attention(q, k, v, gate, k_cache, v_cache, s.cu_seqlens, s.q_start,
                              s.hist_sliding, s.ring_index, cfg.sliding_window, ks, vs)
            if s.write_rows.numel():  # a multi-token chunk stores its last window afterwards
                ops.cache_write(k.index_select(0, s.write_rows), v.index_select(0, s.write_rows),
                                k_cache, v_cache, s.write_slots, ks, vs)
        return _linear(o, layer["self_attn.o_proj"])

    def _ffn(self, i: int, layer: dict, x: torch.Tensor) -> torch.Tensor:
        cfg, ops = self.cfg, self.ops
        if not cfg.is_moe(i):
            gu = _linear(x, layer["mlp.gate_up_proj"])
            inner = cfg.intermediate_size
            return _linear(F.silu(gu[:, :inner]) * gu[:, inner:], layer["mlp.down_proj"])
        ids, weights = ops.group_router(x, layer["router_w"], layer["router_b"], cfg.n_group,
                                        cfg.topk_group, cfg.num_experts_per_tok,
                                        cfg.routed_scaling_factor, cfg.norm_topk_prob)
        e, fmt = layer["experts"], layer["experts_fmt"]
        if fmt == "bf16":
            return ops.moe_bf16(x, ids, weights, e["w13"], e["w2"])
        if fmt == "fp8":
            return ops.moe_fp8(x, ids, weights, e["w13"], e["w13_scale"], e["w2"], e["w2_scale"],
                               e["a13_scale"], e["a2_scale"])
        if fmt == "fp8_block":
            return ops.moe_fp8_block(x, ids, weights, e["w13"], e["w13_scale"], e["w2"], e["w2_scale"])
        if fmt == "nvfp4":
            return ops.moe_nvfp4(x, ids, weights, e["w13"], e["w13_scale"], e["w13_scale_2"],
                                 e["w2"], e["w2_scale"], e["w2_scale_2"])
        raise EngineError(f"layer {i}: expert format {fmt!r} has no beam:: op")


def _from_cache(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    rows = cache.view(-1, *cache.shape[2:]).index_select(0, slots)
    if rows.dtype == torch.float8_e4m3fn:
        return (rows.float() * scale).to(dtype)
    return rows.to(dtype)


class _Taker:
    """Hands out weight tensors by name, so a missing or left-over tensor is reported."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights, self.used = weights, set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise EngineError(f"engine weights have no tensor {name}")
        self.used.add(name)
        return self.weights[name]

    def optional(self, name: str) -> None:
        if name in self.weights:
            self.used.add(name)

    def prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {n[len(prefix):]: t for n, t in self.weights.items()
               if n.startswith(prefix) and "." not in n[len(prefix):]}
        if not out:
            raise EngineError(f"engine weights have no tensors {prefix}*")
        self.used.update(prefix + n for n in out)
        return out

    def finish(self) -> None:
        extra = sorted(set(self.weights) - self.used)
        if extra:
            raise EngineError(f"engine weights have an unexpected tensor {extra[0]}"
                              f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}")
