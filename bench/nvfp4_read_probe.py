"""Is the NVFP4 batch-1 decode bound by its weight reads or by its decode? (issue 4)

Reads the bytes of the decode GEMMs' weight tiles the way `moe_nvfp4`'s K loop reads them
(rows of one expert's packed codes, BLOCK_N rows a program, BLOCK_K/2 bytes of each row a K
step through the same pipelined loads; gate/up also the matching up_proj rows) and only XORs
them together: no decode, no MMA. Against the copy ceiling of the same run and the real
`moe_nvfp4` at T=1 over the same byte count, this says how much of the decode's time the read
pattern alone costs. Also the same bytes stored tile by tile (each program's K step one
contiguous block), the layout a build-time repack could write.

    PYTHONPATH=.:bench python3 bench/nvfp4_read_probe.py [--fp8]   # --fp8: moe_fp8's bytes
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from kernels import time_graph_us, time_us

EXPERTS, HIDDEN, INTER = 8, 5120, 2560  # Beam-1.0: 8 routed experts a token


@triton.jit
def _read_rows(w_ptr, out_ptr, K_WORDS, ROW_WORDS, UP_ROWS, PROGRAM_ROWS, GATED: tl.constexpr,
               TILED: tl.constexpr, ONE_LOAD: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_KW: tl.constexpr):
    """XOR of every word of BLOCK_N rows from row pid * PROGRAM_ROWS (and with GATED the rows
    UP_ROWS further); row-major rows of ROW_WORDS words, or with TILED one contiguous
    [BLOCK_N, BLOCK_KW] block a step. ONE_LOAD: the gate and up rows as one [2 * BLOCK_N,
    BLOCK_KW] load a step instead of two."""
    pid = tl.program_id(0)
    if ONE_LOAD:
        both = tl.arange(0, 2 * BLOCK_N)
        rows2 = pid * PROGRAM_ROWS + both % BLOCK_N + (both // BLOCK_N) * UP_ROWS
        ptrs2 = w_ptr + rows2.to(tl.int64)[:, None] * ROW_WORDS + tl.arange(0, BLOCK_KW)[None, :]
        acc2 = tl.zeros([2 * BLOCK_N, BLOCK_KW], dtype=tl.int32)
        for _ in range(0, K_WORDS, BLOCK_KW):
            acc2 ^= tl.load(ptrs2)
            ptrs2 += BLOCK_KW
        tl.store(out_ptr + pid * BLOCK_N + tl.arange(0, BLOCK_N),
                 tl.xor_sum(tl.reshape(acc2, (2, BLOCK_N, BLOCK_KW)), 0).sum(1))
        return
    rows = pid * PROGRAM_ROWS + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_KW)
    if TILED:  # program pid's step s: block (pid, s) of BLOCK_N * BLOCK_KW words
        ptrs = w_ptr + pid.to(tl.int64) * BLOCK_N * K_WORDS + tl.arange(0, BLOCK_N)[:, None] \
            * BLOCK_KW + cols[None, :]
        step = BLOCK_N * BLOCK_KW
    else:
        ptrs = w_ptr + rows.to(tl.int64)[:, None] * ROW_WORDS + cols[None, :]
        step = BLOCK_KW
    acc = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.int32)
    for _ in range(0, K_WORDS, BLOCK_KW):
        acc ^= tl.load(ptrs)
        if GATED:
            acc ^= tl.load(ptrs + UP_ROWS * ROW_WORDS)
        ptrs += step
    tl.store(out_ptr + pid * BLOCK_N + tl.arange(0, BLOCK_N), tl.xor_sum(acc, 1))


def read_us(words, rows, k_words, gated, tiled, block_n, block_kw, warps, stages,
            interleaved=False, one_load=False):
    """rows: output rows (gate rows with `gated`); `interleaved`: each program's up rows follow
    its gate rows (blocks of block_n), else they sit `rows` rows further (ModelOpt's w13)."""
    out = torch.empty(rows, dtype=torch.int32, device="cuda")
    up_rows = (block_n if interleaved else rows) if gated else 0
    program_rows = block_n * (2 if interleaved else 1)

    def fn():
        _read_rows[(rows // block_n,)](words, out, k_words, k_words, up_rows, program_rows,
                                       GATED=gated, ONE_LOAD=one_load,
                                       TILED=tiled, BLOCK_N=block_n, BLOCK_KW=block_kw,
                                       num_warps=warps, num_stages=stages)
    return time_graph_us(fn)


# (BLOCK_N, words a row a step, warps, stages): the NVFP4 decode's shapes and neighbours; FP8:
# moe_fp8's decode shape (64 rows x 128 bytes, 4 warps, 4 stages) and neighbours
SHAPES = {"nvfp4": ((32, 16, 2, 3), (32, 16, 2, 4), (32, 32, 2, 3), (32, 64, 2, 3),
                    (64, 16, 4, 3), (16, 32, 1, 3)),
          "fp8": ((64, 32, 4, 4), (64, 32, 4, 6), (64, 64, 4, 4), (32, 32, 2, 4),
                  (32, 64, 2, 4))}


def table_row(label, layout, words, us, block_n, block_kw, warps, stages, copy):
    gbs = words.numel() * 4 / us / 1e3
    print(f"| {label} | {layout} | {block_n} x {block_kw * 4} B | {warps} | {stages} | "
          f"{us:.1f} | {gbs:.0f} | {100 * gbs / copy:.1f}% |", flush=True)


def main():
    fmt = "fp8" if "--fp8" in sys.argv else "nvfp4"
    per_word = 4 if fmt == "fp8" else 8  # weights a 32-bit word
    n = 1 << 29  # 1 GiB of BF16 each way
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = 2 * n * 2 / time_us(lambda: dst.copy_(src)) / 1e3  # GB/s
    del src, dst
    # gate/up: 8 experts x I rows (their up rows I further), H weights a row; down: 8 x H rows
    gate_up = torch.randint(-2**31, 2**31 - 1, (EXPERTS * 2 * INTER * HIDDEN // per_word,),
                            dtype=torch.int32, device="cuda")
    down = torch.randint(-2**31, 2**31 - 1, (EXPERTS * HIDDEN * INTER // per_word,),
                         dtype=torch.int32, device="cuda")
    print(f"{fmt}: copy ceiling {copy:.0f} GB/s; gate/up {gate_up.numel() * 4 / 1e6:.1f} MB "
          f"(floor {gate_up.numel() * 4 / copy / 1e3:.1f} us), down {down.numel() * 4 / 1e6:.1f}"
          f" MB (floor {down.numel() * 4 / copy / 1e3:.1f} us)", flush=True)
    print("| GEMM | layout | rows x bytes a step | warps | stages | us | GB/s | % copy |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, words, rows, k_words, gated in (
            ("gate/up", gate_up, EXPERTS * INTER, HIDDEN // per_word, True),
            ("down", down, EXPERTS * HIDDEN, INTER // per_word, False)):
        for tiled in (False, True):
            for block_n, block_kw, warps, stages in SHAPES[fmt]:
                # tiled gate/up: each program's gate and up blocks stored one after the other
                us = read_us(words, rows * (1 + (gated and tiled)), k_words, gated and not tiled,
                             tiled, block_n, block_kw, warps, stages)
                table_row(name, "tiled" if tiled else "rows", words, us, block_n, block_kw,
                          warps, stages, copy)
    # what makes gate/up's row-major reads slow: the row pitch, or the two distant row sets?
    rows = EXPERTS * INTER
    for label, kwargs in (
            ("gate/up buffer as one row set", dict(rows=2 * rows, gated=False)),
            ("gate/up, up rows after each block of gate rows", dict(rows=rows, gated=True,
                                                                     interleaved=True)),
            ("gate/up, gate and up rows as one load", dict(rows=rows, gated=True,
                                                            one_load=True))):
        for block_n, block_kw, warps, stages in SHAPES[fmt][:3]:
            us = read_us(gate_up, k_words=HIDDEN // per_word, tiled=False, block_n=block_n,
                         block_kw=block_kw, warps=warps, stages=stages, **kwargs)
            table_row(label, "rows", gate_up, us, block_n, block_kw, warps, stages, copy)


if __name__ == "__main__":
    main()
