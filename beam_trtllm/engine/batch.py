"""Turning a step's chunks into the ops' index tensors (docs/DESIGN.md §2-§3).

Per token at position p of a request with block table `blocks` and ring row `r`:
- full layers write slot blocks[p // bs] * bs + p % bs, except positions the prefix cache
  already holds (p < full_cached): those are not rewritten (the blocks may be shared) and the
  attention takes their K/V from the cache instead of the recomputed values (`restore_*`);
- sliding layers write slot r * ring_len + p % ring_len directly when the chunk has at most
  ring_len - window + 1 tokens (a decode, or a verify chunk of a speculative step: the ring
  has room for its drafts); a longer chunk passes -1 and its last `window` tokens are stored
  after the attention (`write_*`), because an early store would overwrite keys that the
  chunk's own earlier queries still read.
Logits are read at a chunk's last row, or at every row from its last known token on (a verify
chunk: the known token and its drafts).
"""

from __future__ import annotations

import torch

from .model import StepInputs
from .request import Chunk


def build_step(chunks: list[Chunk], block_size: int, window: int, device: torch.device,
               table_width: int | None = None, ring_len: int | None = None) -> StepInputs:
    ring_len = ring_len or window
    direct = ring_len - window + 1  # chunks this short store their ring slots before attending
    ids, pos, cu, q_start, hist = [], [], [0], [], []
    slot_full, slot_sliding, write_rows, write_slots = [], [], [], []
    restore_rows, restore_slots, logits_rows, tables, rings = [], [], [], [], []
    for c in chunks:
        req = c.request
        base = len(ids)
        ids += c.token_ids
        positions = range(c.start, c.start + c.n)
        pos += positions
        # a verify chunk attends as c.n one-token sequences, each query at its own position
        # over the cache its earlier rows were just stored into (qk_prep, direct ring slots):
        # every row computes what a decode step at that position computes, bit for bit
        for lo in ((c.start,) if not c.drafts else positions):
            cu.append(base + lo - c.start + (c.n if not c.drafts else 1))
            q_start.append(lo)
            hist.append(req.hist_start)
            tables.append(req.block_ids)
            rings.append(req.ring_row)
        ring_base = req.ring_row * ring_len
        for t, p in enumerate(positions):
            slot = req.block_ids[p // block_size] * block_size + p % block_size
            if p < req.full_cached:
                slot_full.append(-1)
                restore_rows.append(base + t)
                restore_slots.append(slot)
            else:
                slot_full.append(slot)
            if c.n <= direct:
                slot_sliding.append(ring_base + p % ring_len)
            else:
                slot_sliding.append(-1)
                if t >= c.n - window:
                    write_rows.append(base + t)
                    write_slots.append(ring_base + p % ring_len)
        if c.samples:
            logits_rows += range(len(ids) - 1 - len(c.drafts), len(ids))
    width = table_width or max(1, max(len(t) for t in tables))
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, :len(t)] = torch.tensor(t, dtype=torch.int32)

    def i64(v):
        return torch.tensor(v, dtype=torch.int64, device=device)

    def i32(v):
        return torch.tensor(v, dtype=torch.int32, device=device)

    return StepInputs(
        input_ids=i64(ids), positions=i64(pos), cu_seqlens=i32(cu), q_start=i32(q_start),
        hist_full=i32([0] * len(q_start)), hist_sliding=i32(hist), block_table=table.to(device),
        ring_index=i32(rings).view(-1, 1), slot_full=i64(slot_full), slot_sliding=i64(slot_sliding),
        write_rows=i64(write_rows), write_slots=i64(write_slots), restore_rows=i64(restore_rows),
        restore_slots=i64(restore_slots), logits_rows=i64(logits_rows))
