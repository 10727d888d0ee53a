"""Which implementation of a `beam::` op runs: Triton for CUDA tensors, the plain-torch
reference for CPU tensors, unless TRITON_INTERPRET=1 (then the Triton kernel runs on the CPU in
Triton's interpreter, which is how the kernels are tested without a GPU).

Each op file registers its implementations here and its public op (`beam_op`) calls
`dispatch`, so the choice is made in one place:

    @register("add_rmsnorm", "reference")
    def ref_add_rmsnorm(...): ...

    @register("add_rmsnorm", "triton")
    def _launch_add_rmsnorm(...): ...
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch

BACKENDS = ("triton", "reference")
_IMPLS: dict[str, dict[str, Callable]] = {}


class PluginError(RuntimeError):
    """A beam:: op called with inputs it does not support; the message names the op and input."""


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def wrap(fn: Callable) -> Callable:
        _IMPLS.setdefault(op, {})[backend] = fn
        return fn

    return wrap


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def backend_for(device: torch.device) -> str:
    """'triton' on CUDA (and on CPU under TRITON_INTERPRET=1), else 'reference'."""
    if device.type == "cuda" or (device.type == "cpu" and triton_interpreted()):
        return "triton"
    return "reference"


def implementation(op: str, device: torch.device) -> Callable:
    impls = _IMPLS.get(op)
    if not impls:
        raise PluginError(f"beam::{op} has no registered implementation")
    backend = backend_for(device)
    if backend not in impls:
        raise PluginError(f"beam::{op} has no {backend} implementation (device {device})")
    return impls[backend]


def dispatch(op: str, device: torch.device, *args, **kwargs):
    return implementation(op, device)(*args, **kwargs)


def registered_ops() -> dict[str, tuple[str, ...]]:
    return {op: tuple(sorted(impls)) for op, impls in _IMPLS.items()}


# ------------------------------------------------------------------------- the public ops
_LIB = torch.library.Library("beam", "FRAGMENT")


class BeamOp:
    """`torch.ops.beam.<name>`, defined from a typed Python function as
    torch.library.custom_op would define it (the same inferred schema, mutated arguments and
    fake implementation), but registered straight on a torch.library.Library. custom_op's
    Python wrappers (dynamo-disable, in-place/view and aliasing checks) cost ~40 us a call on
    the H200's host, more than a Triton launch; an eager prefill runs hundreds of ops."""

    def __init__(self, name: str, fn: Callable, mutates_args):
        self.name = name
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        self._packet = getattr(torch.ops.beam, name)
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self._packet(*args, **kwargs)

    def register_fake(self, fn: Callable) -> Callable:
        """The shape/dtype function torch.compile and FakeTensor tracing run instead."""
        torch.library.register_fake(f"beam::{self.name}", fn, lib=_LIB)
        return fn


def beam_op(name: str, *, mutates_args) -> Callable[[Callable], BeamOp]:
    """Decorator: the op file's public function becomes `torch.ops.beam.<name>`."""
    return lambda fn: BeamOp(name, fn, mutates_args)
