"""Turning a step's chunks into the ops' index tensors (docs/DESIGN.md §2-§3).

Per token at position p of a request with block table `blocks` and ring row `r`:
- full layers write slot blocks[p // bs] * bs + p % bs, except positions the prefix cache
  already holds (p < full_cached): those are not rewritten (the blocks may be shared) and the
  attention takes their K/V from the cache instead of the recomputed values (`restore_*`);
- sliding layers write slot r * window + p % window directly when the request's chunk is one
  token (decode); a multi-token chunk passes -1 and its last `window` tokens are stored after
  the attention (`write_*`), because an early store would overwrite keys that the chunk's own
  earlier queries still read.
"""

from __future__ import annotations

import torch

from .model import StepInputs
from .request import Chunk


def build_step(chunks: list[Chunk], block_size: int, window: int, device: torch.device,
               table_width: int | None = None) -> StepInputs:
    ids, pos, cu, q_start, hist = [], [], [0], [], []
    slot_full, slot_sliding, write_rows, write_slots = [], [], [], []
    restore_rows, restore_slots, logits_rows, tables, rings = [], [], [], [], []
    for c in chunks:
        req = c.request
        base = len(ids)
        tokens = req.all_ids[c.start:c.start + c.n]
        ids += tokens
        positions = range(c.start, c.start + c.n)
        pos += positions
        cu.append(len(ids))
        q_start.append(c.start)
        hist.append(req.hist_start)
        tables.append(req.block_ids)
        rings.append(req.ring_row)
        ring_base = req.ring_row * window
        for t, p in enumerate(positions):
            slot = req.block_ids[p // block_size] * block_size + p % block_size
            if p < req.full_cached:
                slot_full.append(-1)
                restore_rows.append(base + t)
                restore_slots.append(slot)
            else:
                slot_full.append(slot)
            if c.n == 1:
                slot_sliding.append(ring_base + p % window)
            else:
                slot_sliding.append(-1)
                if t >= c.n - window:
                    write_rows.append(base + t)
                    write_slots.append(ring_base + p % window)
        if c.samples:
            logits_rows.append(len(ids) - 1)
    width = table_width or max(1, max(len(t) for t in tables))
    table = torch.zeros(len(chunks), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, :len(t)] = torch.tensor(t, dtype=torch.int32)

    def i64(v):
        return torch.tensor(v, dtype=torch.int64, device=device)

    def i32(v):
        return torch.tensor(v, dtype=torch.int32, device=device)

    return StepInputs(
        input_ids=i64(ids), positions=i64(pos), cu_seqlens=i32(cu), q_start=i32(q_start),
        hist_full=i32([0] * len(chunks)), hist_sliding=i32(hist), block_table=table.to(device),
        ring_index=i32(rings).view(-1, 1), slot_full=i64(slot_full), slot_sliding=i64(slot_sliding),
        write_rows=i64(write_rows), write_slots=i64(write_slots), restore_rows=i64(restore_rows),
        restore_slots=i64(restore_slots), logits_rows=i64(logits_rows))
