"""The MoE token sort (plugins/_moe_sort.py, moe_align) in Triton's interpreter on the CPU (on a
GPU machine there instead, KERNEL_DEVICE): every (token, expert) pair placed exactly once, each
expert's rows padded into whole blocks or tail blocks, the inverse slot -> row map, on both the
one-program (decode) and the many-program (prefill) paths."""

import pytest
import torch

import plugins  # noqa: F401

from _moe_testdata import ids_with_counts, random_routing
from kernel_cases import KERNEL_DEVICE
from plugins import _moe_common, _moe_sort

pytestmark = pytest.mark.kernel

E, K = 8, 4
# tail blocks: remainders of 0, 1..tail, > tail rows, empty experts, several full blocks
SKEWED = [70, 100, 16, 17, 0, 64, 5, 33]


def _expected_layout(counts, block_m, tail_m):
    """Each expert's padded rows and (first row, tile rows) of its blocks, from the counts."""
    layout, row = [], 0
    for count in counts.tolist():
        blocks = [(row + i * block_m, block_m) for i in range(count // block_m)]
        rem = count % block_m
        if rem:
            size = tail_m if 0 < rem <= tail_m else block_m
            blocks.append((row + count // block_m * block_m, size))
        padded = sum(size for _, size in blocks)
        layout.append((row, padded, blocks))
        row += padded
    return layout


@pytest.mark.parametrize("t,experts,one_program,tail_m",
                         [(1, None, 4096, 0), (37, 5, 4096, 0), (40, 1, 4096, 0), (37, 5, 16, 0),
                          (300, None, 64, 0), ("skewed", None, 4096, 16),
                          ("skewed", None, 64, 16), ("skewed", None, 4096, 32),
                          (300, None, 64, 32)])
def test_align_places_every_pair_exactly_once(t, experts, one_program, tail_m, monkeypatch):
    # one_program < T*k takes the many-program path (count, then scatter) used for prefill
    monkeypatch.setattr(_moe_sort, "ONE_PROGRAM_ALIGN", one_program)
    k, block_m = (1, 16) if experts == 1 else (K, 16 if tail_m == 0 else 64)
    if t == "skewed":
        ids = ids_with_counts(SKEWED, 1)
    else:
        ids, _ = random_routing(t, E, k, seed=t, experts=experts)
    r = _moe_common.plan_routing(ids.to(KERNEL_DEVICE), E, block_m, direct=False, tail_m=tail_m)
    numel = ids.numel()
    assert r.rows == _moe_common.max_sorted_rows(numel, E, block_m)
    assert r.m_blocks == _moe_common.max_row_blocks(numel, E, block_m, tail_m)
    slots, owners = r.sorted_slots.long().cpu(), r.block_expert.long().cpu()
    layout = _expected_layout(torch.bincount(ids.flatten().long(), minlength=E), block_m, tail_m)
    block = 0
    for e, (start, padded, blocks) in enumerate(layout):
        rows = slots[start: start + padded]
        want = (ids.flatten() == e).nonzero().flatten()
        assert sorted(rows[rows < numel].tolist()) == want.tolist()
        assert (rows[rows >= numel] == numel).all()  # padding holds the sentinel
        for first_row, size in blocks:
            assert int(owners[block]) == e
            if tail_m:
                assert (int(r.block_start[block]), int(r.block_rows[block])) == (first_row, size)
            else:
                assert first_row == block * block_m
            block += 1
    total = sum(padded for _, padded, _ in layout)
    assert int(r.num_rows.cpu()) == total
    slot_rows = r.slot_rows.long().cpu()  # the inverse map: slot -> its row
    assert torch.equal(slots[slot_rows], torch.arange(numel))
    assert (slots[total:] == numel).all()
    assert (owners[block:] == -1).all()
    if t == "skewed":  # the layout has tail blocks and blocks padded whole
        assert (r.block_rows[:block] == tail_m).any() and (r.block_rows[:block] == 64).any()
