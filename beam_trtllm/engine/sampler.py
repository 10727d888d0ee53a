"""Batched sampling: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, grammar
masks, per-request seeds, logprobs.

Sampling draws the token with the largest p_i / E_i, E_i ~ Exp(1) i.i.d. per token id (the
exponential race: exactly a draw from p). With a seed, E comes from a generator seeded by
(seed, index of the token in the output), so a request samples the same tokens whatever else
is in its batch and even after a preemption recomputed its KV. Without a seed the engine's
own generator is used. Logprobs are those of the model's distribution (log-softmax of the raw
logits, before penalties, temperature and filters), as vLLM and the OpenAI API report them.
Rows with penalties or a logit bias are changed on an fp32 copy in vLLM's order (bias,
penalties, then the grammar mask); grammar masks alone are applied in place to the rows they
constrain (a masked entry becomes -inf, the others keep their values: argmax and the filters
see what they would on a copy), so an unconstrained row costs nothing extra. A step's masks
travel in `BitmaskBuffers`: one host buffer reused every step (pinned on CUDA) copied without
synchronizing into one device buffer.
"""

from __future__ import annotations

import math

import torch

from .host_buffers import Staging
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
    noise = torch.empty(n).exponential_(generator=g)
    if torch.device(device).type == "cuda":  # a pageable copy would wait for the GPU
        return noise.pin_memory().to(device, non_blocking=True)
    return noise.to(device)


def shape_logits(logits: torch.Tensor, params: list[SamplingParams],
                 histories: list[tuple[list[int], list[int]]] | None,
                 bitmask: torch.Tensor | None, mask_rows: list[int],
                 mask_index: torch.Tensor | None = None) -> torch.Tensor:
    """The logits sampling uses: an fp32 copy when a row has a bias or penalties (changed on
    it), else `logits` itself; the grammar rows `mask_rows` are masked in place on whichever
    it is (`mask_index`: the same rows as an int32 tensor on the logits' device)."""
    rows = [b for b, p in enumerate(params) if p.logit_bias or p.penalized]
    out = logits
    if rows:
        out = logits.float().clone()
    for b in rows:
        p = params[b]
        row = out[b]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=row.device)
            row.index_add_(0, ids, torch.tensor([v for _, v in p.logit_bias], device=row.device))
        if histories is not None and p.penalized:
            _penalize(row, p, *histories[b])
    if bitmask is not None and len(mask_rows):
        apply_bitmask(out, bitmask, list(mask_rows), mask_index)
    return out


def apply_bitmask(out: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                  index: torch.Tensor | None = None) -> None:
    """-inf where the packed bitmask row (the row of `out` it masks) has a 0 bit."""
    import xgrammar as xgr

    if bitmask.device != out.device:  # a caller's host bitmask (BitmaskBuffers copies its own)
        bitmask = bitmask.to(out.device)
    n = out.shape[0]
    if len(rows) == n:  # every row (distinct rows): no index to pass
        xgr.apply_token_bitmask_inplace(out, bitmask[:n])
    else:
        xgr.apply_token_bitmask_inplace(out, bitmask, indices=index if index is not None else rows)


class BitmaskBuffers:
    """A step's grammar bitmask [rows, ceil(vocab / 32)] int32 and its masked rows' index:
    `host` is filled (xgrammar writes it), `to_device` hands them to `sample`."""

    def __init__(self, rows: int, vocab: int, device: torch.device):
        words = (vocab + 31) // 32
        self.device = torch.device(device)
        self.rows, self.vocab = rows, vocab
        if self.device.type == "cuda":
            dev = {"mask": torch.empty((rows, words), dtype=torch.int32, device=device),
                   "index": torch.empty(rows, dtype=torch.int32, device=device)}
            self.stage = Staging(dev, self.device)
            self.host = self.stage.host["mask"]
        else:
            self.stage, self.host = None, torch.full((rows, words), -1, dtype=torch.int32)

    def wait(self) -> None:
        """Before writing `host`: its last copy to the device has run."""
        if self.stage is not None:
            self.stage.wait()

    def to_device(self, batch: int, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bitmask rows [0, batch) on the device, `rows` as an int32 device tensor or None on
        the CPU); the copies do not synchronize the host with the GPU."""
        if self.stage is None:
            return self.host[:batch], None
        self.stage.np["index"][:len(rows)] = rows
        self.stage.copy(batch)
        return self.stage.dev["mask"][:batch], self.stage.dev["index"][:len(rows)]


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
           bitmask: torch.Tensor | None = None, mask_rows: list[int] = (),
           mask_index: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [B, V] -> (token per row, logprobs per row or None). The rows `mask_rows` of
    `logits` are masked in place.

    `indices[b]`: how many tokens row b's request has generated before this one (seeding).
    `histories[b]`: (prompt ids, output ids) of row b, for penalties (None when no row has
    any); `bitmask` rows `mask_rows`: the grammar's allowed tokens (xgrammar's packed bitmask,
    filled by the caller; `mask_index` the same rows on the logits' device).
    """
    tokens, lp = sample_on_device(logits, params, indices, generator, histories, bitmask,
                                  mask_rows, mask_index)
    token_list = tokens.tolist()
    return token_list, row_logprobs(lp, token_list, params)


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
                     generator: torch.Generator | None = None,
                     histories: list[tuple[list[int], list[int]]] | None = None,
                     bitmask: torch.Tensor | None = None, mask_rows: list[int] = (),
                     mask_index: torch.Tensor | None = None):
    """`sample` up to the host: (tokens [B] int64 on the logits' device, the log-softmax of
    the rows that want logprobs or None). Nothing in it waits for the GPU, so an overlapped
    step (overlap.py) launches the next forward behind it."""
    want = [b for b, p in enumerate(params) if p.logprobs is not None]
    # the model's distribution: read before a grammar masks rows in place
    lp = logits[want].float().log_softmax(-1) if want else None
    logits = shape_logits(logits, params, histories, bitmask, list(mask_rows), mask_index)
    tokens = logits.argmax(-1)
    for b, p in enumerate(params):
        if p.greedy:
            continue
        probs = filtered_probs(logits[b], p.temperature, p.top_k, p.top_p, p.min_p)
        noise = exponential_noise(probs.numel(), p.seed, indices[b], logits.device, generator)
        tokens[b] = (probs / noise).argmax()
    return tokens, lp


def row_logprobs(lp: torch.Tensor | None, tokens: list[int],
                 params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Per row: its logprobs entry (`lp` from `sample_on_device`) or None."""
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    want = [b for b, p in enumerate(params) if p.logprobs is not None]
    for row, b in enumerate(want):
        logprobs[b] = token_logprobs(lp[row], tokens[b], params[b].logprobs)
    return logprobs


def token_logprobs(lp: torch.Tensor, token: int, num_top: int) -> TokenLogprobs:
    """One row of log-softmaxed raw logits [V] -> the chosen token's entry and the top ones."""
    top: tuple = ()
    if num_top:
        vals, ids = lp.topk(num_top)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return TokenLogprobs(token, float(lp[token]), top)
