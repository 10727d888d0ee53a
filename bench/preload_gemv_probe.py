"""What an o_proj that loads its weights on chip while the attention runs could take (issue 5's
next step, not a shipped kernel): the FP8 o_proj GEMV of a batch-1 decode [5120 x 6144],
launched early by programmatic dependent launch behind a stand-in for the attention kernels
(one program spinning for W us, HBM idle, as qk_prep + the split + the combine leave it).

Each GEMV program owns BLOCK_N rows and one of PARTS K ranges. Before `griddepcontrol.wait` it
loads the first K_PRE columns of its rows into registers; after the wait it multiplies them
by x and streams the rest of its range. Compared in the same CUDA graph shape with the shipped
path (`linear_fp8` split in two over K, as the engine runs o_proj): spin + GEMV against spin
alone, outputs checked against the FP32 reference.

    PYTHONPATH=.:bench python3 bench/preload_gemv_probe.py [--spin-us 11] [--flush-mb 256]

--shipped STAGES,SPLIT[;...] times the shipped kernel (no preload) in the decode chain's
form instead: launched early behind the spin, and serially. --n / --k pick the GEMM (q/k/v:
--n 8192 --k 5120 behind a norm's --spin-us 5). (Session 13 also tried a preload in the shipped
kernel itself, commit 8f963d8: no gain, removed; docs/BENCHMARKS.md.)
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from kernels import time_graph_us
from plugins import _pdl
from plugins._moe_common import GemmConfig
from plugins.linear_fp8 import SPLIT_CONFIG, linear_fp8_triton

FP8 = torch.float8_e4m3fn


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _spin_kernel(ns, PDL: tl.constexpr):
    """One program busy for `ns` nanoseconds, letting the next kernel launch at once."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    start = _now_ns()
    while _now_ns() - start < ns:
        pass


@triton.jit
def _preload_gemv_kernel(w_ptr, x_ptr, ws_ptr, xs_ptr, out_ptr, N, K, K_PART: tl.constexpr,
                         K_PRE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr):
    pid_n, part = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = part * K_PART
    cols = k0 + tl.arange(0, K_PRE)
    w_pre = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :])  # registers
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.sum(w_pre.to(tl.float32) * tl.load(x_ptr + cols).to(tl.float32)[None, :], axis=1)
    for k in range(k0 + K_PRE, k0 + K_PART, BLOCK_K):
        kk = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :])
        acc += tl.sum(w.to(tl.float32) * tl.load(x_ptr + kk).to(tl.float32)[None, :], axis=1)
    scale = tl.load(ws_ptr + rows) * tl.load(xs_ptr)
    tl.store(out_ptr + part * N + rows, acc * scale)


def preload_gemv(w, x, ws, xs, out, parts, k_pre, block_n, block_k, warps, stages, pdl):
    n, k = w.shape
    _preload_gemv_kernel[(n // block_n, parts)](
        w, x, ws, xs, out, n, k, K_PART=k // parts, K_PRE=k_pre, BLOCK_N=block_n,
        BLOCK_K=block_k, PDL=pdl, num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if pdl else {}))


def main() -> None:
    opts = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    opts.add_argument("--spin-us", type=float, default=11.0)
    opts.add_argument("--flush-mb", type=int, default=256,
                      help="bytes read before the spin in every replay, so that the weights "
                      "come from HBM as in the engine's chained graph (0: L2-hot replays)")
    opts.add_argument("--shapes", default="128,3,1024,128,16,3;128,3,512,128,16,3;"
                      "64,2,1024,128,8,3;128,3,256,128,8,3",
                      help="block_n,parts,k_pre,block_k,warps,stages[;...]")
    opts.add_argument("--shipped", default="",
                      help="stages,split[;...]: the shipped kernel launched early (docstring)")
    opts.add_argument("--n", type=int, default=5120)
    opts.add_argument("--k", type=int, default=6144)
    opts = opts.parse_args()
    n, k = opts.n, opts.k
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).to(FP8)
    ws = torch.rand(n, device="cuda", generator=gen) * 0.02 + 0.01
    x = torch.randn(1, k, device="cuda", generator=gen).to(FP8)
    xs = torch.full((), 0.05, device="cuda")
    want = (x.float() @ w.float().t())[0] * ws * xs
    ns = int(opts.spin_us * 1e3)
    flush = torch.ones(opts.flush_mb << 18, device="cuda")  # (4-byte words)
    flushed = torch.empty((), device="cuda")

    def spin(pdl):  # the L2 flush (a read: it leaves clean lines, as weights do), then the
        if opts.flush_mb:  # stand-in for the attention
            torch.sum(flush, dim=0, out=flushed)
        _spin_kernel[(1,)](ns, PDL=pdl, num_warps=1)
    spin_us = time_graph_us(lambda: spin(False))
    print(f"L2 flush ({opts.flush_mb} MB) + stand-in for the attention: {spin_us:.1f} us",
          flush=True)
    shipped = lambda: linear_fp8_triton(x, w, ws, xs, torch.float32, split_k=2)  # noqa: E731
    got = shipped().sum(0)[0]
    us = time_graph_us(lambda: (spin(False), shipped())) - spin_us
    rel = ((got - want).norm() / want.norm()).item()
    print(f"{'shipped linear_fp8, split 2':44s} {us:6.1f} us after the spin  rel {rel:.1e}")
    if opts.shipped:
        time_shipped_splits(opts.shipped, x, w, ws, xs, spin, spin_us)
        return
    for spec in opts.shapes.split(";"):
        block_n, parts, k_pre, block_k, warps, stages = map(int, spec.split(","))
        out = torch.empty(parts, n, device="cuda")
        for pdl in (True, False):
            def run():
                spin(pdl)
                preload_gemv(w, x[0], ws, xs, out, parts, k_pre, block_n, block_k, warps,
                             stages, pdl)
            try:
                run()
                rel = ((out.sum(0) - want).norm() / want.norm()).item()
                us = time_graph_us(run) - spin_us
                print(f"preload {spec:20s} {'PDL' if pdl else 'serial':7s} {us:6.1f} us after "
                      f"the spin  rel {rel:.1e}", flush=True)
            except Exception as exc:  # a shape that does not compile: report, go on
                print(f"preload {spec:20s} {type(exc).__name__}: {str(exc)[:160]}", flush=True)


def time_shipped_splits(specs: str, x, w, ws, xs, spin, spin_us: float) -> None:
    """linear_fp8 split in SPLIT with STAGES pipeline stages behind the spin: launched early
    (the decode chain) and serially."""
    for spec in specs.split(";"):
        stages, split = map(int, spec.split(","))
        cfg = GemmConfig(SPLIT_CONFIG.block_m, SPLIT_CONFIG.block_n, SPLIT_CONFIG.block_k,
                         SPLIT_CONFIG.num_warps, stages, swap=True)
        for chain in (True, False):
            _pdl.set_decode_chain(chain)
            call = lambda: linear_fp8_triton(x, w, ws, xs, torch.float32,  # noqa: E731
                                             split_k=split, config=cfg)
            us = time_graph_us(lambda: (spin(chain), call())) - spin_us
            print(f"shipped, {stages} stages, split {split}  {'PDL' if chain else 'serial':7s} "
                  f"{us:6.1f} us after the spin", flush=True)
    _pdl.set_decode_chain(True)


if __name__ == "__main__":
    main()
