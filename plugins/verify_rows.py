"""beam::verify_rows — a verify step's input rows from the device state of a chained step.

    for each sequence b of B and each of its q rows j (row r = b * q + j, p = start[b] + j):
    input_ids[r]    = anchors[b] if j == 0 else drafts[b, j - 1]
    positions[r]    = p;  q_start[r] = p
    slot_full[r]    = block_table[r, p // block_size] * block_size + p % block_size
    slot_sliding[r] = ring_index[r] * ring_len + p % ring_len
    where live[b] == 0 (a request that ended): the rows of a padding row (token 0 at position 0,
    both slots -1: they write no cache)

What the host fill writes for full verify chunks (beam_trtllm/engine/graphs.py `_fill_rows`),
with each row's block table and ring already in place (the chain keeps its requests in their
rows). Shapes / dtypes: anchors, start [B] int64; live [>= B] int64 (1 live, 0 ended);
drafts [B, >= q - 1] int64 (any strides);
input_ids, positions, slot_full, slot_sliding [>= B * q] int64; q_start [>= B * q] int32;
block_table [>= B * q, W] int32; ring_index [>= B * q, 1] int32. Contract: writes the five
row buffers in place, returns nothing; CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, check_tensor, next_pow2
from .registry import beam_op, dispatch, register

OP = "verify_rows"
OUTS = ("input_ids", "positions", "q_start", "slot_full", "slot_sliding")


@register(OP, "reference")
def ref_verify_rows(anchors, start, drafts, live, block_table, ring_index, input_ids, positions,
                    q_start, slot_full, slot_sliding, q: int, block_size: int,
                    ring_len: int) -> None:
    b = anchors.shape[0]
    n = b * q
    on = (live[:b] != 0).repeat_interleave(q)
    ids = torch.cat([anchors[:, None], drafts[:, :q - 1]], 1).reshape(-1)
    pos = torch.where(on, (start[:, None] + torch.arange(q, device=start.device)).reshape(-1), 0)
    input_ids[:n] = torch.where(on, ids, 0)
    positions[:n] = pos
    q_start[:n] = pos.to(torch.int32)
    block = block_table[:n].gather(1, (pos // block_size)[:, None]).squeeze(1)
    slot_full[:n] = torch.where(on, block.long() * block_size + pos % block_size, -1)
    slot_sliding[:n] = torch.where(on, ring_index[:n, 0].long() * ring_len + pos % ring_len, -1)


@triton.jit
def _verify_rows_kernel(anchors_ptr, start_ptr, drafts_ptr, live_ptr, table_ptr, ring_ptr,
                        ids_ptr, pos_ptr, qs_ptr, full_ptr, sliding_ptr, stride_db, stride_dn,
                        stride_t, stride_r, block_size, ring_len, Q: tl.constexpr,
                        BLOCK_Q: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_Q)
    m = j < Q
    live = tl.load(live_ptr + b) != 0
    draft = tl.load(drafts_ptr + b * stride_db + (j - 1) * stride_dn, mask=m & (j > 0), other=0)
    token = tl.where(live, tl.where(j == 0, tl.load(anchors_ptr + b), draft), 0)
    pos = tl.where(live, tl.load(start_ptr + b) + j, 0)
    row = b * Q + j
    tl.store(ids_ptr + row, token, mask=m)
    tl.store(pos_ptr + row, pos, mask=m)
    tl.store(qs_ptr + row, pos.to(tl.int32), mask=m)
    block = tl.load(table_ptr + row * stride_t + pos // block_size, mask=m, other=0)
    full = block.to(tl.int64) * block_size + pos % block_size
    tl.store(full_ptr + row, tl.where(live, full, -1), mask=m)
    ring = tl.load(ring_ptr + row * stride_r, mask=m, other=0)
    sliding = ring.to(tl.int64) * ring_len + pos % ring_len
    tl.store(sliding_ptr + row, tl.where(live, sliding, -1), mask=m)


@register(OP, "triton")
def _launch_verify_rows(anchors, start, drafts, live, block_table, ring_index, input_ids,
                        positions, q_start, slot_full, slot_sliding, q: int, block_size: int,
                        ring_len: int) -> None:
    b = anchors.shape[0]
    if b == 0:
        return
    _verify_rows_kernel[(b,)](
        anchors, start, drafts, live, block_table, ring_index, input_ids, positions, q_start,
        slot_full, slot_sliding, drafts.stride(0), drafts.stride(1), block_table.stride(0),
        ring_index.stride(0), block_size, ring_len, Q=q, BLOCK_Q=next_pow2(q), num_warps=1)


def check_verify_rows(anchors, start, drafts, live, block_table, ring_index, input_ids,
                      positions, q_start, slot_full, slot_sliding, q, block_size, ring_len) -> None:
    dev, b = anchors.device, anchors.shape[0]
    for name, t, ndim in (("anchors", anchors, 1), ("start", start, 1), ("drafts", drafts, 2),
                          ("live", live, 1)):
        check_tensor(OP, name, t, ndim=ndim, dtypes=(torch.int64,), device=dev)
    check(start.shape[0] == b and drafts.shape[0] == b and drafts.shape[1] >= q - 1
          and live.shape[0] >= b, OP,
          f"start {tuple(start.shape)} / drafts {tuple(drafts.shape)} / live "
          f"{tuple(live.shape)} do not fit {b} "
          f"sequences of {q} rows")
    for name, t, dt in (("input_ids", input_ids, torch.int64),
                        ("positions", positions, torch.int64), ("q_start", q_start, torch.int32), ("slot_full", slot_full, torch.int64),
                        ("slot_sliding", slot_sliding, torch.int64)):
        check_tensor(OP, name, t, ndim=1, dtypes=(dt,), device=dev)
        check(t.shape[0] >= b * q and t.stride(0) == 1, OP,
              f"{name} holds {t.shape[0]} rows, {b} x {q} needed (contiguous)")
    check_tensor(OP, "block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev)
    check_tensor(OP, "ring_index", ring_index, ndim=2, dtypes=(torch.int32,), device=dev)
    check(block_table.shape[0] >= b * q and ring_index.shape[0] >= b * q
          and block_table.stride(1) == 1, OP,
          f"block_table {tuple(block_table.shape)} / ring_index {tuple(ring_index.shape)} "
          f"need {b * q} rows")
    check(q >= 1 and block_size >= 1 and ring_len >= 1, OP,
          f"q {q}, block_size {block_size} and ring_len {ring_len} must be >= 1")


@beam_op("verify_rows", mutates_args=OUTS)
def verify_rows(anchors: torch.Tensor, start: torch.Tensor, drafts: torch.Tensor,
                live: torch.Tensor, block_table: torch.Tensor, ring_index: torch.Tensor,
                input_ids: torch.Tensor,
                positions: torch.Tensor, q_start: torch.Tensor, slot_full: torch.Tensor,
                slot_sliding: torch.Tensor, q: int, block_size: int, ring_len: int) -> None:
    args = (anchors, start, drafts, live, block_table, ring_index, input_ids, positions, q_start,
            slot_full, slot_sliding, q, block_size, ring_len)
    check_verify_rows(*args)
    dispatch(OP, anchors.device, *args)


@verify_rows.register_fake
def _(anchors, start, drafts, live, block_table, ring_index, input_ids, positions, q_start,
      slot_full, slot_sliding, q, block_size, ring_len):
    check_verify_rows(anchors, start, drafts, live, block_table, ring_index, input_ids,
                      positions, q_start, slot_full, slot_sliding, q, block_size, ring_len)
