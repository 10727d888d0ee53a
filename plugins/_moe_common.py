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
from . import _interp_dot  # noqa: F401  (interpreter BF16 dot fix)
from ._common import TL_DTYPES, bf16_grid  # noqa: F401  (TL_DTYPES: re-exported)
from .registry import PluginError

DIRECT_MAX_PAIRS = 64  # at most this many (token, expert) pairs: no sort, one pair per block
# FP8 MMA partial sums are added into the FP32 accumulator at least every this many products
# (DeepSeek-V3 report 3.3.2 and cuBLAS promote every 128 as well).
PROMOTE_EVERY = tl.constexpr(128)
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


# ---------------------------------------------------------------------------- kernel helpers
@triton.jit
def tile_of(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped launch order: GROUP_M row blocks (one expert's) share each weight tile in L2."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


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


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """FP32 x rounded to what `dtype` holds (nearest-even), kept in FP32: the reference rounds
    every module output to the activation dtype."""
    if dtype == tl.bfloat16:
        x = bf16_grid(x)
    elif dtype == tl.float16:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """F.silu(gate) * up with the reference's roundings (gate, up, silu, product to dtype)."""
    gate = round_to(gate, dtype)
    up = round_to(up, dtype)
    return round_to(round_to(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)


@triton.jit
def acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def mma(acc, a, w, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ w^T (a [BM, BK] tokens, w [BN, BK] weights; acc [BM, BN]), or with SWAP
    acc + w @ a^T (acc [BN, BM]): the weights fill the MMA's 64-row M side, so a block of a
    few tokens (decode) still runs on full tensor-core tiles fed from shared memory."""
    if SWAP:
        acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def mma_fp8(acc, a, w, SWAP: tl.constexpr, BLOCK_K: tl.constexpr):
    """`mma` for FP8 operands; the tensor-core partial sums are promoted to the FP32
    accumulator every min(BLOCK_K, PROMOTE_EVERY) products (Hopper's FP8 MMA accumulates with
    reduced precision, and Triton's default would never promote), so a wider K tile does not
    make the sum less precise."""
    if BLOCK_K > PROMOTE_EVERY:
        if SWAP:
            acc = tl.dot(w, tl.trans(a), acc, max_num_imprecise_acc=PROMOTE_EVERY)
        else:
            acc = tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE_EVERY)
    else:
        if SWAP:
            acc = tl.dot(w, tl.trans(a), acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=BLOCK_K)
    return acc


@triton.jit
def fp8_gemm_loop(a_ptrs, a_rows_ok, w_ptrs, n_mask, K, up_offset, GATED: tl.constexpr,
                  SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """The K loop of the FP8 W8A8 GEMMs (moe_fp8, linear_fp8): activation codes [BLOCK_M,
    BLOCK_K] (rows `a_rows_ok`) times weight codes [BLOCK_N, BLOCK_K] (rows `n_mask`), both
    contiguous in K; with GATED also the weight rows `up_offset` elements further (an expert's
    up_proj) into a second accumulator. Few tokens: SWAP puts the weights on the MMA's M side
    (see `mma`). -> (acc, acc_up), unscaled FP32 sums, [BN, BM] with SWAP else [BM, BN]."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    acc_up = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=a_rows_ok[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc = mma_fp8(acc, a, tl.load(w_ptrs, mask=w_mask, other=0.0), SWAP, BLOCK_K)
        if GATED:
            w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
            acc_up = mma_fp8(acc_up, a, w_up, SWAP, BLOCK_K)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, acc_up


@triton.jit
def outer(row_scale, col_scale, SWAP: tl.constexpr):
    """row_scale [BM] x col_scale [BN] in the accumulator's orientation."""
    if SWAP:
        out = col_scale[:, None] * row_scale[None, :]
    else:
        out = row_scale[:, None] * col_scale[None, :]
    return out


@triton.jit
def unswap(acc, SWAP: tl.constexpr):
    """The accumulator as [BM, BN] (tokens x channels) for the epilogue."""
    if SWAP:
        acc = tl.trans(acc)
    return acc


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


def dot_precision(dtype: torch.dtype) -> str:
    """FP32 activations get IEEE FP32 dots (the reference is FP32), others the native MMA."""
    return "ieee" if dtype == torch.float32 else "tf32"


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
