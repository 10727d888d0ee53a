"""Batched sampling: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, grammar
masks, per-request seeds, logprobs.

Sampling draws the token with the largest p_i / E_i, E_i ~ Exp(1) i.i.d. per token id (the
exponential race: exactly a draw from p). With a seed, E comes from a generator seeded by
(seed, index of the token in the output), so a request samples the same tokens whatever else
is in its batch and even after a preemption recomputed its KV. Without a seed the engine's
own generator is used. Logprobs are those of the model's distribution (log-softmax of the raw
logits, before penalties, temperature and filters), as vLLM and the OpenAI API report them.
Rows whose request shapes its logits (penalties, logit bias, a grammar) are changed on a copy
in vLLM's order: bias, penalties, grammar mask; other rows cost nothing extra.
"""

from __future__ import annotations

import math

import torch

from .types import SamplingParams, TokenLogprobs


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                   min_p: float = 0.0) -> torch.Tensor:
    """One row [V] fp32 -> probabilities after temperature, top-k, top-p (the token that
    crosses top_p is kept, as in beam_trtllm.hf_model.sample) and min-p (tokens below min_p
    times the most likely one's probability are dropped)."""
    scaled = logits.float() / temperature
    sorted_logits, order = scaled.sort(descending=True)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if min_p > 0:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        keep &= sorted_logits >= sorted_logits[0] + math.log(min_p)
    if top_k > 0:
        keep[top_k:] = False
        # equal logits at the k-th value stay, as the reference's `logits < kth` does
        keep |= sorted_logits >= sorted_logits[min(top_k, len(sorted_logits)) - 1]
    if top_p < 1.0:
        probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(-1)
        keep &= (probs.cumsum(-1) - probs) < top_p
    masked = sorted_logits.masked_fill(~keep, float("-inf"))
    out = torch.empty_like(masked)
    out[order] = masked.softmax(-1)
    return out


def exponential_noise(n: int, seed: int | None, index: int, device, generator) -> torch.Tensor:
    if seed is None:
        return torch.empty(n, device=device).exponential_(generator=generator)
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + index) % (1 << 63))
    return torch.empty(n).exponential_(generator=g).to(device)


def shape_logits(logits: torch.Tensor, params: list[SamplingParams],
                 histories: list[tuple[list[int], list[int]]] | None,
                 bitmask: torch.Tensor | None, mask_rows: list[int]) -> torch.Tensor:
    """The logits sampling uses: a copy with the rows of requests that shape theirs changed
    (bias, penalties, grammar mask), or `logits` itself when no row does."""
    rows = [b for b, p in enumerate(params) if p.shapes_logits]
    if not rows:
        return logits
    out = logits.float().clone()
    for b in rows:
        p = params[b]
        row = out[b]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=row.device)
            row.index_add_(0, ids, torch.tensor([v for _, v in p.logit_bias], device=row.device))
        if histories is not None and (p.frequency_penalty or p.presence_penalty
                                      or p.repetition_penalty != 1.0):
            _penalize(row, p, *histories[b])
    if bitmask is not None and mask_rows:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True),
                                        indices=mask_rows)
    return out


def _penalize(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> None:
    v = row.numel()
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(v, dtype=torch.bool, device=row.device)
        seen[torch.tensor(prompt + output, dtype=torch.long, device=row.device)] = True
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(output, device=row.device), minlength=v)[:v].float()
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
           generator: torch.Generator | None = None,
           histories: list[tuple[list[int], list[int]]] | None = None,
           bitmask: torch.Tensor | None = None,
           mask_rows: list[int] = ()) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [B, V] (fp32) -> (token per row, logprobs per row or None).

    `indices[b]`: how many tokens row b's request has generated before this one (seeding).
    `histories[b]`: (prompt ids, output ids) of row b, for penalties; `bitmask` rows
    `mask_rows`: the grammar's allowed tokens (xgrammar's packed bitmask, filled by the caller).
    """
    raw = logits
    logits = shape_logits(logits, params, histories, bitmask, list(mask_rows))
    tokens = logits.argmax(-1)
    for b, p in enumerate(params):
        if p.greedy:
            continue
        probs = filtered_probs(logits[b], p.temperature, p.top_k, p.top_p, p.min_p)
        noise = exponential_noise(probs.numel(), p.seed, indices[b], logits.device, generator)
        tokens[b] = (probs / noise).argmax()
    token_list = tokens.tolist()
    want = [b for b, p in enumerate(params) if p.logprobs is not None]
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    if want:
        lp = raw[want].float().log_softmax(-1)
        for row, b in enumerate(want):
            logprobs[b] = token_logprobs(lp[row], token_list[b], params[b].logprobs)
    return token_list, logprobs


def token_logprobs(lp: torch.Tensor, token: int, num_top: int) -> TokenLogprobs:
    """One row of log-softmaxed raw logits [V] -> the chosen token's entry and the top ones."""
    top: tuple = ()
    if num_top:
        vals, ids = lp.topk(num_top)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return TokenLogprobs(token, float(lp[token]), top)
