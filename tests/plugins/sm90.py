"""Compile Triton kernels for Hopper (sm_90) on a machine without a GPU: Triton's own compiler
and the ptxas it ships, driven the way a launch would drive them, minus the launch. Lets the
CPU suite catch what the interpreter cannot: kernels that do not compile for the H200,
register spills, and loops the compiler did not pipeline."""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler import compile as triton_compile
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import JITFunction, create_function_from_signature

HOPPER = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@contextlib.contextmanager
def compile_instead_of_launch(target=HOPPER):
    """Within the block, `kernel[grid](...)` compiles for `target` and records the result in
    the yielded list instead of launching (outputs of the launchers stay unwritten). Triton
    and Gluon kernels alike."""
    backend, compiled, original = make_backend(target), [], JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = False
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound,
                                                                specialization, options)
        source = GluonASTSource if self.is_gluon() else ASTSource
        kernel = triton_compile(source(self, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
        compiled.append((self.__name__, kernel))
        return kernel

    JITFunction.run = run
    try:
        yield compiled
    finally:
        JITFunction.run = original


PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def spill_bytes(kernel, arch: str = "sm_90a") -> int:
    """Bytes of register spill stores ptxas reports for the kernel's PTX (a stack frame alone,
    such as libdevice's never-taken slow path of sinf/cosf, is not a spill)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        report = subprocess.run([str(PTXAS), "-v", f"--gpu-name={arch}", str(ptx), "-o",
                                 str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                                check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def resource_usage(kernel) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of a compiled kernel, as cuobjdump reports them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def _sass_lines(kernel) -> list[tuple[int, str]]:
    """(address, instruction) of the kernel's SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    return [(int(addr, 16), code) for addr, code in
            re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]


def loop_instructions(kernel) -> list[str]:
    """The SASS instructions inside a loop (a loop: the range from a predicated backward
    branch's target to the branch; an unpredicated one returns from an out-of-line block,
    such as an mbarrier wait's retry loop placed after the kernel's exit)."""
    lines = _sass_lines(kernel)
    loops = [(int(target, 16), addr) for addr, code in lines
             for target in re.findall(r"^@!?U?P\w+\s+BRA\b.*?0x([0-9a-f]+)", code)
             if int(target, 16) < addr]
    return [code for addr, code in lines if any(lo <= addr <= hi for lo, hi in loops)]


def in_loops(kernel, opcode: str) -> int:
    """Instructions matching the regex `opcode` inside a loop of the SASS."""
    return sum(1 for code in loop_instructions(kernel) if re.search(opcode, code))


def spills_in_loops(kernel) -> int:
    """Local-memory loads and stores (STL / LDL) inside a loop. A spill outside every loop
    costs a few instructions a program; inside the K loop it costs every step."""
    return in_loops(kernel, r"\b(STL|LDL)\b")
