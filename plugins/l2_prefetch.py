"""beam::l2_prefetch — start pulling weights that the next kernels read into the GPU's L2.

    for each row r of table:  prefetch bytes [table[r, 0], table[r, 0] + table[r, 1]) into L2

Shapes / dtypes: table [R, 2] int64 on the GPU: (device address, bytes) rows, each address and
size a multiple of 16 and size at most MAX_CHUNK (~1 MB), as `prefetch_table(tensors)` makes them. Returns
nothing and changes no tensor: it is a hint, and every result stays bit for bit the same.

Why: in a batch-1 decode step the attention side after the q/k/v GEMM (qk_prep, attention and
its combine) is a chain of latency-bound kernels that leave HBM idle for ~15 µs, and then
o_proj and the router stream their weights from HBM (36 MB at Beam's shapes). Issued right
after the q/k/v GEMM, this op moves those bytes into L2 during that idle window.

How: Hopper's bulk prefetch (`cp.async.bulk.prefetch.L2.global [addr], size`, sm_90+) hands
one range to the SM's TMA unit per instruction; it has no destination and no completion, so
the kernel ends once the instructions issue and the copies proceed behind the next kernels.
One thread issues one table row. Before sm_90, on the CPU and in Triton's interpreter (which
cannot run PTX) the op does nothing, which is also its reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, check_tensor
from .registry import dispatch, register

OP = "l2_prefetch"
CHUNK_BYTES = 64 << 10  # one table row: spreads a weight over many SMs' TMA units
ROWS_PER_PROGRAM = 32  # one warp, one row a lane
ALIGN = 16  # the bulk prefetch's address and size granule
MAX_CHUNK = 0xFFFF * ALIGN  # the size the instruction encodes (16-bit count of 16-byte units)


def prefetch_table(tensors: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """(address, bytes) rows covering each tensor's bytes in chunks of chunk_bytes, on their
    device. Each range is widened to 16-byte boundaries (the allocator's blocks are 512-byte
    aligned, so the widening stays inside the tensor's allocation)."""
    check(chunk_bytes % ALIGN == 0 and 0 < chunk_bytes <= MAX_CHUNK, OP,
          f"chunk_bytes must be a multiple of {ALIGN} in 16..{MAX_CHUNK}, got {chunk_bytes}")
    check(len(tensors) > 0, OP, "no tensors to prefetch")
    device, rows = tensors[0].device, []
    for i, t in enumerate(tensors):
        check(t.device == device, OP, f"tensor {i} is on {t.device}, tensor 0 on {device}")
        check(t.is_contiguous(), OP, f"tensor {i} {tuple(t.shape)} must be contiguous")
        start = t.data_ptr() // ALIGN * ALIGN
        end = -(-(t.data_ptr() + t.numel() * t.element_size()) // ALIGN) * ALIGN
        rows += [(a, min(chunk_bytes, end - a)) for a in range(start, end, chunk_bytes)]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2).to(device)


@register(OP, "reference")
def ref_l2_prefetch(table: torch.Tensor) -> None:
    """Nothing to compute: a prefetch changes no value."""


@triton.jit
def _bulk_prefetch(addr, nbytes):
    """Issue one L2 bulk prefetch per element whose nbytes is not 0."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(table_ptr, R, ROWS: tl.constexpr):
    lanes = tl.arange(0, 32)
    rows = tl.program_id(0) * ROWS + lanes
    live = (lanes < ROWS) & (rows < R)
    addr = tl.load(table_ptr + 2 * rows, mask=live, other=0)
    nbytes = tl.load(table_ptr + 2 * rows + 1, mask=live, other=0).to(tl.int32)
    _bulk_prefetch(addr, nbytes)


def takes_bulk_prefetch(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


@register(OP, "triton")
def _launch_l2_prefetch(table: torch.Tensor, rows_per_program: int = ROWS_PER_PROGRAM) -> None:
    if not takes_bulk_prefetch(table.device) or not table.shape[0]:
        return  # the interpreter cannot run PTX, and before Hopper there is no bulk prefetch
    launch_l2_prefetch(table, rows_per_program)


def launch_l2_prefetch(table: torch.Tensor, rows_per_program: int = ROWS_PER_PROGRAM):
    """The kernel launch itself (also how the sm_90 compile test drives it)."""
    check(0 < rows_per_program <= 32, OP, f"rows_per_program must be 1..32, got {rows_per_program}")
    grid = (triton.cdiv(table.shape[0], rows_per_program),)
    return _l2_prefetch_kernel[grid](table, table.shape[0], ROWS=rows_per_program, num_warps=1)


def _check(table: torch.Tensor) -> None:
    check_tensor(OP, "table", table, ndim=2, dtypes=(torch.int64,))
    check(table.shape[1] == 2, OP, f"table must be [R, 2] (address, bytes), got {list(table.shape)}")


@torch.library.custom_op("beam::l2_prefetch", mutates_args=())
def l2_prefetch(table: torch.Tensor) -> None:
    _check(table)
    dispatch(OP, table.device, table)


@l2_prefetch.register_fake
def _(table):
    _check(table)
