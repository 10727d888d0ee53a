"""beam::spec_accept — greedy acceptance of a verify step's drafts, on the device.

    for each sequence b of B (its q = 1 + n rows: the known token, then n drafts):
    accepted[b]   = max a <= n with ids[b, 1 + j] == top[b * q + j] for every j < a
    anchors[b]    = top[b * q + accepted[b]]           (the correction or bonus token)
    next_start[b] = start[b] + accepted[b] + 1         (its position)
    packed[b, :q] = top[b * q : b * q + q];  packed[b, q] = accepted[b]   (as float64: exact)
    where live[b] == 0 (a request that ended): anchors[b] = 0, next_start[b] = pad_start
    (the draft graph's padding start: its draft then touches scratch slots only)

Shapes / dtypes: live [>= B] int64 (1 live, 0 ended); top [>= B * q] int64 (argmax of each
verify row's logits); ids [B, q] int64 and start [B] int64 (any strides: views of a verify graph's input buffers); anchors and
next_start [>= B] int64 (the draft graph's inputs), packed [>= B, >= q + 1] float64 with a unit
last stride (what the host reads). Contract: writes anchors, next_start and packed in place,
returns nothing; CUDA-graph safe (no host reads). The chained speculative steps use it
(beam_trtllm/engine/spec_chain.py): one launch instead of a dozen small torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, check_tensor, next_pow2
from .registry import beam_op, dispatch, register

OP = "spec_accept"


@register(OP, "reference")
def ref_spec_accept(top, ids, start, live, anchors, next_start, packed, pad_start: int) -> None:
    b, q = ids.shape
    rows = top[:b * q].view(b, q)
    accepted = (ids[:, 1:] == rows[:, :-1]).long().cumprod(1).sum(1)
    on = live[:b] != 0
    anchors[:b] = torch.where(on, rows.gather(1, accepted[:, None]).squeeze(1), 0)
    next_start[:b] = torch.where(on, start + accepted + 1, pad_start)
    packed[:b, :q] = rows.double()
    packed[:b, q] = accepted.double()


@triton.jit
def _spec_accept_kernel(top_ptr, ids_ptr, start_ptr, live_ptr, anchors_ptr, next_ptr,
                        packed_ptr, pad_start, stride_ib, stride_iq, stride_s, stride_pb,
                        Q: tl.constexpr,
                        BLOCK_Q: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_Q)
    in_row = j < Q
    top = tl.load(top_ptr + b * Q + j, mask=in_row, other=-1)
    draft = tl.load(ids_ptr + b * stride_ib + (j + 1) * stride_iq, mask=j < Q - 1, other=-1)
    # the first row whose draft misses (the last row has none: it is the bonus position)
    miss = tl.where((j < Q - 1) & (draft == top), BLOCK_Q, j)
    accepted = tl.min(miss, axis=0)
    anchor = tl.sum(tl.where(j == accepted, top, 0), axis=0)
    start = tl.load(start_ptr + b * stride_s)
    live = tl.load(live_ptr + b) != 0
    tl.store(anchors_ptr + b, tl.where(live, anchor, 0))
    tl.store(next_ptr + b, tl.where(live, start + accepted + 1, pad_start))
    tl.store(packed_ptr + b * stride_pb + j, top.to(tl.float64), mask=in_row)
    tl.store(packed_ptr + b * stride_pb + Q, accepted.to(tl.float64))


@register(OP, "triton")
def _launch_spec_accept(top, ids, start, live, anchors, next_start, packed,
                        pad_start: int) -> None:
    b, q = ids.shape
    if b == 0:
        return
    _spec_accept_kernel[(b,)](top, ids, start, live, anchors, next_start, packed, pad_start,
                              ids.stride(0), ids.stride(1), start.stride(0), packed.stride(0),
                              Q=q, BLOCK_Q=next_pow2(q), num_warps=1)


def check_spec_accept(top, ids, start, live, anchors, next_start, packed) -> None:
    for name, t, ndim in (("top", top, 1), ("ids", ids, 2), ("start", start, 1), ("live", live, 1),
                          ("anchors", anchors, 1), ("next_start", next_start, 1)):
        check_tensor(OP, name, t, ndim=ndim, dtypes=(torch.int64,), device=ids.device)
    check_tensor(OP, "packed", packed, ndim=2, dtypes=(torch.float64,), device=ids.device)
    b, q = ids.shape
    check(q >= 1 and top.shape[0] >= b * q, OP,
          f"top has {top.shape[0]} rows, ids [{b}, {q}] need {b * q}")
    check(start.shape[0] == b and live.shape[0] >= b, OP,
          f"start / live have {start.shape[0]} / {live.shape[0]} entries for {b} sequences")
    check(anchors.shape[0] >= b and next_start.shape[0] >= b, OP,
          f"anchors / next_start hold {anchors.shape[0]} / {next_start.shape[0]} of {b} sequences")
    check(packed.shape[0] >= b and packed.shape[1] >= q + 1 and packed.stride(1) == 1, OP,
          f"packed {tuple(packed.shape)} must be [>= {b}, >= {q + 1}], contiguous rows")


@beam_op("spec_accept", mutates_args=("anchors", "next_start", "packed"))
def spec_accept(top: torch.Tensor, ids: torch.Tensor, start: torch.Tensor, live: torch.Tensor,
                anchors: torch.Tensor, next_start: torch.Tensor, packed: torch.Tensor,
                pad_start: int) -> None:
    check_spec_accept(top, ids, start, live, anchors, next_start, packed)
    dispatch(OP, ids.device, top, ids, start, live, anchors, next_start, packed, pad_start)


@spec_accept.register_fake
def _(top, ids, start, live, anchors, next_start, packed, pad_start):
    check_spec_accept(top, ids, start, live, anchors, next_start, packed)
