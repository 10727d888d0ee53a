"""What the four `beam::moe_*` ops share: input checks, the reference MoE math, token sorting by
expert (moe_align), the weighted combine and the launch configuration.

Data flow of every MoE kernel (T tokens, k experts each, E experts, H hidden, I expert width):

    moe_align(topk_ids)  -> the sorted rows and their row blocks (plugins/_moe_sort.py)
    gemm13  rows r:      h[r] = rnd(silu(g) * u) in FP32, g = rnd(x[slot // k] @ gate_e^T),
                         u = rnd(x[slot // k] @ up_e^T)                               [max_rows, I]
    gemm2   rows r:      y[slot] = h[r] @ down_e^T                                    [T*k, H]
    combine:             out[t] = rnd(scale * sum_j float(y[t*k+j]) * topk_weights[t, j])  [T, H]

`scale` is Beam's routed_scaling_factor, applied to the summed output (FP32, before the one
rounding), as transformers' BeamMoE applies it after the experts' aggregation.

For a few token-expert pairs (decode), the kernels skip the sort and give each pair its own
row block ("direct" mode): no align launch, and each pair reads its expert once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._checks import ACT_DTYPES, _expect, check_tensor
from ._common import TL_DTYPES  # noqa: F401  (re-exported)
from ._common import last_to_arrive, sync_counters
from ._gemm import round_to
from ._reference import swiglu
from ._moe_sort import (  # noqa: F401  (re-exported)
    Routing, max_row_blocks, max_sorted_rows, plan_routing, routing_ptrs, tail_ptrs,
)
from . import _pdl
from .registry import PluginError

DIRECT_MAX_PAIRS = 64  # at most this many (token, expert) pairs: no sort, one pair per block


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
    per_slot: bool = False,
    scale: float = 1.0,
) -> torch.Tensor:
    """transformers' BeamMoE given the routing, with the combine pinned by the spec (an FP32
    sum of the weighted expert outputs times `scale`, rounded once); `expert(e)` returns that
    expert's (w13 [2I, H], w2 [H, I]).

    Unquantized (no quantizers, weights in x.dtype): BeamMoE op for op. Quantized formats
    (weights decoded to FP32, quant13 / quant2 = the kernel's activation quantizers, identity
    for W4A16): the GEMMs run in FP32 on the exactly decoded values, as the tensor cores do,
    and every module output (gate, up, h, y) is rounded to x.dtype as in BeamMoE. With
    FP32 activations this is BeamMoE on the decoded weights exactly; with BF16 it differs from
    a BF16 BeamMoE only by BeamMoE's own rounding of the decoded weights to BF16. `act_dtype`
    (default x.dtype) is the activations' dtype when x holds decoded FP8 codes in FP32.
    per_slot: instead, each (token, slot)'s expert output y [T, k, H] unweighted (see
    `finish`; `scale` not applied)."""
    quantized = quant13 is not None
    act = act_dtype or x.dtype
    if per_slot:
        slots = torch.zeros((*topk_ids.shape, x.shape[1]), dtype=act, device=x.device)
    else:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        # the expert's pairs in BeamExperts' order (slot-major) and its fused gate/up GEMM:
        # a CPU GEMM's rows depend on their place in the batch, so this keeps its bits
        slot, token = (topk_ids.t() == e).nonzero(as_tuple=True)
        w13, w2 = expert(e)
        xe = quant13(x[token].float()) if quantized else x[token]
        gate, up = F.linear(xe, w13).to(act).chunk(2, dim=-1)
        h = swiglu(gate, up)
        y = F.linear(quant2(h.float()) if quantized else h, w2).to(act)
        if per_slot:
            slots[token, slot] = y
        else:
            out.index_add_(0, token, y.float() * topk_weights[token, slot, None])
    return slots if per_slot else (out * scale).to(act)


def empty_output(x: torch.Tensor, topk_ids: torch.Tensor, dtype: torch.dtype,
                 per_slot: bool) -> torch.Tensor:
    """An moe_* op's output buffer: [T, H], or with per_slot [T, k, H] (see `finish`)."""
    shape = (*topk_ids.shape, x.shape[1]) if per_slot else x.shape
    return torch.empty(shape, dtype=dtype, device=x.device)


def fake_moe(x: torch.Tensor, topk_ids: torch.Tensor, *args, per_slot: bool = False,
             scale: float = 1.0):
    return empty_output(x, topk_ids, x.dtype, per_slot)


# ---------------------------------------------------------------------------- TMA
TMA_MAX_BOX = 256  # rows or columns of one TMA copy (cuTensorMapEncodeTiled's boxDim limit)


def has_tma(device: torch.device) -> bool:
    """Whether the device has a TMA: sm_90+, or the CPU (Triton's interpreter emulates it)."""
    return device.type != "cuda" or _pdl._sm_major(device) >= 9


def tma_addressable(m: torch.Tensor) -> bool:
    """Whether the TMA can address m: contiguous, 16-byte aligned, rows a multiple of 16
    bytes."""
    return m.is_contiguous() and m.data_ptr() % 16 == 0 and m.shape[-1] % 16 == 0


def takes_tma(x: torch.Tensor, routing: Routing, configs, *mats: torch.Tensor) -> bool:
    """Whether the GEMMs load by the TMA: tail-block layouts (prefill) and `tma_fits`."""
    return bool(routing.tail_m) and not routing.direct and tma_fits(x, configs, *mats)


def tma_fits(x: torch.Tensor, configs, *mats: torch.Tensor) -> bool:
    """A device with a TMA (sm_90+; the interpreter emulates it), tiles one TMA copy can fill
    (at most 256 rows and columns, rows of at least 16 bytes) and operands the TMA can address
    (contiguous, 16-byte aligned, rows a multiple of 16 bytes)."""
    if any(max(c.block_m, c.block_n, c.block_k) > TMA_MAX_BOX or c.block_k < 16 for c in configs):
        return False
    return has_tma(x.device) and all(tma_addressable(m) for m in mats)


def tma_descriptors(a, w, routing: Routing, cfg: GemmConfig, tma: bool):
    """(a_desc, a_tail_desc, w_desc) of a TMA launch: activation row blocks of block_m and
    tail_m rows, weights as the 2-D [E * rows, K] they are; Nones otherwise."""
    if not tma:
        return None, None, None
    k = a.shape[1]
    w2d = w.view(-1, k)

    def rows_of(t, rows):
        return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [rows, cfg.block_k])
    return rows_of(a, cfg.block_m), rows_of(a, routing.tail_m), rows_of(w2d, cfg.block_n)


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
               BLOCK_N: tl.constexpr, block_start_ptr=None, STARTS: tl.constexpr = False):
    """The tile of program (pid_m, pid_n) of a grouped GEMM: (expert, slot of each row, row
    valid, row of the h buffer, activation row of each row (the token, slot // top_k, for
    gate/up; the h row for down), output channels offs_n [BLOCK_N] and their mask < N).
    STARTS: a tail-block layout, where block_start gives each block's first row."""
    expert, slots, valid, rows = block_rows(pid_m, ids_ptr, sorted_ptr, block_expert_ptr, numel,
                                            DIRECT, BLOCK_M, block_start_ptr, STARTS)
    a_rows = (slots // top_k) if GATED else rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, slots, valid, rows, a_rows, offs_n, offs_n < N


@triton.jit
def block_rows(pid_m, ids_ptr, sorted_ptr, block_expert_ptr, numel, DIRECT: tl.constexpr,
               BLOCK_M: tl.constexpr, block_start_ptr=None, STARTS: tl.constexpr = False):
    """(expert int64, slot of each row, row valid, row of the h buffer) of one row block."""
    offs = tl.arange(0, BLOCK_M)
    if DIRECT:  # one (token, expert) pair per block: row 0 only
        expert = tl.load(ids_ptr + pid_m).to(tl.int64)
        slots = pid_m + offs * 0
        valid = offs == 0
        rows = slots
    else:
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if STARTS:
            rows = tl.load(block_start_ptr + pid_m) + offs
        else:
            rows = pid_m * BLOCK_M + offs
        slots = tl.load(sorted_ptr + rows)
        valid = slots < numel
    return expert, slots, valid, rows


# ---------------------------------------------------------------------------- combine
@triton.jit
def combine_row(y_ptr, w_ptr, out_ptr, row, cols, mask, H, scale, TOP_K: tl.constexpr):
    """out[row, cols] = scale * sum_j float(y[row*TOP_K + j, cols]) * w[row, j], in slot
    order, FP32, rounded once (unrolled: the slots' loads all in flight at once; y read from
    L2, as the fused combine reads other programs' stores)."""
    row = row.to(tl.int64)
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        weight = tl.load(w_ptr + row * TOP_K + j)
        y = tl.load(y_ptr + (row * TOP_K + j) * H + cols, mask=mask, other=0.0,
                    cache_modifier=".cg")
        acc += y.to(tl.float32) * weight
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * H + cols, round_to(acc * scale, dtype).to(dtype), mask=mask)


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, scale, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    combine_row(y_ptr, w_ptr, out_ptr, tl.program_id(0), cols, cols < H, H, scale, TOP_K)


# The down GEMM of direct pairs can combine as well, sparing the combine launch and its gap:
# each program stores its (unweighted) y tile and then draws a ticket for its (token, column
# tile); the one that draws the token's last ticket (so every other slot's tile is stored)
# sums the slots with `combine_row`, as _combine_kernel does (bit-equal), and puts the
# counter back to zero for the next launch.
@triton.jit
def combine_if_last(y_ptr, w_ptr, out_ptr, tickets_ptr, token, tile, num_tiles, cols, mask,
                    H, scale, TOP_K: tl.constexpr):
    """After this program stored y[token*TOP_K + j, cols] for its slot j: the combine of
    out[token, cols] if it is the last of the token's TOP_K slots to do so."""
    ticket = tickets_ptr + token * num_tiles + tile
    if last_to_arrive(ticket, TOP_K):  # (all of this program's y stores precede its ticket)
        combine_row(y_ptr, w_ptr, out_ptr, token, cols, mask, H, scale, TOP_K)
        tl.atomic_xchg(ticket, 0)


# Direct pairs' two GEMMs overlap: gate/up lets the down GEMM launch early (programmatic
# dependent launch) and counts each pair's finished h tiles; a down program waits only for its
# own pair's h, so the down GEMM's programs fill the SMs that gate/up's last programs leave idle
# (its tail) instead of starting after the last of them. One counter a pair, each on its own
# 128-byte line (waiting programs poll it); the last down program of a pair to get past the
# wait puts both of its counters back to zero for the next launch.
FLAG_STRIDE = tl.constexpr(32)


@triton.jit
def signal_ready(flags_ptr, pair):
    """After this gate/up program stored its h tile of `pair`: count it (a gpu-scope release
    after the barrier, so every thread's stores precede it)."""
    tl.debug_barrier()
    tl.atomic_add(flags_ptr + pair * FLAG_STRIDE, 1, sem="release", scope="gpu")


@triton.jit
def wait_for_pair(flags_ptr, pair, count, programs, num_pairs, SLEEP: tl.constexpr):
    """Until `count` h tiles of `pair` are stored (gpu-scope acquire; SLEEP backs off between
    polls, compiled only: the interpreter runs gate/up to the end first). Then the last of the
    pair's `programs` to get past the wait (so none waits any more) zeroes the pair's
    counters."""
    flag = flags_ptr + pair * FLAG_STRIDE
    while tl.atomic_add(flag, 0, sem="acquire", scope="gpu") < count:
        if SLEEP:
            tl.inline_asm_elementwise("nanosleep.u32 200; // dummy $0", "=r", [],
                                      dtype=tl.int32, is_pure=False, pack=1)
    passed = flags_ptr + (num_pairs + pair) * FLAG_STRIDE
    if tl.atomic_add(passed, 1, sem="relaxed", scope="gpu") == programs - 1:
        tl.atomic_xchg(flag, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(passed, 0, sem="relaxed", scope="gpu")


def combine_tickets(device: torch.device, count: int) -> torch.Tensor:
    """>= count zeroed tickets for `combine_if_last` (this stream's)."""
    return sync_counters(device, count, "combine")


def pair_flags(device: torch.device, pairs: int) -> torch.Tensor:
    """The overlap's counters for `pairs` direct pairs: h tiles stored, then down programs past
    the wait."""
    return sync_counters(device, 2 * pairs * FLAG_STRIDE.value, "pairs")


def pair_overlap(device: torch.device, routing: Routing, numel: int, gate_up_tiles: int):
    """The two GEMMs' `overlap` argument: (the pair counters, gate/up's column tiles a pair)
    for direct pairs, else None (sorted blocks run the down GEMM after gate/up)."""
    return (pair_flags(device, numel), gate_up_tiles) if routing.direct else None


def overlap_launch(overlap, device: torch.device, group_m: int, gated: bool):
    """(flags, ready count, keyword arguments) of one grouped-GEMM launch for `overlap`
    (`pair_overlap`'s, or None): overlapped GEMMs run pair by pair (GROUP_M = 1), and where
    the device has PDL the down GEMM is launched early."""
    if overlap is None:
        return None, 0, dict(GROUP_M=group_m, OVERLAP=False, PDL=False)
    pdl = _pdl.has_pdl(device)
    launch = {"launch_pdl": True} if pdl and not gated else {}
    return (*overlap, dict(GROUP_M=1, OVERLAP=True, PDL=pdl, **launch))


def finish(y: torch.Tensor, topk_weights: torch.Tensor, t: int, per_slot: bool,
           scale: float = 1.0) -> torch.Tensor:
    """The down GEMM's per-slot outputs y [T*k, H] (row t*k + j: token t's j-th expert,
    unweighted) -> the op's output: combined [T, H], or with per_slot y itself as [T, k, H]
    for a consumer that adds them and applies `scale` (beam::add_rmsnorm's y_weights and
    y_scale; no combine launch)."""
    if per_slot:
        return y.view(t, topk_weights.shape[1], y.shape[1])
    return combine(y, topk_weights, t, scale)


def combine(y: torch.Tensor, topk_weights: torch.Tensor, t: int,
            scale: float = 1.0) -> torch.Tensor:
    """y [T*k, H] (x dtype) -> out [T, H]: scale * sum_j float(y[t*k+j]) * w[t, j], FP32,
    rounded once."""
    h = y.shape[1]
    out = torch.empty((t, h), dtype=y.dtype, device=y.device)
    if t:
        block_h = min(1024, triton.next_power_of_2(h))
        _combine_kernel[(t, triton.cdiv(h, block_h))](y, topk_weights.contiguous(), out, h,
                                                     scale, TOP_K=topk_weights.shape[1],
                                                     BLOCK_H=block_h, num_warps=4)
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
    tail_m: int = 0  # > 0: tail blocks of tail_m rows, weights on the M side (_moe_sort.py)


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


def configs_for(numel: int, num_experts: int, config13, config2, block_k: int = 128,
                tails: bool = False):
    """(gate/up, down) launch shapes: the given ones, else `default_config`'s. `tails`: the
    op's kernels run tail blocks (GemmConfig.tail_m; only moe_fp8's do)."""
    c13 = config13 or default_config(numel, num_experts, True, block_k)
    c2 = config2 or default_config(numel, num_experts, False, block_k)
    if c13.block_m != c2.block_m:
        raise PluginError(f"both GEMMs share one token sort: block_m {c13.block_m} != {c2.block_m}")
    if c13.tail_m != c2.tail_m:
        raise PluginError(f"both GEMMs share one token sort: tail_m {c13.tail_m} != {c2.tail_m}")
    if c13.tail_m and not tails:
        raise PluginError(f"tail_m={c13.tail_m}: this op's kernels have no tail blocks")
    if not tail_m_fits(c13.tail_m, c13.block_m):
        raise PluginError(f"tail_m={c13.tail_m}: a power of two from 16 to below "
                          f"block_m={c13.block_m}")
    return c13, c2


def tail_m_fits(tail_m: int, block_m: int) -> bool:
    """0 (no tail blocks) or a power of two from 16 (the smallest MMA tile) below block_m."""
    return not tail_m or (not tail_m & (tail_m - 1) and 16 <= tail_m < block_m)
