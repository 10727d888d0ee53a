"""What the four `beam::moe_*` ops share: input checks, the reference MoE math, token sorting by
expert (moe_align), the weighted combine and the launch configuration.

Data flow of every MoE kernel (T tokens, k experts each, E experts, H hidden, I expert width):

    moe_align(topk_ids)  -> sorted_slots [max_rows]   flat slot t*k+j of each row, padded per
                            expert to a multiple of BLOCK_M with the sentinel T*k;
                            block_expert [max_rows / BLOCK_M]  expert of each row block (-1: idle);
                            num_rows [1]  rows in use (a device scalar: no host sync)
    gemm13  rows r:      h[r] = silu(x[slot // k] @ gate_e^T) * (x[slot // k] @ up_e^T)   [max_rows, I]
    gemm2   rows r:      y[slot] = h[r] @ down_e^T                                    [T*k, H]
    combine:             out[t] = sum_j float(y[t*k+j]) * topk_weights[t, j]          [T, H]

`max_rows` depends only on (T*k, E, BLOCK_M), never on the routing, so the buffers and grids
are the same for every step of a given batch size: CUDA-graph safe. An expert with no tokens
owns no block. For a few token-expert pairs (decode), the kernels skip the sort and give each
pair its own row block ("direct" mode): no align launch, and each pair reads its expert once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._checks import ACT_DTYPES, _expect, check_tensor
from ._common import TL_DTYPES  # noqa: F401  (re-exported)
from ._gemm import round_to
from .registry import PluginError

DIRECT_MAX_PAIRS = 64  # at most this many (token, expert) pairs: no sort, one pair per block
ONE_PROGRAM_ALIGN = 4096  # up to this many pairs the token sort is one program (one launch)


# ---------------------------------------------------------------------------- input checks
def check_routing(op: str, x, topk_ids, topk_weights, x_dtypes=ACT_DTYPES) -> tuple[int, int, int]:
    check_tensor(op, "x", x, (None, None), x_dtypes)
    t, h = x.shape
    check_tensor(op, "topk_ids", topk_ids, (t, None), (torch.int32, torch.int64))
    check_tensor(op, "topk_weights", topk_weights, (t, topk_ids.shape[1]), (torch.float32,))
    for name, other in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        _expect(other.device == x.device, op, f"{name} is on {other.device}, x on {x.device}")
    return t, h, topk_ids.shape[1]


def check_expert_weights(op, x, w13, w2, dtypes, pack: int = 1) -> tuple[int, int]:
    """w13 [E, 2I, H/pack], w2 [E, H, I/pack] (pack = 2 for two FP4 codes a byte) -> (E, I)."""
    h = x.shape[1]
    check_tensor(op, "w13", w13, (None, None, h // pack), dtypes)
    e, two_i = w13.shape[:2]
    _expect(two_i % 2 == 0, op, f"w13 has {two_i} rows; expected 2*I (gate rows, then up rows)")
    check_tensor(op, "w2", w2, (e, h, two_i // 2 // pack), dtypes)
    for name, w in (("w13", w13), ("w2", w2)):
        _expect(w.device == x.device, op, f"{name} is on {w.device}, x on {x.device}")
        _expect(w.is_contiguous(), op, f"{name} must be contiguous")
    return e, two_i // 2


def check_ids_in_range(op: str, topk_ids: torch.Tensor, num_experts: int) -> None:
    """Reference path only: a device check would need a host sync (the router guarantees it)."""
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise PluginError(f"beam::{op}: topk_ids has ids outside [0, {num_experts})")


# ---------------------------------------------------------------------------- reference math
def ref_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    quant13: Callable[[torch.Tensor], torch.Tensor] | None = None,
    quant2: Callable[[torch.Tensor], torch.Tensor] | None = None,
    act_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """reference.py's BeamMoE.forward given the routing; `expert(e)` returns that expert's
    (w13 [2I, H], w2 [H, I]).

    Unquantized (no quantizers, weights in x.dtype): BeamMoE op for op. Quantized formats
    (weights decoded to FP32, quant13 / quant2 = the kernel's activation quantizers, identity
    for W4A16): the GEMMs run in FP32 on the exactly decoded values, as the tensor cores do,
    and every module output (gate, up, silu, h, y) is rounded to x.dtype as in BeamMoE. With
    FP32 activations this is BeamMoE on the decoded weights exactly; with BF16 it differs from
    a BF16 BeamMoE only by BeamMoE's own rounding of the decoded weights to BF16. `act_dtype`
    (default x.dtype) is the activations' dtype when x holds decoded FP8 codes in FP32."""
    quantized = quant13 is not None
    act = act_dtype or x.dtype
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13, w2 = expert(e)
        inner = w13.shape[0] // 2
        xe = quant13(x[token].float()) if quantized else x[token]
        gate = F.linear(xe, w13[:inner]).to(act)
        up = F.linear(xe, w13[inner:]).to(act)
        h = F.silu(gate) * up
        y = F.linear(quant2(h.float()) if quantized else h, w2).to(act)
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None])
    return out.to(act)


def fake_moe(x: torch.Tensor, *args) -> torch.Tensor:
    return torch.empty_like(x)


# ---------------------------------------------------------------------------- token sorting
@triton.jit
def _align_kernel(ids_ptr, numel, sorted_ptr, block_expert_ptr, num_rows_ptr, cursor_ptr,
                  max_rows, max_blocks, E: tl.constexpr, BINS: tl.constexpr,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, NB: tl.constexpr):
    # One program: count pairs per expert, pad each count to BLOCK_M, lay the experts out in
    # order, then scatter each pair to its expert's next free row. Ranks come from atomics, so
    # rows within an expert are unordered; each row's result does not depend on its position.
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=E).to(tl.int32)
        counts += tl.histogram(ids, BINS)
    counts = tl.where(bins < E, counts, 0)  # bin E collected the masked tail
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(num_rows_ptr, total)
    tl.store(cursor_ptr + bins, ends - padded)
    for start in range(0, max_rows, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + numel, mask=offs < max_rows)
    for start in range(0, max_blocks, NB):
        blocks = start + tl.arange(0, NB)
        first_row = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        expert = tl.where(first_row < total, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < max_blocks)
    tl.debug_barrier()  # the cursors and the sentinel fill are visible before the scatter
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < numel
        ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
        row = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
        tl.store(sorted_ptr + row, offs, mask=mask)


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
def _scatter_kernel(ids_ptr, numel, counts_ptr, fill_ptr, sorted_ptr, block_expert_ptr,
                    num_rows_ptr, max_blocks, E: tl.constexpr, BINS: tl.constexpr,
                    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, NB: tl.constexpr):
    # Every program derives the padded layout from the counts (E values), writes its share of
    # the block -> expert map, then places its chunk of pairs at start[e] + (atomic) rank.
    pid = tl.program_id(0)
    bins = tl.arange(0, BINS)
    counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    if pid == 0:
        tl.store(num_rows_ptr, total)
    blocks = pid * NB + tl.arange(0, NB)
    first_row = blocks * BLOCK_M
    expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + blocks, tl.where(first_row < total, expert, -1),
             mask=blocks < max_blocks)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    mask = offs < numel
    ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    rank = tl.atomic_add(fill_ptr + ids, 1, mask=mask)
    start = tl.gather(ends - padded, ids, 0)
    tl.store(sorted_ptr + start + rank, offs, mask=mask)


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


def max_sorted_rows(numel: int, num_experts: int, block_m: int) -> int:
    """Rows after padding every non-empty expert to block_m (at most min(numel, E) of them)."""
    return triton.cdiv(numel + min(numel, num_experts) * (block_m - 1), block_m) * block_m


def plan_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int, direct: bool) -> Routing:
    ids = topk_ids.contiguous()
    numel = ids.numel()
    if direct:
        return Routing(True, block_m, numel, numel, ids)
    rows = max_sorted_rows(numel, num_experts, block_m)
    dev = ids.device
    sorted_slots = torch.empty(rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=dev)
    num_rows = torch.empty(1, dtype=torch.int32, device=dev)
    bins = triton.next_power_of_2(num_experts + 1)
    nb = max(16, 8192 // bins)
    if numel <= ONE_PROGRAM_ALIGN:  # one launch: decode batches
        cursor = torch.empty(bins, dtype=torch.int32, device=dev)
        _align_kernel[(1,)](ids, numel, sorted_slots, block_expert, num_rows, cursor, rows,
                            rows // block_m, E=num_experts, BINS=bins, BLOCK_M=block_m,
                            CHUNK=1024, NB=nb, num_warps=8)
    else:  # prefill: count, then scatter, over many programs (one program took 0.7 ms at 128K)
        counts = torch.zeros(2 * bins, dtype=torch.int32, device=dev)  # counts, then cursors
        chunk = 1024
        _count_kernel[(triton.cdiv(max(numel, rows), chunk),)](
            ids, numel, counts, sorted_slots, rows, E=num_experts, BINS=bins, CHUNK=chunk,
            num_warps=4)
        grid = max(triton.cdiv(numel, chunk), triton.cdiv(rows // block_m, nb))
        _scatter_kernel[(grid,)](ids, numel, counts, counts[bins:], sorted_slots, block_expert,
                                 num_rows, rows // block_m, E=num_experts, BINS=bins,
                                 BLOCK_M=block_m, CHUNK=chunk, NB=nb, num_warps=4)
    return Routing(False, block_m, rows // block_m, rows, ids, sorted_slots, block_expert, num_rows)


# ---------------------------------------------------------------------------- row blocks
@triton.jit
def past_last_row(pid_m, num_rows_ptr, DIRECT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Whether row block pid_m is beyond the rows the token sort filled (its program exits);
    never in direct mode (one pair per block)."""
    if DIRECT:
        past = False
    else:
        past = pid_m * BLOCK_M >= tl.load(num_rows_ptr)
    return past


@triton.jit
def block_tile(pid_m, pid_n, ids_ptr, sorted_ptr, block_expert_ptr, numel, top_k, N,
               GATED: tl.constexpr, DIRECT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The tile of program (pid_m, pid_n) of a grouped GEMM: (expert, slot of each row, row
    valid, row of the h buffer, activation row of each row (the token, slot // top_k, for
    gate/up; the h row for down), output channels offs_n [BLOCK_N] and their mask < N)."""
    expert, slots, valid, rows = block_rows(pid_m, ids_ptr, sorted_ptr, block_expert_ptr, numel,
                                            DIRECT, BLOCK_M)
    a_rows = (slots // top_k) if GATED else rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, slots, valid, rows, a_rows, offs_n, offs_n < N


@triton.jit
def block_rows(pid_m, ids_ptr, sorted_ptr, block_expert_ptr, numel, DIRECT: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """(expert int64, slot of each row, row valid, row of the h buffer) of one row block."""
    offs = tl.arange(0, BLOCK_M)
    if DIRECT:  # one (token, expert) pair per block: row 0 only
        expert = tl.load(ids_ptr + pid_m).to(tl.int64)
        slots = pid_m + offs * 0
        valid = offs == 0
        rows = slots
    else:
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + offs
        slots = tl.load(sorted_ptr + rows)
        valid = slots < numel
    return expert, slots, valid, rows


# ---------------------------------------------------------------------------- combine
@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, top_k, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(0, top_k):
        weight = tl.load(w_ptr + t * top_k + j)
        y = tl.load(y_ptr + (t * top_k + j) * H + cols, mask=mask, other=0.0)
        acc += y.to(tl.float32) * weight
    tl.store(out_ptr + t * H + cols, round_to(acc, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty),
             mask=mask)


def combine(y: torch.Tensor, topk_weights: torch.Tensor, t: int) -> torch.Tensor:
    """y [T*k, H] (x dtype) -> out [T, H]: sum_j float(y[t*k+j]) * w[t, j], FP32, rounded once."""
    h = y.shape[1]
    out = torch.empty((t, h), dtype=y.dtype, device=y.device)
    if t:
        block_h = min(1024, triton.next_power_of_2(h))
        _combine_kernel[(t, triton.cdiv(h, block_h))](y, topk_weights.contiguous(), out, h,
                                                     topk_weights.shape[1], BLOCK_H=block_h,
                                                     num_warps=4)
    return out


# ---------------------------------------------------------------------------- launch shapes
@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # token rows of a block (one expert's)
    block_n: int  # weight rows (output channels; for gate/up: of each of gate and up)
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    swap: bool = False  # weights on the MMA's M side (see `mma`)


def default_config(numel: int, num_experts: int, gated: bool, block_k: int = 128) -> GemmConfig:
    """Decode (few pairs): one pair per 16-row block, weights on the MMA's 64-row side (swap)
    so the tensor cores read the weight tiles straight from shared memory. Prefill: 64/128-row
    token blocks."""
    if numel <= DIRECT_MAX_PAIRS:
        return GemmConfig(16, 64, block_k, 4, 4, swap=True)
    rows_per_expert = numel / num_experts  # mean; padding wastes up to block_m - 1 per expert
    if rows_per_expert < 8:
        return GemmConfig(16, 64, block_k, 4, 4, swap=True)
    if rows_per_expert < 96:
        return GemmConfig(64, 64, block_k, 4, 4)
    return GemmConfig(128, 64 if gated else 128, block_k, 8, 3)


def routing_ptrs(routing: Routing) -> tuple:
    """(ids, sorted_slots, block_expert, num_rows) kernel args; direct mode passes ids for the
    three it never reads."""
    if routing.direct:
        return (routing.ids,) * 4
    return routing.ids, routing.sorted_slots, routing.block_expert, routing.num_rows


def configs_for(numel: int, num_experts: int, config13, config2, block_k: int = 128):
    c13 = config13 or default_config(numel, num_experts, True, block_k)
    c2 = config2 or default_config(numel, num_experts, False, block_k)
    if c13.block_m != c2.block_m:
        raise PluginError(f"both GEMMs share one token sort: block_m {c13.block_m} != {c2.block_m}")
    return c13, c2
