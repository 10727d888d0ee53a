"""Beam's forward pass for one engine step, through the `beam::` ops (docs/DESIGN.md §2).

All sequences of a step are flattened into T tokens. Per layer: one packed q/k/v/gate GEMM,
`qk_prep` (norms, RoPE or SSMax, the output gate with its bias, cache store), `attention`
(paged or ring cache plus the step's own keys, gated output), the output projection, one fused
`add_rmsnorm` per sublayer boundary, and either the dense SwiGLU or `group_router` + one
`moe_*` call (the routed scale on the summed output). The logits are softcapped in FP32. Activations are BF16 on every
device; the KV cache layout and the restore rule are in `kv_cache.py` and docs/ENGINE.md.

Launches saved where the checkpoint allows (same numerics, docs/ENGINE.md "Decode launches"):
- a Linear whose first segment is FP8 W8A8 gets its input as FP8 codes from the op that makes
  it: the norm before it (`rmsnorm_fp8` / `add_rmsnorm_fp8`, with the Linear's input_scale)
  or, for o_proj, the attention (`out_scale`), so `linear_fp8` runs no quantizer; likewise
  FP8 W8A8 experts get theirs from the boundary before the MoE (with the layer's a13_scale;
  the router reads the BF16 x the same launch writes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plugins._reference import swiglu

from ..config import BeamConfig
from .kv_cache import KVCache
from .types import EngineError
from .weights import LAYER_NORMS

ACT_DTYPE = torch.bfloat16  # a build's default; a float32 build (CPU numerics checks) runs FP32


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


def fp8_input_scale(segments: list[tuple[str, dict]]) -> torch.Tensor | None:
    """The static activation scale of a packed Linear whose first segment is FP8 W8A8: the op
    that produces its input also writes the FP8 codes with it (see the module docstring)."""
    fmt, w = segments[0]
    return w["input_scale"] if fmt == "fp8" else None


def _linear(x: torch.Tensor | None, segments: list[tuple[str, dict]],
            xq: torch.Tensor | None = None, act_dtype: torch.dtype = ACT_DTYPE) -> torch.Tensor:
    """x: the BF16 input (None when xq is all the segments need); xq: its FP8 codes with the
    first segment's input_scale (`fp8_input_scale`), or None."""
    outs = []
    for j, (fmt, w) in enumerate(segments):
        if fmt == "bf16":
            outs.append(F.linear(x, w["weight"]))
        elif fmt == "fp8" and j == 0 and xq is not None:
            outs.append(_ops().linear_fp8(xq, w["weight"], w["weight_scale"], w["input_scale"],
                                          act_dtype))
        elif fmt == "fp8":
            outs.append(_ops().linear_fp8(x, w["weight"], w["weight_scale"], w["input_scale"]))
        elif fmt == "fp8_block":
            outs.append(_ops().linear_fp8_block(x, w["weight"], w["weight_scale"]))
        elif fmt == "fp8_channel":  # activations quantized per token inside the op
            outs.append(_ops().linear_fp8_channel(x, w["weight"], w["weight_scale"]))
        elif fmt == "nvfp4":
            outs.append(_ops().linear_nvfp4(x, w["weight"], w["weight_scale"], w["weight_scale_2"]))
        else:
            raise EngineError(f"linear format {fmt!r} has no beam:: op")
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class BeamModel:
    """The repacked weights (on one device) and the step forward."""

    def __init__(self, cfg: BeamConfig, weights: dict[str, torch.Tensor], layer_plan: dict,
                 kv: KVCache, parallel=None):
        self.cfg, self.kv = cfg, kv
        self.parallel = parallel  # a rank of a parallel engine (parallel/rank.py), or None
        self.ops = _ops()
        from plugins._common import prepare_counters, sm_count
        from plugins._rope import rope_inv_freq

        device = weights["model.embed_tokens.weight"].device
        self.sm_count = sm_count(device) if device.type == "cuda" else None
        # qk_prep's RoPE table, made now: made by a first call inside a CUDA-graph capture, its
        # two small kernels would be part of every replay
        rope_inv_freq(cfg.rope_theta, cfg.head_dim, device)
        prepare_counters(device)  # the ops' handoff counters of this stream, likewise (graphs.py
        # captures on its warm-up stream, whose counters the warm-up makes)
        take = _Taker(weights)
        self.embed = take("model.embed_tokens.weight")
        self.act_dtype = self.embed.dtype  # the activations' dtype: the build's
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
        layer["gate_bias"] = take(f"{p}self_attn.gate_bias")
        names = ["self_attn.qkvg_proj", "self_attn.o_proj"]
        if not self.cfg.is_moe(i):
            names += ["mlp.gate_up_proj", "mlp.down_proj"]
        for name in names:
            if name not in plan:
                raise EngineError(f"engine.json: layer{i} has no plan for {name}")
            layer[name] = [(seg["format"], take.prefix(f"{p}{name}.{s}."))
                           for s, seg in enumerate(plan[name])]
        layer["attn_in_scale"] = fp8_input_scale(layer["self_attn.qkvg_proj"])
        layer["o_in_scale"] = (fp8_input_scale(layer["self_attn.o_proj"])
                               if len(layer["self_attn.o_proj"]) == 1 else None)
        layer["ffn_in_scale"] = (None if self.cfg.is_moe(i)
                                 else fp8_input_scale(layer["mlp.gate_up_proj"]))
        if self.cfg.is_moe(i):
            layer["router_w"] = take(f"{p}mlp.gate.weight")
            layer["router_b"] = take(f"{p}mlp.gate.e_score_correction_bias")
            layer["experts_fmt"] = plan.get("experts", "bf16")
            layer["experts"] = take.prefix(f"{p}mlp.experts.")
            if layer["experts_fmt"] == "fp8":  # the boundary writes the experts' FP8 input
                layer["ffn_in_scale"] = layer["experts"]["a13_scale"]
        take.optional(f"{p}self_attn.k_scale")  # consumed by the KV cache, not the model
        take.optional(f"{p}self_attn.v_scale")
        return layer

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, s: StepInputs, capture: tuple[int, ...] = ()):
        """-> logits [S, V] fp32 of the rows in `s.logits_rows`; with `capture` (a drafter's
        target_layer_ids), (logits, the residual stream after each of those layers,
        concatenated in that order [T, len(capture) * H]) — before the final norm."""
        if self.parallel is not None:
            self.parallel.begin_forward(s.input_ids.shape[0])
        h = F.embedding(s.input_ids, self.embed)
        x, xq = self.input_norm(h)
        captured = {}
        for i in range(len(self.layers)):
            h, x, xq = self.layer(i, h, x, xq, s)
            if i in capture:
                captured[i] = h
        if not capture:
            return self.logits(x, s)
        return self.logits(x, s), torch.cat([captured[i] for i in capture], dim=-1)

    def input_norm(self, h: torch.Tensor):
        """Layer 0's pre-attention norm -> (x, its FP8 codes for the q/k/v GEMM or None)."""
        layer0, eps = self.layers[0], self.cfg.rms_norm_eps
        if layer0["attn_in_scale"] is None:
            return self.ops.rmsnorm(h, layer0["input_layernorm"], eps), None
        return self.ops.rmsnorm_fp8(h, layer0["input_layernorm"], layer0["attn_in_scale"], eps)

    def boundary(self, h, y, w_post, w_pre, sublayer: int, scale, y_weights=None):
        """`add_rmsnorm` -> (h', x, x's FP8 codes with `scale`, or None). y may be partials
        (a split o_proj's; with y_weights, the MoE's per-slot outputs), which it adds."""
        a, b = self.cfg.residual_coeffs(sublayer)
        eps = self.cfg.rms_norm_eps
        # the MoE's per-slot outputs get the routed scale on their weighted sum
        y_scale = 1.0 if y_weights is None else self.cfg.routed_scaling_factor
        if scale is None:
            return (*self.ops.add_rmsnorm(h, y, w_post, w_pre, a, b, eps, y_weights, y_scale),
                    None)
        return self.ops.add_rmsnorm_fp8(h, y, w_post, w_pre, scale, a, b, eps, y_weights,
                                        y_scale)

    def layer(self, i: int, h: torch.Tensor, x: torch.Tensor, xq: torch.Tensor | None,
              s: StepInputs, into: int | None = None):
        """Decoder layer i: (residual stream h, its pre-attention norm x, x's FP8 codes or None)
        -> the same for layer `into` (default i + 1; after the last, x is the final norm's
        output). bench/ chains a layer into itself (into=i), the last one included."""
        layer = self.layers[i]
        y = self._attention(i, layer, x, xq, s)
        h, x, xq = self.boundary(h, y, layer["post_attention_layernorm"],
                                  layer["pre_feedforward_layernorm"], 2 * i, layer["ffn_in_scale"])
        y, y_weights = self._ffn(i, layer, x, xq)
        into = i + 1 if into is None else into
        last = into == len(self.layers)
        nxt = self.final_norm if last else self.layers[into]["input_layernorm"]
        scale = None if last else self.layers[into]["attn_in_scale"]
        return self.boundary(h, y, layer["post_feedforward_layernorm"], nxt, 2 * i + 1, scale,
                             y_weights)

    def logits(self, x: torch.Tensor, s: StepInputs) -> torch.Tensor:
        """The LM head's BF16 output, then FP32, softcapped as transformers' BeamForCausalLM
        does (tanh(l / cap) * cap in FP32): what the sampler and the logprobs see."""
        logits = F.linear(x.index_select(0, s.logits_rows), self.lm_head).float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _attention(self, i: int, layer: dict, x: torch.Tensor, xq: torch.Tensor | None,
                   s: StepInputs) -> torch.Tensor:
        cfg, ops, kv = self.cfg, self.ops, self.kv
        full = cfg.is_full(i)
        k_cache, v_cache = kv.layer(i)
        ks, vs = kv.k_scale_t[i], kv.v_scale_t[i]
        qkvg = self._split_linear(x, layer["self_attn.qkvg_proj"], xq)
        q, k, v, gate = ops.qk_prep(qkvg, s.positions, layer["q_norm"], layer["k_norm"],
                                    layer["gate_bias"], k_cache, v_cache,
                                    s.slot_full if full else s.slot_sliding, ks, vs, full,
                                    cfg.rms_norm_eps, cfg.rope_theta,
                                    out_dtype=self.act_dtype if qkvg.dim() == 3 else None)
        if full and s.restore_rows.numel():
            # Prefix restore: these positions' exact K/V are in the cache; the recomputed ones
            # are exact only from restore start + (sliding layers below) * (window - 1).
            k[s.restore_rows] = _from_cache(k_cache, s.restore_slots, ks, k.dtype)
            v[s.restore_rows] = _from_cache(v_cache, s.restore_slots, vs, v.dtype)
        o_scale = layer["o_in_scale"]  # with it, the attention writes o_proj's FP8 input
        if full:
            o = ops.attention(q, k, v, gate, k_cache, v_cache, s.cu_seqlens, s.q_start, s.hist_full,
                              s.block_table, 0, ks, vs, o_scale)
        else:
            o = ops.attention(q, k, v, gate, k_cache, v_cache, s.cu_seqlens, s.q_start,
                              s.hist_sliding, s.ring_index, cfg.sliding_window, ks, vs, o_scale)
            if s.write_rows.numel():  # a multi-token chunk stores its last window afterwards
                ops.cache_write(k.index_select(0, s.write_rows), v.index_select(0, s.write_rows),
                                k_cache, v_cache, s.write_slots, ks, vs)
        if self.parallel is not None and self.parallel.splits_attention:  # heads split
            return self.parallel.row_linear(o, layer["self_attn.o_proj"], o_scale is not None)
        if o_scale is None:
            return _linear(o, layer["self_attn.o_proj"], act_dtype=self.act_dtype)
        return self._split_linear(None, layer["self_attn.o_proj"], o)

    def _split_linear(self, x, segments, xq):
        """`_linear`, except that a single FP8 segment on FP8 codes over a few tokens may
        return FP32 partial sums [S, T, N] (`split_k`), which its consumer adds as it reads
        them: qk_prep for q/k/v, the boundary's add_rmsnorm for o_proj."""
        if len(segments) == 1 and segments[0][0] == "fp8" and xq is not None:
            w = segments[0][1]
            split = self.split_k(xq.shape[0], *w["weight"].shape)
            if split > 1:
                return self.ops.linear_fp8(xq, w["weight"], w["weight_scale"], w["input_scale"],
                                           self.act_dtype, split)
        return _linear(x, segments, xq, self.act_dtype)

    def split_k(self, t: int, n: int, k: int) -> int:
        """K splits of an FP8 GEMM over t tokens whose consumer adds partial sums
        (`plugins.linear_fp8.decode_split_k`): on a GPU only, where a batch-1 GEMM's weight
        tiles leave SMs idle."""
        if self.sm_count is None:
            return 1
        from plugins.linear_fp8 import decode_split_k

        return decode_split_k(t, n, k, self.sm_count)

    def _ffn(self, i: int, layer: dict, x: torch.Tensor, xq: torch.Tensor | None):
        """-> (y, None), or for a few tokens through experts (the MoE's per-slot outputs as
        [k, T, H], their routing weights [T, k]) for the boundary's add_rmsnorm to combine."""
        cfg, ops = self.cfg, self.ops
        if not cfg.is_moe(i):
            gu = _linear(x, layer["mlp.gate_up_proj"], xq, self.act_dtype)
            inner = gu.shape[-1] // 2  # this rank's columns in a tensor-parallel engine
            h = _swiglu_rows(gu, inner)
            if self.parallel is not None and self.parallel.splits_attention:
                return self.parallel.row_linear(h, layer["mlp.down_proj"], False), None
            return _linear(h, layer["mlp.down_proj"], act_dtype=self.act_dtype), None
        ids, weights = ops.group_router(x, layer["router_w"], layer["router_b"], cfg.n_group,
                                        cfg.topk_group, cfg.num_experts_per_tok,
                                        cfg.norm_topk_prob)
        from plugins.add_rmsnorm import adds_partials

        per_slot = adds_partials(x.shape[0])
        if self.parallel is not None:  # expert parallel: this rank's experts, then exchanged
            return self.parallel.moe(self, i, layer, x, xq, ids, weights, per_slot)
        y = self._experts(i, layer, x, xq, ids, weights, per_slot)
        return (y.transpose(0, 1), weights) if per_slot else (y, None)

    def _experts(self, i, layer, x, xq, ids, weights, per_slot: bool) -> torch.Tensor:
        ops, e, fmt = self.ops, layer["experts"], layer["experts_fmt"]
        # the routed scale multiplies the summed output (per-slot outputs: the boundary's)
        kw = dict(per_slot=per_slot, scale=self.cfg.routed_scaling_factor)
        if fmt == "bf16":
            return ops.moe_bf16(x, ids, weights, e["w13"], e["w2"], **kw)
        if fmt == "fp8":  # on the codes the boundary wrote with a13_scale
            return ops.moe_fp8(xq, ids, weights, e["w13"], e["w13_scale"], e["w2"], e["w2_scale"],
                               e["a13_scale"], e["a2_scale"], self.act_dtype, **kw)
        if fmt == "fp8_channel":
            return ops.moe_fp8_channel(x, ids, weights, e["w13"], e["w13_scale"], e["w2"],
                                       e["w2_scale"], **kw)
        if fmt == "fp8_block":
            return ops.moe_fp8_block(x, ids, weights, e["w13"], e["w13_scale"], e["w2"],
                                     e["w2_scale"], **kw)
        if fmt == "nvfp4":
            return ops.moe_nvfp4(x, ids, weights, e["w13"], e["w13_scale"], e["w13_scale_2"],
                                 e["w2"], e["w2_scale"], e["w2_scale_2"], **kw)
        raise EngineError(f"layer {i}: expert format {fmt!r} has no beam:: op")


SWIGLU_ROWS = 2048  # rows per FP32 temporary of a prefill chunk's SwiGLU (info.py plans it)


def _swiglu_rows(gu: torch.Tensor, inner: int) -> torch.Tensor:
    """swiglu of a [T, 2 * inner] gate/up output, SWIGLU_ROWS rows at a time: a 16K-token
    chunk's FP32 temporary is then 160 MiB instead of 1.25 GiB (values unchanged)."""
    t = gu.shape[0]
    if t <= SWIGLU_ROWS:
        return swiglu(gu[:, :inner], gu[:, inner:])
    h = torch.empty((t, inner), dtype=gu.dtype, device=gu.device)
    for lo in range(0, t, SWIGLU_ROWS):
        rows = gu[lo:lo + SWIGLU_ROWS]
        h[lo:lo + SWIGLU_ROWS] = swiglu(rows[:, :inner], rows[:, inner:])
    return h


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
