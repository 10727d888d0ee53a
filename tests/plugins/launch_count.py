"""Count the kernels a piece of engine code launches, on the CPU: Triton kernels run in Triton's
interpreter (TRITON_INTERPRET=1), each launch recorded as a profiler range `triton::<kernel>`,
plus every torch op that would be a CUDA kernel of its own. A torch op counts when it is not a
view, reshape or allocation (those launch nothing on a GPU), is not inside a Triton launch (the
interpreter's own host copies) and has no counted op inside it (aten::linear -> aten::mm is one
launch). An op this file does not know launches nothing is counted: the list errs toward more.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import ProfilerActivity, profile, record_function

TRITON = "triton::"
# aten ops that only make views or allocate: no kernel on a GPU
NO_KERNEL = {
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::view",
    "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::as_strided",
    "aten::select", "aten::slice", "aten::narrow", "aten::split", "aten::split_with_sizes",
    "aten::unbind", "aten::t", "aten::transpose", "aten::permute", "aten::expand",
    "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::alias", "aten::flatten",
    "aten::unflatten", "aten::view_as", "aten::lift_fresh", "aten::resolve_conj",
    "aten::resolve_neg", "aten::contiguous", "aten::to", "aten::numel", "aten::dim", "aten::size",
    "aten::stride", "aten::is_nonzero",
}


@contextlib.contextmanager
def recorded_launches():
    """Within the block, every interpreted Triton launch is a profiler range; yields a list that
    holds the launches (kernel or torch op names, in order) once the block exits."""
    from triton.runtime.interpreter import InterpretedFunction

    original, launches = InterpretedFunction.run, []

    def run(self, *args, **kwargs):
        with record_function(TRITON + self.fn.__name__):
            return original(self, *args, **kwargs)

    InterpretedFunction.run = run
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield launches
    finally:
        InterpretedFunction.run = original
    launches.extend(_launches(prof.events()))


def _inside_triton(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(TRITON):
            return True
        parent = parent.cpu_parent
    return False


def _is_torch_kernel(event) -> bool:
    return event.name.startswith("aten::") and event.name not in NO_KERNEL


def _has_kernel_inside(event) -> bool:
    return any(_is_torch_kernel(c) or _has_kernel_inside(c) for c in event.cpu_children)


def _launches(events) -> list[str]:
    out = []
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.name.startswith(TRITON):
            out.append(e.name)
        elif _is_torch_kernel(e) and not _inside_triton(e) and not _has_kernel_inside(e):
            out.append(e.name)
    return out
