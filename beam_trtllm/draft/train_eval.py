"""Held-out acceptance of a drafter: speculative decoding offline, greedy verification against
transformers' target, with the inference path itself (DFlash2Drafter.draft over a DraftKV
indexed by per-request block tables, context K/V written from the target's verified states).

Each step of a request: draft N tokens from the anchor at P0; the target runs once over the
verified tokens + anchor + drafts (no cache: right-padded rows of a batch, which a causal model
does not see); accept the longest prefix of drafts equal to the target's greedy tokens, emit the
target's token after it (correction or bonus), write the context K/V of the anchor and the
accepted drafts, and move the anchor there. Acceptance length = accepted drafts + 1 (tokens a
step commits). The committed tokens are the target's greedy continuation (checked in the tests).
"""

from __future__ import annotations

import torch

from .config import DraftConfig
from .kv import DraftKV
from .model import DFlash2Drafter

KV_BLOCK = 16


class _Batch:
    """Per-request state of one batch of prompts."""

    def __init__(self, prompts: torch.Tensor, budget: int):
        self.seqs = [row.tolist() for row in prompts]       # verified tokens (anchor excluded)
        self.anchor = [0] * len(self.seqs)
        self.generated = [[] for _ in self.seqs]            # committed after the prompt
        self.active = [True] * len(self.seqs)
        self.budget = budget


def _write_context(drafter: DFlash2Drafter, kv: DraftKV, table: torch.Tensor, states: torch.Tensor,
                   spans: list[tuple[int, int, int]]) -> None:
    """spans: (request, first position, count) of verified tokens whose states are in
    states[request, first:first+count]."""
    rows = [states[r, a:a + n] for r, a, n in spans if n]
    if not rows:
        return
    pos = torch.cat([torch.arange(a, a + n) for r, a, n in spans if n]).to(states.device)
    req = torch.cat([torch.full((n,), r) for r, a, n in spans if n]).to(states.device)
    slots = DraftKV.slots_of(table[req].long(), pos[:, None], kv.block_size)[:, 0]
    k, v = drafter.context_kv(torch.cat(rows), pos)
    kv.write(slots, k, v)


def _step(drafter, kv, table, target, st: _Batch, pad_id: int, eos: set, stats: dict) -> None:
    n = drafter.cfg.num_draft_tokens
    live = [r for r, a in enumerate(st.active) if a]
    dev = table.device
    anchors = torch.tensor([st.anchor[r] for r in live], device=dev)
    start = torch.tensor([len(st.seqs[r]) for r in live], device=dev)
    out = drafter.draft(kv, anchors, start, table[live], None, torch.zeros(len(live), device=dev))
    drafts = out.tokens.tolist()
    rows = [st.seqs[r] + [st.anchor[r]] + d for r, d in zip(live, drafts)]
    width = max(len(x) for x in rows)
    ids = torch.tensor([x + [pad_id] * (width - len(x)) for x in rows], device=target.device)
    states, logits = target.forward(ids)
    spans = []
    for j, r in enumerate(live):
        p0 = len(st.seqs[r])
        pred = logits[j, p0:p0 + n + 1].argmax(-1).tolist()
        k = 0
        while k < n and drafts[j][k] == pred[k]:
            k += 1
        stats["steps"] += 1
        stats["accepted"] += k
        stats["hist"][k] += 1
        new = [st.anchor[r]] + drafts[j][:k]
        spans.append((j, p0, k + 1))
        st.seqs[r] += new
        committed = drafts[j][:k] + [pred[k]]
        stop = next((i for i, t in enumerate(committed) if t in eos), None)
        st.generated[r] += committed if stop is None else committed[:stop + 1]
        st.anchor[r] = pred[k]
        if stop is not None or len(st.generated[r]) >= st.budget:
            st.active[r] = False
    _write_context(drafter, kv, table[live], states, spans)


@torch.no_grad()
def speculative_greedy(target, drafter: DFlash2Drafter, prompts: torch.Tensor, new_tokens: int,
                       batch: int) -> tuple[list[list[int]], dict]:
    """Greedy speculative decoding of `prompts` [P, Lp] for up to `new_tokens` each ->
    (committed tokens per prompt, stats: steps, accepted drafts, histogram of accepted)."""
    c: DraftConfig = drafter.cfg
    n = c.num_draft_tokens
    stats = {"steps": 0, "accepted": 0, "hist": [0] * (n + 1)}
    eos = set(target.cfg.eos_token_id or [])
    pad_id = target.cfg.pad_token_id if target.cfg.pad_token_id is not None else 0
    outputs: list[list[int]] = []
    length = prompts.shape[1] + new_tokens + 2 * n + 2
    per_req = -(-length // KV_BLOCK)
    for i in range(0, prompts.shape[0], batch):
        chunk = prompts[i:i + batch]
        b = chunk.shape[0]
        kv = DraftKV(c, b * per_req, KV_BLOCK, drafter.device, drafter.dtype)
        table = torch.arange(b * per_req, dtype=torch.int32, device=drafter.device).view(b, -1)
        st = _Batch(chunk, new_tokens)
        states, logits = target.forward(chunk.to(target.device))
        lp = chunk.shape[1]
        _write_context(drafter, kv, table, states, [(r, 0, lp) for r in range(b)])
        first = logits[:, -1].argmax(-1).tolist()
        for r in range(b):
            st.anchor[r] = first[r]
            st.generated[r] = [first[r]]
            st.active[r] = first[r] not in eos and new_tokens > 1
        while any(st.active):
            _step(drafter, kv, table, target, st, pad_id, eos, stats)
        outputs += [g[:new_tokens] for g in st.generated]
    return outputs, stats


def summarize(stats: dict) -> dict:
    steps = max(stats["steps"], 1)
    return {"steps": stats["steps"], "mean_accepted_drafts": round(stats["accepted"] / steps, 3),
            "mean_acceptance_length": round(1 + stats["accepted"] / steps, 3),
            "accepted_histogram": stats["hist"]}
