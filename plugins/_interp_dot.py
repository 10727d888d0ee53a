"""Triton 3.6's interpreter multiplies BF16 dot operands as their raw uint16 bit patterns (it
stores BF16 as uint16 and hands those to np.matmul), so every BF16 tl.dot is garbage on the
CPU. Upcast BF16 operands to FP32 first (exact), as the GPU's MMA does. Interpreter only: the
compiled kernels are untouched. Imported by the op files whose kernels use tl.dot on BF16."""

from __future__ import annotations

import numpy as np
import triton.language as tl

from .registry import triton_interpreted


def _fix_interpreter_bf16_dot() -> None:
    import triton.runtime.interpreter as interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_beam_bf16_fixed", False):
        return

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._beam_bf16_fixed = True
    builder.create_dot = create_dot


if triton_interpreted():
    _fix_interpreter_bf16_dot()
