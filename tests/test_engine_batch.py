"""build_step (beam_trtllm/engine/batch.py): a step's index tensors, packed into one host
buffer and copied once, keep each field's dtype, shape and values: a prefix-cached prefill
chunk, a decode chunk and a verify chunk with drafts in one step."""

from __future__ import annotations

import torch

from beam_trtllm.engine.batch import build_step
from beam_trtllm.engine.request import Chunk, Request
from beam_trtllm.engine.types import SamplingParams

BS, WINDOW, RING = 4, 4, 8  # block size, sliding window, ring length


def _request(rid, n_prompt, blocks, ring_row, full_cached=0, outputs=()):
    r = Request(rid, list(range(100, 100 + n_prompt)), SamplingParams(), 0, 64)
    r.block_ids, r.ring_row, r.full_cached = blocks, ring_row, full_cached
    r.output_ids = list(outputs)
    return r


def test_fields_of_a_mixed_step():
    pre = _request("pre", 10, [3, 9, 4], 0, full_cached=4)   # 4 cached, 6 computed now
    dec = _request("dec", 5, [7, 2], 1, outputs=[55])           # position 5, one token
    ver = _request("ver", 3, [1, 6], 2, outputs=[66])           # position 3 + 2 drafts
    chunks = [Chunk(pre, 0, 10), Chunk(dec, 5, 1), Chunk(ver, 3, 3, drafts=(77, 78))]
    s = build_step(chunks, BS, WINDOW, torch.device("cpu"), ring_len=RING)
    want = {
        "input_ids": (torch.int64, list(range(100, 110)) + [55, 66, 77, 78]),
        "positions": (torch.int64, list(range(10)) + [5, 3, 4, 5]),
        "cu_seqlens": (torch.int32, [0, 10, 11, 12, 13, 14]),
        "q_start": (torch.int32, [0, 5, 3, 4, 5]),
        "hist_full": (torch.int32, [0] * 5),
        "hist_sliding": (torch.int32, [0] * 5),
        "slot_full": (torch.int64, [-1] * 4 + [36, 37, 38, 39, 16, 17] + [9, 7, 24, 25]),
        # the 10-token chunk is longer than RING - WINDOW + 1: its ring slots are written later
        "slot_sliding": (torch.int64, [-1] * 10 + [13, 19, 20, 21]),
        "write_rows": (torch.int64, [6, 7, 8, 9]),
        "write_slots": (torch.int64, [6, 7, 0, 1]),
        "restore_rows": (torch.int64, [0, 1, 2, 3]),
        "restore_slots": (torch.int64, [12, 13, 14, 15]),
        "logits_rows": (torch.int64, [9, 10, 11, 12, 13]),
    }
    for name, (dtype, values) in want.items():
        t = getattr(s, name)
        assert t.dtype == dtype and t.is_contiguous(), name
        assert t.tolist() == values, name
    assert s.block_table.dtype == torch.int32 and s.block_table.tolist() == [
        [3, 9, 4], [7, 2, 0], [1, 6, 0], [1, 6, 0], [1, 6, 0]]
    assert s.ring_index.dtype == torch.int32 and s.ring_index.tolist() == [[0], [1], [2], [2], [2]]
