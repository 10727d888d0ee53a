"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with `launch_pdl` may start
while the kernel before it on the stream still runs, once every program of that one has called
`griddepcontrol.launch_dependents` (or exited); `griddepcontrol.wait` then blocks until the
earlier kernel has finished and its writes are visible.

The batch-1 decode launches its split FP8 GEMMs (q/k/v, o_proj) and its norms this way: their
programs are resident, past their prologue, when the kernel before them finishes
(docs/DESIGN.md §2, "the decode chain"). The rules every kernel of a chain keeps:
- before `wait_for_inputs` it reads only data no kernel of the step writes (weights, scales),
  and it writes nothing (the kernel before it may still be reading that memory);
- a kernel that lets its successor launch early (`let_next_launch`) does so whether or not
  the successor was launched with PDL: without it the call does nothing;
- the wait is transitive: a kernel finishes only after its own wait has returned, so a
  chain a -> b -> c orders c's reads after a's writes too. (The MoE's down GEMM waits on its
  pairs' counters instead, docs/DESIGN.md §2: it finishes only after reading every h tile
  gate/up writes, and gate/up writes nothing else the next kernels read.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .registry import triton_interpreted

# Where the decode chain may launch a kernel early: the `link` of `launch_early`. On by
# default: the split FP8 GEMMs (q/k/v behind the boundary norm, o_proj behind the attention's
# combine), the whole-row norms (behind o_proj, the MoE's down GEMM, a dense layer's GEMMs),
# the router's logits GEMV (its weights read before its wait), qk_prep (its angles before its
# wait) and the attention's split and combine (the split's
# first K/V tile before its wait).
# FOLDS: kernels of the chain that can be folded into the kernel before them, whose last
# program to finish then does their work (counted with `_common.sync_counters`' tickets): the
# attention's combine into its split kernel, the router's selection into its logits GEMV.
# Not launches: they apply on every device, the interpreter included. Off by default.
# LATE: kernels of the chain that let their successor launch only once their own wait has
# returned (`chain_mode` 2), not at their start. A successor launched at the start of a
# kernel that is itself launched early becomes resident while the kernel two before it still
# runs, and takes shared memory and warps from it: the next q/k/v GEMM's 256 programs from
# the MoE's down GEMM (behind the boundary norm), the router's 128 from the o_proj (behind
# the norm before the MoE), the attention's split from the q/k/v GEMM (behind qk_prep).
# On by default for the norms and qk_prep.
# The H200 A/Bs (bench/engine_bench.py --chain-ab, 2026-11-30, docs/benchmarks-history.md), on a
# sliding MoE layer: the GEMMs early 1.5-2 us faster, the norms nothing there (5 us on a
# dense layer), the router and qk_prep with their preloads 3-3.5 us together; the attention's
# kernels early 0.5-3 us slower while qk_prep let them launch at its start, 1.2 us faster
# once it lets them launch after its wait; the norms' late trigger 2.0 us (2.5 on the full
# layer); the linear GEMMs' late trigger nothing; the combine fold within +-1 us, the select
# fold 0.5-1 us slower (both slower again with the late triggers, commit 1d303b7).
LINKS = ("norm", "linear", "qk_prep", "attention", "router")
FOLDS = ("combine", "select")
LATE = ("late_norm", "late_linear", "late_qk_prep")
DEFAULT_LINKS = ("linear", "norm", "router", "qk_prep", "attention", "late_norm", "late_qk_prep")
_CHAIN = {"links": frozenset(DEFAULT_LINKS)}


def has_pdl(device: torch.device) -> bool:
    """Whether kernels on the device can be launched early (programmatic dependent launch,
    sm_90+) and call griddepcontrol; never in the interpreter, which runs launches in order."""
    return device.type == "cuda" and not triton_interpreted() and _sm_major(device) >= 9


_SM_MAJOR: dict[int, int] = {}


def _sm_major(device: torch.device) -> int:
    """The device's compute capability major, read once a device: every eager launch asks, and
    torch.cuda.get_device_capability costs ~8 us on the H200's host."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    major = _SM_MAJOR.get(index)
    if major is None:
        major = _SM_MAJOR[index] = torch.cuda.get_device_capability(index)[0]
    return major


def decode_chain(device: torch.device) -> bool:
    """Whether the decode kernels on `device` are built for the chain (`has_pdl` and a link
    on): they let the next kernel launch and wait for their inputs (a wait that returns at
    once where the kernel was not launched early)."""
    return bool(_CHAIN["links"]) and has_pdl(device)


def chain_mode(device: torch.device, kernel: str) -> int:
    """The PDL constexpr of chain kernel `kernel` (one of LINKS): 0 outside the chain, 1 when it
    lets its successor launch at its start, 2 when only after its wait (LATE)."""
    if not decode_chain(device):
        return 0
    return 2 if f"late_{kernel}" in _CHAIN["links"] else 1


def launch_early(device: torch.device, link: str) -> dict:
    """The launch keyword arguments of a chain kernel at `link` (one of LINKS)."""
    assert link in LINKS, link
    return {"launch_pdl": True} if link in _CHAIN["links"] and has_pdl(device) else {}


def folded(name: str) -> bool:
    """Whether the chain's kernel `name` (one of FOLDS) is folded into the one before it."""
    assert name in FOLDS, name
    return name in _CHAIN["links"]


def decode_chain_links() -> tuple[str, ...]:
    """The chain's links, folds and late triggers now (set_decode_chain takes them back)."""
    return tuple(sorted(_CHAIN["links"]))


def set_decode_chain(links=True) -> None:
    """The chain's links, folds and late triggers from now on: True (the default ones), "all"
    (LINKS + FOLDS), False (none) or some of LINKS + FOLDS + LATE (a captured CUDA graph keeps
    what it captured)."""
    chosen = (DEFAULT_LINKS if links is True else LINKS + FOLDS if links == "all" else
              () if links is False else tuple(links))
    unknown = set(chosen) - set(LINKS + FOLDS + LATE)
    if unknown:
        raise ValueError(f"unknown decode-chain links {sorted(unknown)}; known: "
                         f"{LINKS + FOLDS + LATE}")
    _CHAIN["links"] = frozenset(chosen)


@triton.jit
def let_next_launch(PDL: tl.constexpr):
    """Allow the next kernel on the stream to launch now (its own wait orders its reads);
    PDL 2 (`chain_mode`'s LATE): not here but once `wait_for_inputs` returns."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible (PDL 2:
    then let the next kernel launch)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
