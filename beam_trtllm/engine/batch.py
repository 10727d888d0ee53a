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

import numpy as np
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
    table = np.zeros((len(tables), width), dtype=np.int64)
    for b, t in enumerate(tables):
        table[b, :len(t)] = t
    i64 = {"input_ids": ids, "positions": pos, "slot_full": slot_full,
           "slot_sliding": slot_sliding, "write_rows": write_rows, "write_slots": write_slots,
           "restore_rows": restore_rows, "restore_slots": restore_slots,
           "logits_rows": logits_rows}
    i32 = {"cu_seqlens": cu, "q_start": q_start, "hist_full": [0] * len(q_start),
           "hist_sliding": hist, "ring_index": rings}
    t = _to_device(i64, i32, table, device)
    t["ring_index"] = t["ring_index"].view(-1, 1)
    return StepInputs(**t)


def _to_device(i64: dict, i32: dict, table: np.ndarray, device: torch.device) -> dict:
    """The step's index lists (int64 and int32 ones, by field) and its block table [B, M]
    (int32, `block_table`) as device tensors: one pinned host buffer, one copy, views of it.
    Fifteen small pageable copies took ~15 us each on the H200's host, and each waited for
    the GPU."""
    names = list(i64) + list(i32)
    lists = list(i64.values()) + list(i32.values())
    sizes = [len(x) for x in lists] + [table.size]
    host = np.empty(sum(sizes), dtype=np.int64)
    at = 0
    for x in lists:
        host[at:at + len(x)] = x
        at += len(x)
    host[at:] = table.reshape(-1)
    buf = torch.from_numpy(host)
    if device.type == "cuda":  # (the caching host allocator keeps the block until the copy ran)
        buf = buf.pin_memory().to(device, non_blocking=True)
    n64 = sum(sizes[:len(i64)])
    parts = (list(buf[:n64].split(sizes[:len(i64)])) +
             list(buf[n64:].to(torch.int32).split(sizes[len(i64):])))
    out = dict(zip(names, parts))
    out["block_table"] = parts[-1].view(table.shape)
    return out
