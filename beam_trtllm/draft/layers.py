"""The DFlash2 drafter's pieces as functions of its weights (checkpoint names), shared by the
inference path (model.py: paged K/V, CUDA-graph capturable) and training (train.py).

Rounding points (shared/research/dflash2.md §5.6, §6; vLLM's Beam kernels): matmuls in the
activation dtype; RMSNorm in FP32 rounded once; the grouped conv in FP32 rounded to the
activation dtype, its residual add in FP32 rounded to the residual's dtype, then RMSNorm;
q/k norm rounded before RoPE (FP32 angles, one rounding); SiLU(gate)*up in FP32 rounded once;
the selector's A*P rounded to the activation dtype, its FP32 dot rounded, the unary logit
cap*tanh(m*z/cap) added in FP32. With FP32 activations every rounding is exact. A quantized
drafter's FP8 Linears (quant.py) run beam::linear_fp8_channel: the input quantized per token,
the FP32 sum scaled and rounded once to the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import DraftConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w in FP32, one rounding to x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    """1 / theta^(2j/d), FP32, computed on the CPU as transformers' default RoPE does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
    return (1.0 / (theta ** exponents)).to(device)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Neox (rotate-half) RoPE over the full head_dim. x [..., T, heads, d], positions [..., T]."""
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[..., None, :]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * angles.cos() + rotated * angles.sin()).to(x.dtype)


def grouped_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """FP32 Conv(x; base, delta)[r, t, c] = sum_tau 1[t >= tau] (base[tau, c] +
    delta[r, t, tau, c // g]) x[r, t - tau, c]. x [R, B, H] (one block per request: the
    look-back never crosses a block start), base [K, H], delta [R, B, K, G]."""
    xf = x.float()
    coeff = base.float() + delta.float().repeat_interleave(group_size, dim=-1)  # [R, B, K, H]
    out = coeff[:, :, 0] * xf
    for tau in range(1, base.shape[0]):
        if tau >= x.shape[1]:
            break
        shifted = F.pad(xf[:, :-tau], (0, 0, tau, 0))
        out = out + coeff[:, :, tau] * shifted
    return out


def linear(w: dict, module: str, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T of drafter Linear `module`: F.linear for a float weight; FP8 codes with their
    per-channel `weight_scale` (a quantized drafter, quant.py) run beam::linear_fp8_channel,
    which quantizes x per token inside the op. The choice is the weight's dtype (static
    metadata: no host read, one graph per drafter)."""
    weight = w[module + ".weight"]
    if weight.dtype == torch.float8_e4m3fn:
        return torch.ops.beam.linear_fp8_channel(x, weight, w[module + ".weight_scale"])
    return F.linear(x, weight)


def conv_coefficients(w: dict, prefix: str, x: torch.Tensor, cfg: DraftConfig) -> torch.Tensor:
    """delta [R, B, 2 (input / output side), K, G] from the sublayer's normalized input."""
    c = linear(w, prefix + ".kernel_projection", x)
    return c.unflatten(-1, (2, cfg.conv_kernel_size, cfg.conv_groups))


def residual_conv_norm(y: torch.Tensor, delta: torch.Tensor, base: torch.Tensor,
                       residual: torch.Tensor, norm_w: torch.Tensor, cfg: DraftConfig):
    """The output-side conv rounded to y's dtype, added to the residual in FP32 (rounded to
    the residual's dtype), then RMSNorm: (normed, new residual)."""
    conv = grouped_conv(y, base, delta, cfg.conv_group_size).to(y.dtype)
    residual = (conv.float() + residual.float()).to(residual.dtype)
    return rms_norm(residual, norm_w, cfg.rms_norm_eps), residual


def head_split(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.unflatten(-1, (heads, t.shape[-1] // heads))


def layer_kv(w: dict, i: int, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
             cfg: DraftConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's K (k_norm, RoPE) and V of inputs x [..., T, H] at positions [..., T]."""
    p = f"layers.{i}.self_attn."
    k = head_split(linear(w, p + "k_proj", x), cfg.num_key_value_heads)
    k = rope(rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps), positions, inv_freq)
    v = head_split(linear(w, p + "v_proj", x), cfg.num_key_value_heads)
    return k, v


def layer_q(w: dict, i: int, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
            cfg: DraftConfig) -> torch.Tensor:
    p = f"layers.{i}.self_attn."
    q = head_split(linear(w, p + "q_proj", x), cfg.num_attention_heads)
    return rope(rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps), positions, inv_freq)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           visible: torch.Tensor) -> torch.Tensor:
    """q [R, B, nh, d], k / v [R, Kn, nkv, d], visible [R, B, Kn] -> [R, B, nh * d].
    Softmax attention, scale d^-1/2, GQA (query head h reads kv head h // (nh / nkv))."""
    rep = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(rep, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(rep, dim=2).transpose(1, 2)
    o = F.scaled_dot_product_attention(qh, kh.to(q.dtype), vh.to(q.dtype),
                                       attn_mask=visible[:, None])
    return o.transpose(1, 2).flatten(-2)


def window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[R, B, Kn]: query p sees key j iff j >= 0 and |p - j| < window (non-causal window)."""
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    return (k_pos[:, None, :] >= 0) & (diff.abs() < window)


def mlp(w: dict, i: int, y: torch.Tensor) -> torch.Tensor:
    p = f"layers.{i}.mlp."
    gate, up = linear(w, p + "gate_proj", y), linear(w, p + "up_proj", y)
    act = (F.silu(gate.float()) * up.float()).to(y.dtype)
    return linear(w, p + "down_proj", act)


def decoder_layer(w: dict, i: int, u: torch.Tensor, residual: torch.Tensor,
                  positions: torch.Tensor, keys, next_norm: torch.Tensor, inv_freq: torch.Tensor,
                  cfg: DraftConfig):
    """One layer on a block (§5): u [R, B, H] is the normed input, residual the stream;
    `keys(i, k, v)` -> (keys [R, Kn, nkv, d], values, visible [R, B, Kn]) is where the block's
    own K/V go and what it attends to. Returns (next layer's normed input, residual)."""
    p = f"layers.{i}."
    g = cfg.conv_group_size
    delta = conv_coefficients(w, p + "attention_conv", u, cfg)
    base = w[p + "attention_conv.base_kernel"]
    u_in = grouped_conv(u, base[0], delta[:, :, 0], g).to(u.dtype)
    k, v = layer_kv(w, i, u_in, positions, inv_freq, cfg)
    keys_all, values_all, visible = keys(i, k, v)
    q = layer_q(w, i, u_in, positions, inv_freq, cfg)
    a = linear(w, p + "self_attn.o_proj", attend(q, keys_all, values_all, visible))
    y, residual = residual_conv_norm(a, delta[:, :, 1], base[1], residual,
                                     w[p + "post_attention_layernorm.weight"], cfg)
    delta = conv_coefficients(w, p + "mlp_conv", y, cfg)
    base = w[p + "mlp_conv.base_kernel"]
    y_in = grouped_conv(y, base[0], delta[:, :, 0], g).to(y.dtype)
    return residual_conv_norm(mlp(w, i, y_in), delta[:, :, 1], base[1], residual, next_norm, cfg)


def block_forward(w: dict, embeds: torch.Tensor, positions: torch.Tensor, keys,
                  inv_freq: torch.Tensor, cfg: DraftConfig) -> torch.Tensor:
    """embeds [R, B, H] (the target's embeddings of [anchor, mask...]) -> final normed h."""
    u = rms_norm(embeds, w["layers.0.input_layernorm.weight"], cfg.rms_norm_eps)
    residual = embeds
    for i in range(cfg.num_hidden_layers):
        nxt = (w[f"layers.{i + 1}.input_layernorm.weight"] if i + 1 < cfg.num_hidden_layers
               else w["norm.weight"])
        u, residual = decoder_layer(w, i, u, residual, positions, keys, nxt, inv_freq, cfg)
    return u


def project_context(w: dict, hidden: torch.Tensor, cfg: DraftConfig) -> torch.Tensor:
    """c = RMSNorm(W_fc x; hidden_norm), x = the target states concatenated [..., n * H]."""
    return rms_norm(linear(w, "fc", hidden), w["hidden_norm.weight"], cfg.rms_norm_eps)


def unary_logits(z: torch.Tensor, cfg: DraftConfig) -> torch.Tensor:
    """cap * tanh(m * z / cap) in FP32 (SGLang multiplies by output_multiplier first)."""
    cap = cfg.final_logit_softcapping
    return torch.tanh(z.float() * cfg.output_multiplier / cap) * cap


def candidates(h: torch.Tensor, lm_head: torch.Tensor, cfg: DraftConfig):
    """Top-k of the target head's logits (raw: the cap is monotonic) -> (ids int64 [.., k],
    unary scores FP32 [.., k])."""
    values, ids = F.linear(h, lm_head).topk(cfg.selector_top_k, dim=-1)
    return ids, unary_logits(values, cfg)


def edge_scores(w: dict, h: torch.Tensor, ids: torch.Tensor, unary: torch.Tensor,
                predecessors: torch.Tensor) -> torch.Tensor:
    """S[.., p, i] = u[.., i] + <A[pred_p] * P, Bc[c_i]>. h [.., H], ids / unary [.., k],
    predecessors [.., kp] token ids -> [.., kp, k] FP32."""
    proj = linear(w, "candidate_selector.hidden_projection", h)  # [.., r]
    pred = w["candidate_selector.predecessor_codebook"][predecessors]  # [.., kp, r]
    weighted = (pred.float() * proj.float()[..., None, :]).to(h.dtype)
    succ = w["candidate_selector.successor_codebook"][ids]  # [.., k, r]
    dot = torch.matmul(weighted.float(), succ.float().transpose(-1, -2)).to(h.dtype)
    return unary[..., None, :] + dot.float()


def lattice(w: dict, h: torch.Tensor, ids: torch.Tensor, unary: torch.Tensor,
            anchors: torch.Tensor) -> torch.Tensor:
    """[R, N, k (predecessor), k]: position 1's predecessor is the anchor for every p,
    position s's are the candidates of s - 1."""
    k = ids.shape[-1]
    first = anchors[:, None, None].expand(-1, 1, k)
    return edge_scores(w, h, ids, unary, torch.cat([first, ids[:, :-1]], dim=1))


def walk(scores: torch.Tensor, ids: torch.Tensor, uniforms: torch.Tensor | None,
         temperature: torch.Tensor):
    """The selector walk (§6), N steps of tensor ops: row = S[s, prev]; greedy rows (T == 0,
    or no uniforms) take the argmax, sampled rows the inverse CDF of softmax(row / T) at U
    (i* = #{j : U >= cdf_j}, capped at k - 1; SGLang's rule). -> tokens [R, N], realized
    rows [R, N, k] (pre-temperature)."""
    r, n, k, _ = scores.shape
    prev = torch.zeros(r, 1, 1, dtype=torch.long, device=scores.device)
    tokens, rows = [], []
    for s in range(n):
        row = scores[:, s].gather(1, prev.expand(r, 1, k))[:, 0]  # [R, k]
        pick = row.argmax(-1)
        if uniforms is not None:
            t = temperature.float().clamp(min=1e-5)[:, None]
            cdf = torch.softmax(row / t, dim=-1).cumsum(-1)
            sampled = (uniforms[:, s, None].float() >= cdf).sum(-1).clamp(max=k - 1)
            pick = torch.where(temperature > 0, sampled, pick)
        tokens.append(ids[:, s].gather(1, pick[:, None])[:, 0])
        rows.append(row)
        prev = pick.view(r, 1, 1)
    return torch.stack(tokens, 1), torch.stack(rows, 1)
