"""beam::l2_prefetch — start moving a tensor's bytes from HBM into the GPU's L2 cache, so that
a kernel launched soon after reads them from L2. A batch-1 decode step prefetches the o_proj
weights while its latency-bound attention kernels leave HBM idle, and the next layer's q/k/v
weights during the boundary norm, each on a side stream (docs/DESIGN.md §2, "L2 prefetch").

    values: none changed; every 128-byte line of t's bytes [0, max_bytes) is requested with
    PTX `prefetch.global.L2`

Input: t, a contiguous tensor (any dtype; its bytes). Output: none; the op writes nothing and
its programs only issue the prefetches and exit: the lines arrive in L2 afterwards, while the
kernels that follow run. CPU (reference) and the interpreter (which runs no inline PTX): a
no-op, there is no L2 to warm. CUDA-graph safe (the grid depends on t's size only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check
from .registry import dispatch, register, triton_interpreted

OP = "l2_prefetch"
LINE_BYTES = 128
LINES_PER_PROGRAM = 1024  # 8 prefetches a thread of 4 warps


def _check(t: torch.Tensor, max_bytes: int) -> None:
    check(t.is_contiguous(), OP, f"t must be contiguous, got strides {tuple(t.stride())}")
    check(max_bytes >= 0, OP, f"max_bytes must be >= 0, got {max_bytes}")


@register(OP, "reference")
def ref_l2_prefetch(t: torch.Tensor, max_bytes: int) -> None:
    _check(t, max_bytes)


@triton.jit
def _l2_prefetch_kernel(base_ptr, n_lines, LINES: tl.constexpr):
    line = tl.program_id(0) * LINES + tl.arange(0, LINES)
    line = tl.where(line < n_lines, line, 0)  # (lines past the end request the first again)
    addr = (base_ptr + line.to(tl.int64) * 128).to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr],
                              dtype=tl.int32, is_pure=False, pack=1)


@register(OP, "triton")
def _launch_l2_prefetch(t: torch.Tensor, max_bytes: int) -> None:
    _check(t, max_bytes)
    n_lines = triton.cdiv(min(t.numel() * t.element_size(), max_bytes), LINE_BYTES)
    if n_lines == 0 or triton_interpreted():
        return
    grid = (triton.cdiv(n_lines, LINES_PER_PROGRAM),)
    _l2_prefetch_kernel[grid](t.view(-1).view(torch.uint8), n_lines, LINES=LINES_PER_PROGRAM,
                              num_warps=4)


@torch.library.custom_op("beam::l2_prefetch", mutates_args=())
def l2_prefetch(t: torch.Tensor, max_bytes: int) -> None:
    dispatch(OP, t.device, t, max_bytes)


@l2_prefetch.register_fake
def _(t, max_bytes):
    _check(t, max_bytes)
