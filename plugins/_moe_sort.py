"""Token sorting by expert (moe_align) for the grouped GEMMs of the `beam::moe_*` ops.

    sorted_slots [max_rows]    flat slot t*k+j of each row, each expert's rows padded with the
                               sentinel T*k (see "Row blocks" below);
    block_expert [max_blocks]  expert of each row block (-1: idle, its programs exit);
    num_rows [1]               rows in use (a device scalar: no host sync);
    slot_rows [T*k]            the inverse: the row of each slot (prefill's activation quantizer
                               writes each token's codes straight into its k rows).

Row blocks. Each expert's rows are cut into BLOCK_M-row blocks. Without tail blocks its last,
partial block is padded to BLOCK_M as well: on average BLOCK_M / 2 rows of every expert's
work are padding (13.7% of the MMA work at 16K tokens, top-8 of 256, 128-row blocks). With
`tail_m`, a remainder of at most tail_m rows takes a tail_m-row block instead, and the
kernels run that block on a tile of tail_m rows (3.0% padding in the same case); then
    block_start [max_blocks]   first row of each block, block_rows [max_blocks] its tile rows
tell a program where its rows are, and a tail block sits right after its expert's full blocks
(the grouped launch order keeps them sharing the expert's weight tiles in L2).

`max_rows` and `max_blocks` depend only on (T*k, E, BLOCK_M), never on the routing, so the
buffers and grids are the same for every step of a given batch size: CUDA-graph safe. An
expert with no tokens owns no block. For a few token-expert pairs (decode), the kernels skip
the sort and give each pair its own row block ("direct" mode): no align launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ONE_PROGRAM_ALIGN = 4096  # up to this many pairs the token sort is one program (one launch)


@triton.jit
def _expert_rows(counts, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr):
    """Rows each expert takes in the sorted layout (padded) and its number of row blocks."""
    full = counts // BLOCK_M
    rem = counts - full * BLOCK_M
    last = tl.where(rem == 0, 0, BLOCK_M)
    if TAIL_M > 0:
        last = tl.where((rem > 0) & (rem <= TAIL_M), TAIL_M, last)
    return full * BLOCK_M + last, full + (rem > 0).to(tl.int32)


@triton.jit
def _write_block_map(blocks, padded, nblocks, block_expert_ptr, block_start_ptr, block_rows_ptr,
                     max_blocks, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr):
    """Expert (and with tail blocks: first row, tile rows) of row blocks `blocks`."""
    mask = blocks < max_blocks
    if TAIL_M == 0:  # block b holds rows [b * BLOCK_M, (b + 1) * BLOCK_M)
        ends = tl.cumsum(padded, 0)
        first_row = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(first_row < tl.sum(padded, 0), expert, -1),
                 mask=mask)
    else:
        block_ends = tl.cumsum(nblocks, 0)
        expert = tl.sum((block_ends[None, :] <= blocks[:, None]).to(tl.int32), axis=1)
        in_use = blocks < tl.sum(nblocks, 0)
        owner = tl.where(in_use, expert, 0)  # a valid gather index for idle blocks too
        j = blocks - tl.gather(block_ends - nblocks, owner, 0)  # block j of its expert
        first_row = tl.gather(tl.cumsum(padded, 0) - padded, owner, 0) + j * BLOCK_M
        tile_rows = tl.minimum(tl.gather(padded, owner, 0) - j * BLOCK_M, BLOCK_M)
        tl.store(block_expert_ptr + blocks, tl.where(in_use, expert, -1), mask=mask)
        tl.store(block_start_ptr + blocks, first_row, mask=mask & in_use)
        tl.store(block_rows_ptr + blocks, tile_rows, mask=mask & in_use)


@triton.jit
def _align_kernel(ids_ptr, numel, sorted_ptr, slot_rows_ptr, block_expert_ptr, block_start_ptr,
                  block_rows_ptr, num_rows_ptr, cursor_ptr, max_rows, max_blocks, E: tl.constexpr,
                  BINS: tl.constexpr, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr,
                  CHUNK: tl.constexpr, NB: tl.constexpr):
    # One program: count pairs per expert, pad each count (_expert_rows), lay the experts out
    # in order, then scatter each pair to its expert's next free row. Ranks come from atomics,
    # so rows within an expert are unordered; each row's result does not depend on its position.
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=E).to(tl.int32)
        counts += tl.histogram(ids, BINS)
    counts = tl.where(bins < E, counts, 0)  # bin E collected the masked tail
    padded, nblocks = _expert_rows(counts, BLOCK_M, TAIL_M)
    tl.store(num_rows_ptr, tl.sum(padded, 0))
    tl.store(cursor_ptr + bins, tl.cumsum(padded, 0) - padded)
    for start in range(0, max_rows, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + numel, mask=offs < max_rows)
    for start in range(0, max_blocks, NB):
        _write_block_map(start + tl.arange(0, NB), padded, nblocks, block_expert_ptr,
                         block_start_ptr, block_rows_ptr, max_blocks, BLOCK_M, TAIL_M)
    tl.debug_barrier()  # the cursors and the sentinel fill are visible before the scatter
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < numel
        ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
        row = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
        tl.store(sorted_ptr + row, offs, mask=mask)
        tl.store(slot_rows_ptr + offs, row, mask=mask)


@triton.jit
def _count_kernel(ids_ptr, numel, counts_ptr, sorted_ptr, max_rows, E: tl.constexpr,
                  BINS: tl.constexpr, CHUNK: tl.constexpr):
    # Many programs (prefill): histogram of one chunk of pairs into the zeroed counts, and the
    # sentinel fill of the same range of sorted rows.
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=E).to(tl.int32)
    bins = tl.arange(0, BINS)
    tl.atomic_add(counts_ptr + bins, tl.histogram(ids, BINS), mask=bins < E)
    tl.store(sorted_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + numel, mask=offs < max_rows)


@triton.jit
def _scatter_kernel(ids_ptr, numel, counts_ptr, fill_ptr, sorted_ptr, slot_rows_ptr,
                    block_expert_ptr, block_start_ptr, block_rows_ptr, num_rows_ptr, max_blocks,
                    E: tl.constexpr, BINS: tl.constexpr, BLOCK_M: tl.constexpr,
                    TAIL_M: tl.constexpr, CHUNK: tl.constexpr, NB: tl.constexpr):
    # Every program derives the padded layout from the counts (E values), writes its share of
    # the block map, then places its chunk of pairs at start[e] + (atomic) rank.
    pid = tl.program_id(0)
    bins = tl.arange(0, BINS)
    counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
    padded, nblocks = _expert_rows(counts, BLOCK_M, TAIL_M)
    if pid == 0:
        tl.store(num_rows_ptr, tl.sum(padded, 0))
    _write_block_map(pid * NB + tl.arange(0, NB), padded, nblocks, block_expert_ptr,
                     block_start_ptr, block_rows_ptr, max_blocks, BLOCK_M, TAIL_M)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    mask = offs < numel
    ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    rank = tl.atomic_add(fill_ptr + ids, 1, mask=mask)
    row = tl.gather(tl.cumsum(padded, 0) - padded, ids, 0) + rank
    tl.store(sorted_ptr + row, offs, mask=mask)
    tl.store(slot_rows_ptr + offs, row, mask=mask)


@dataclass
class Routing:
    """Where each (token, expert) pair goes in the grouped GEMMs (see the module docstring)."""

    direct: bool
    block_m: int
    m_blocks: int  # row blocks of the grid (pairs in direct mode)
    rows: int  # rows of the intermediate buffer h
    ids: torch.Tensor  # topk_ids, contiguous
    sorted_slots: torch.Tensor | None = None
    block_expert: torch.Tensor | None = None
    num_rows: torch.Tensor | None = None
    tail_m: int = 0  # > 0: tail blocks (block_start / block_rows say where each block is)
    block_start: torch.Tensor | None = None
    block_rows: torch.Tensor | None = None
    slot_rows: torch.Tensor | None = None  # row of each slot (sorted modes)


def max_sorted_rows(numel: int, num_experts: int, block_m: int) -> int:
    """Rows after padding every non-empty expert to block_m (at most min(numel, E) of them);
    tail blocks pad less, so this bounds their layout too."""
    return triton.cdiv(numel + min(numel, num_experts) * (block_m - 1), block_m) * block_m


def max_row_blocks(numel: int, num_experts: int, block_m: int, tail_m: int) -> int:
    if not tail_m:
        return max_sorted_rows(numel, num_experts, block_m) // block_m
    return numel // block_m + min(numel, num_experts)  # full blocks + one partial per expert


def plan_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int, direct: bool,
                 tail_m: int = 0) -> Routing:
    ids = topk_ids.contiguous()
    numel = ids.numel()
    if direct:
        return Routing(True, block_m, numel, numel, ids)
    rows = max_sorted_rows(numel, num_experts, block_m)
    blocks = max_row_blocks(numel, num_experts, block_m, tail_m)
    dev = ids.device
    sorted_slots = torch.empty(rows, dtype=torch.int32, device=dev)
    slot_rows = torch.empty(numel, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    num_rows = torch.empty(1, dtype=torch.int32, device=dev)
    block_start = block_rows = None
    if tail_m:  # idle blocks' entries stay unwritten: their programs exit on block_expert -1
        block_start = torch.empty(blocks, dtype=torch.int32, device=dev)
        block_rows = torch.empty(blocks, dtype=torch.int32, device=dev)
    maps = (block_expert, block_start if tail_m else block_expert,
            block_rows if tail_m else block_expert)
    bins = triton.next_power_of_2(num_experts + 1)
    nb = max(16, 8192 // bins)
    if numel <= ONE_PROGRAM_ALIGN:  # one launch: decode batches
        cursor = torch.empty(bins, dtype=torch.int32, device=dev)
        _align_kernel[(1,)](ids, numel, sorted_slots, slot_rows, *maps, num_rows, cursor, rows, blocks,
                            E=num_experts, BINS=bins, BLOCK_M=block_m, TAIL_M=tail_m, CHUNK=1024,
                            NB=nb, num_warps=8)
    else:  # prefill: count, then scatter, over many programs (one program took 0.7 ms at 128K)
        counts = torch.zeros(2 * bins, dtype=torch.int32, device=dev)  # counts, then cursors
        chunk = 1024
        _count_kernel[(triton.cdiv(max(numel, rows), chunk),)](
            ids, numel, counts, sorted_slots, rows, E=num_experts, BINS=bins, CHUNK=chunk,
            num_warps=4)
        grid = max(triton.cdiv(numel, chunk), triton.cdiv(blocks, nb))
        _scatter_kernel[(grid,)](ids, numel, counts, counts[bins:], sorted_slots, slot_rows,
                                 *maps, num_rows, blocks, E=num_experts, BINS=bins, BLOCK_M=block_m,
                                 TAIL_M=tail_m, CHUNK=chunk, NB=nb, num_warps=4)
    return Routing(False, block_m, blocks, rows, ids, sorted_slots, block_expert, num_rows,
                   tail_m, block_start, block_rows, slot_rows)


def routing_ptrs(routing: Routing) -> tuple:
    """(ids, sorted_slots, block_expert, num_rows) kernel args; direct mode passes ids for the
    three it never reads."""
    if routing.direct:
        return (routing.ids,) * 4
    return routing.ids, routing.sorted_slots, routing.block_expert, routing.num_rows


def tail_ptrs(routing: Routing) -> tuple:
    """(block_start, block_rows) kernel args of tail blocks; ids (never read) without them."""
    if routing.tail_m:
        return routing.block_start, routing.block_rows
    return routing.ids, routing.ids
