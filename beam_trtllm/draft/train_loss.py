"""The drafter's training forward and loss (docs/SPECULATIVE.md "Training the drafter").

Blocks are cut from a target sequence as inference cuts them: an anchor at P0 (a token the
target emitted), N mask rows at P0+1..P0+N, context = the target's states at positions < P0.
Each block's keys are exactly the ones `draft` reads from its cache, [P0-w+1, P0+N]: the
context K/V of the w-1 positions before P0 (from `layers.layer_kv` on the projected states)
and the block's own K/V.

Loss (what inference implies, shared/research/dflash2.md §10), per mask row s at P0+s with
weight exp(-(s-1)/gamma) (a draft only counts if every earlier one was accepted):
- unary: KL(p || softmax(u)) over the vocabulary, p = the target's next-token distribution at
  P0+s given its prefix, u = cap*tanh(m*z/cap) of the drafter's head logits z;
- selector: over the top-k candidates of u (detached ids), cross-entropy of softmax(S[s, pred])
  against p restricted to those candidates and renormalized, where pred is the true
  predecessor (the anchor for s=1, else the sequence's token at P0+s-1), weighted by the
  mass p puts on the candidates. So S approximates log p(c | the true predecessor) on the k
  candidates: the walk's choice under greedy verification, its proposal q under sampling.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import layers as L
from .config import DraftConfig


class Blocks(NamedTuple):
    anchors: torch.Tensor  # [S, m] int64 P0 of each block
    valid: torch.Tensor    # [S, m, N] bool: P0+s is a valid label position


def sample_blocks(last: torch.Tensor, prompt_len: int, per_seq: int, n: int,
                  gen: torch.Generator | None) -> Blocks:
    """`per_seq` anchors per sequence, uniform over [prompt_len, last - 1] (an anchor is a
    token the target emitted before it stopped), drafts valid up to `last`."""
    s = last.shape[0]
    span = (last - prompt_len).clamp(min=1)  # anchors prompt_len .. last-1
    u = torch.rand(s, per_seq, generator=gen, device="cpu").to(last.device)
    anchors = prompt_len + (u * span[:, None]).long().clamp(max=span[:, None] - 1)
    offs = torch.arange(1, n + 1, device=last.device)
    valid = anchors[:, :, None] + offs <= last[:, None, None]
    return Blocks(anchors, valid)


def block_states(w: dict, cfg: DraftConfig, embed: torch.Tensor, tokens: torch.Tensor,
                 states: torch.Tensor, blocks: Blocks, inv_freq: torch.Tensor) -> torch.Tensor:
    """Final normed drafter states [S, m, B, H] of every block (anchor row included).
    tokens [S, T], states [S, T, n*H] (the target's captured states)."""
    s, m = blocks.anchors.shape
    b, w_ = cfg.block_size, cfg.sliding_window
    dev = tokens.device
    ctx = L.project_context(w, states, cfg)                              # [S, T, H]
    ctx_pos = torch.arange(tokens.shape[1], device=dev).expand(s, -1)
    ctx_kv = [L.layer_kv(w, i, ctx, ctx_pos, inv_freq, cfg) for i in range(cfg.num_hidden_layers)]
    p0 = blocks.anchors.reshape(-1)                                      # [S*m]
    seq = torch.arange(s, device=dev).repeat_interleave(m)
    pos = p0[:, None] + torch.arange(b, device=dev)                      # [S*m, B]
    ctx_keys = p0[:, None] + torch.arange(-w_ + 1, 0, device=dev)        # [S*m, w-1]
    gather_at = ctx_keys.clamp(min=0)
    key_pos = torch.cat([ctx_keys, pos], dim=1)
    visible = L.window_visible(pos, key_pos, w_)

    def keys(i: int, k: torch.Tensor, v: torch.Tensor):
        kc, vc = ctx_kv[i]
        k_ctx, v_ctx = kc[seq[:, None], gather_at], vc[seq[:, None], gather_at]
        return torch.cat([k_ctx, k.to(k_ctx.dtype)], 1), torch.cat([v_ctx, v.to(v_ctx.dtype)], 1), \
            visible

    ids = torch.full((s * m, b), cfg.mask_token_id, dtype=torch.long, device=dev)
    ids[:, 0] = tokens[seq, p0]
    emb = embed[ids].to(ctx.dtype)
    h = L.block_forward(w, emb, pos, keys, inv_freq, cfg)
    return h.view(s, m, b, -1)


def position_weights(n: int, gamma: float, device) -> torch.Tensor:
    return torch.exp(-torch.arange(n, device=device, dtype=torch.float) / gamma)


def draft_loss(w: dict, cfg: DraftConfig, lm_head: torch.Tensor, h: torch.Tensor,
               tokens: torch.Tensor, logits: torch.Tensor, blocks: Blocks,
               gamma: float) -> dict[str, torch.Tensor]:
    """h [S, m, B, H] -> {"loss", "unary", "selector", "accept"} (accept: mean accepted drafts
    of greedy verification on these blocks, teacher-forced: exact when the sequence is the
    target's greedy path)."""
    s, m, b, _ = h.shape
    n, dev = b - 1, h.device
    seq = torch.arange(s, device=dev)[:, None, None]
    label_pos = blocks.anchors[:, :, None] + torch.arange(1, b, device=dev)   # [S, m, N]
    safe = label_pos.clamp(max=tokens.shape[1] - 1)
    logp = torch.log_softmax(logits[seq, safe - 1], dim=-1)                   # [S, m, N, V]
    greedy = logp.argmax(-1)
    rows = h[:, :, 1:]
    u = L.unary_logits(F.linear(rows, lm_head), cfg)                          # [S, m, N, V]
    logq = torch.log_softmax(u, dim=-1)
    weight = position_weights(n, gamma, dev) * blocks.valid.float()
    unary = (logp.exp() * (logp - logq)).sum(-1)                              # KL per row
    cand = u.detach().topk(cfg.selector_top_k, dim=-1).indices               # [S, m, N, k]
    pred = tokens[seq, safe - 1]                                              # true predecessor
    scores = L.edge_scores(w, rows, cand, u.gather(-1, cand), pred[..., None])[..., 0, :]
    p_cand = logp.gather(-1, cand).exp()
    mass = p_cand.sum(-1)
    target = p_cand / mass.clamp(min=1e-20)[..., None]
    selector = -(target * torch.log_softmax(scores, dim=-1)).sum(-1) * mass
    total = weight.sum().clamp(min=1.0)
    pick = cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
    match = (pick == greedy) & blocks.valid
    accept = match.long().cumprod(-1).sum(-1).float().mean()
    return {"unary": (unary * weight).sum() / total, "selector": (selector * weight).sum() / total,
            "accept": accept.detach()}


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    warm = min(warmup, max(1, total // 10))
    if step < warm:
        return peak * (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, total - warm))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))
