"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with `launch_pdl` may start
while the kernel before it on the stream still runs, once every program of that one has called
`griddepcontrol.launch_dependents` (or exited); `griddepcontrol.wait` then blocks until the
earlier kernel has finished and its writes are visible.

The batch-1 decode uses it where a kernel can do useful work before its inputs exist: a
weight-streaming GEMM (q/k/v, o_proj) loads part of its weights into registers while the
latency-bound kernels before it run (docs/DESIGN.md §2, "the decode chain"). The rules every
kernel of a chain keeps:
- before `wait_for_inputs` it reads only data no kernel of the step writes (weights), and it
  writes nothing (the kernel before it may still be reading that memory);
- a kernel that lets its successor launch early (`let_next_launch`) does so whether or not
  the successor was launched with PDL: without it the call does nothing;
- the wait is transitive: a kernel finishes only after its own wait has returned, so a
  chain a -> b -> c orders c's reads after a's writes too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .registry import triton_interpreted

_CHAIN = {"on": True}


def has_pdl(device: torch.device) -> bool:
    """Whether kernels on the device can be launched early (programmatic dependent launch,
    sm_90+) and call griddepcontrol; never in the interpreter, which runs launches in order."""
    return (device.type == "cuda" and not triton_interpreted()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def decode_chain(device: torch.device) -> bool:
    """Whether the decode kernels on `device` run as a PDL chain (`has_pdl`, unless turned off
    by `set_decode_chain(False)`: benchmarks' A/B)."""
    return _CHAIN["on"] and has_pdl(device)


def set_decode_chain(on: bool) -> None:
    """Turn the decode chain on or off for launches from now on (a captured CUDA graph keeps
    what it captured)."""
    _CHAIN["on"] = bool(on)


def pdl_launch(pdl: bool) -> dict:
    """The launch keyword arguments of a kernel that may start early."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def let_next_launch(PDL: tl.constexpr):
    """Allow the next kernel on the stream to launch now (its own wait orders its reads)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
