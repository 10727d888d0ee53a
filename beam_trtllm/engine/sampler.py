"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Sampling draws the token with the largest p_i / E_i, E_i ~ Exp(1) i.i.d. per token id (the
exponential race: exactly a draw from p). With a seed, E comes from a generator seeded by
(seed, index of the token in the output), so a request samples the same tokens whatever else
is in its batch and even after a preemption recomputed its KV. Without a seed the engine's
own generator is used. Logprobs are those of the model's distribution (log-softmax of the raw
logits, before temperature and filters), as vLLM and the OpenAI API report them.
"""

from __future__ import annotations

import torch

from .types import SamplingParams, TokenLogprobs


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row [V] fp32 -> probabilities after temperature, top-k and top-p (the token that
    crosses top_p is kept, as in beam_trtllm.hf_model.sample)."""
    scaled = logits.float() / temperature
    sorted_logits, order = scaled.sort(descending=True)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
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


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
           generator: torch.Generator | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [B, V] (fp32) -> (token per row, logprobs per row or None).

    `indices[b]`: how many tokens row b's request has generated before this one (seeding).
    """
    tokens = logits.argmax(-1)
    for b, p in enumerate(params):
        if p.greedy:
            continue
        probs = filtered_probs(logits[b], p.temperature, p.top_k, p.top_p)
        noise = exponential_noise(probs.numel(), p.seed, indices[b], logits.device, generator)
        tokens[b] = (probs / noise).argmax()
    token_list = tokens.tolist()
    want = [b for b, p in enumerate(params) if p.logprobs is not None]
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    if want:
        lp = logits[want].float().log_softmax(-1)
        for row, b in enumerate(want):
            chosen = float(lp[row, token_list[b]])
            top: tuple = ()
            if params[b].logprobs:
                vals, ids = lp[row].topk(params[b].logprobs)
                top = tuple(zip(ids.tolist(), vals.tolist()))
            logprobs[b] = TokenLogprobs(token_list[b], chosen, top)
    return token_list, logprobs
