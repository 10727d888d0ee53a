"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A batch-1 decode step is a chain of a dozen small kernels, each of which waits for the one
before it. Launched normally (also inside a CUDA graph), a kernel's blocks are scheduled only
after the previous kernel has drained, so every boundary costs the launch and ramp-up of the
next kernel, a few microseconds that no data moves in. With PDL the next kernel is launched
once every block of the current one has executed `griddepcontrol.launch_dependents` (or
exited); its blocks then sit at `griddepcontrol.wait`, which returns when the previous grid
has completed and its memory is visible. What a block does before the wait overlaps the
previous kernels: the GEMMs prefetch their (static) weights into L2 there, so the weight
reads of o_proj and q/k/v overlap the latency-bound attention, norm and router kernels.

The rules every kernel launched with `pdl_args` keeps:
- it calls `pdl_wait(PDL)` before its first load of anything another kernel writes, and
  before its first store (so no kernel writes what an earlier one still reads); before it
  only static weights are touched, and only to prefetch them;
- hence kernel N + 1 completes after kernel N, and visibility holds along the whole chain.
Kernels launched without PDL (torch's own, prefill) keep ordinary stream order.

Trigger: small latency-bound kernels trigger at their start ("early"), so the kernels after
them become resident at once; the GEMMs trigger after their wait ("late"), which bounds how
far ahead blocks are placed while a GEMM is streaming its weights.

`SETTINGS` (BEAM_PDL=off turns it off) is read at every launch, so bench/ can compare
variants in one process; on the CPU, in Triton's interpreter and before Hopper, PDL is off.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .registry import triton_interpreted

PDL_OFF, PDL_LATE, PDL_EARLY = 0, 1, 2
SETTINGS = {
    "enabled": os.environ.get("BEAM_PDL", "on") != "off",
    "gemm_trigger": "late",   # "late" | "early": where the GEMMs let the next kernel launch
    "prefetch": True,         # GEMMs prefetch their weight slice into L2 before the wait
    "force": False,           # compile for PDL without a GPU (tests/plugins/sm90.py)
}
_CAPABLE: dict[int, bool] = {}


def _capable(device: torch.device) -> bool:
    if SETTINGS["force"]:
        return True
    if device.type != "cuda" or triton_interpreted():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _CAPABLE[index]


def pdl_args(device: torch.device, gemm: bool = False, prefetch: bool = False) -> dict:
    """Launch keywords of a PDL-aware kernel: its `PDL` constexpr (off / late / early trigger;
    `gemm`: the GEMMs' trigger) plus `launch_pdl=True` where PDL is on; with `prefetch` also the
    kernel's `PREFETCH` constexpr (prefetch its weights before the wait)."""
    on = SETTINGS["enabled"] and _capable(device)
    mode = PDL_OFF
    if on:
        early = not gemm or SETTINGS["gemm_trigger"] == "early"
        mode = PDL_EARLY if early else PDL_LATE
    args = {"PDL": mode}
    if on:
        args["launch_pdl"] = True
    if prefetch:
        args["PREFETCH"] = on and SETTINGS["prefetch"]
    return args


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel's grid (a no-op with PDL off); trigger the next launch
    before (PDL_EARLY) or after (PDL_LATE) the wait."""
    if PDL == 2:
        gdc_launch_dependents()
    if PDL != 0:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def l2_prefetch(ptrs, mask):
    """Ask L2 for the 128-byte lines at `ptrs` (one address per line; fire and forget, nothing
    is written to registers). evict_last: the lines should survive the streams that pass
    through L2 until the kernel reads them."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; "
        "mov.u32 $0, 0; }", "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1)


@triton.jit
def prefetch_rows(base_ptr, rows, rows_ok, stride_row, row_elems, LINES: tl.constexpr):
    """Prefetch the first `row_elems` elements of each row `rows` (a [R] block, masked by
    rows_ok) of a row-major matrix, LINES 128-byte lines per row at a time."""
    step: tl.constexpr = 1024 // base_ptr.dtype.element_ty.primitive_bitwidth  # per line
    line = tl.arange(0, LINES) * step
    row_ptrs = base_ptr + rows.to(tl.int64)[:, None] * stride_row
    for e0 in range(0, row_elems, LINES * step):
        off = e0 + line
        l2_prefetch(row_ptrs + off[None, :], rows_ok[:, None] & (off[None, :] < row_elems))
