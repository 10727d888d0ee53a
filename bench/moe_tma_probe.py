"""FP8 MoE prefill (16K tokens at Beam-1.0 shapes): each grouped GEMM with its operands loaded
by per-thread asynchronous copies (cp.async, the activation rows gathered by pointer) or by
the Hopper TMA (activations quantized straight into sorted rows first), over launch shapes;
then the whole op both ways. Outputs compared bit for bit with the per-thread path, the op
also against ref_moe_fp8.

    PYTHONPATH=.:bench python3 bench/moe_tma_probe.py [--tokens 16384]
"""

from __future__ import annotations

import argparse

import torch

import kernels as kb
import kernels_moe as km
from plugins import moe_fp8
from plugins._fp8_act import quant_fp8_per_tensor, quant_fp8_sorted_rows
from plugins._moe_common import GemmConfig, plan_routing

GATE_UP = GemmConfig(128, 128, 128, 8, 3, swap=True, tail_m=64)  # the launcher's prefill shapes
DOWN = GemmConfig(128, 128, 128, 4, 3, tail_m=64)


def gemm_runs(args):
    """(label, GEMM, run) of each GEMM alone, per-thread loads and TMA, and the gather."""
    x, ids, _, w13, s13, w2, s2, a13, a2 = args
    e, inner, h, top_k = w13.shape[0], w2.shape[2], w2.shape[1], ids.shape[1]
    numel = ids.numel()
    routing = plan_routing(ids, e, 128, False, 64)
    xq = quant_fp8_per_tensor(x, a13)
    xs = quant_fp8_sorted_rows(x, a13, routing.slot_rows, routing.rows)
    hq = torch.zeros((routing.rows, inner), dtype=torch.float8_e4m3fn, device=x.device)
    y = torch.empty((numel, h), dtype=x.dtype, device=x.device)
    outs = {"gate/up": hq, "down": y}

    def g13(cfg, tma):
        return lambda: moe_fp8._gemm(xs if tma else xq, a13, w13, s13, hq, a2, routing, numel,
                                     top_k, inner, h, True, x.dtype, cfg, tma)

    def g2(cfg, tma):
        return lambda: moe_fp8._gemm(hq, a2, w2, s2, y, a2, routing, numel, top_k, h, inner,
                                     False, x.dtype, cfg, tma)

    def with_(cfg, **kw):
        return GemmConfig(**{**cfg.__dict__, **kw})

    runs = [
        ("quantize x (per tensor)", None, lambda: quant_fp8_per_tensor(x, a13)),
        ("quantize x into sorted rows", None,
         lambda: quant_fp8_sorted_rows(x, a13, routing.slot_rows, routing.rows)),
        ("per-thread 8w3s", "gate/up", g13(GATE_UP, False)),
        ("TMA 8w3s", "gate/up", g13(GATE_UP, True)),
        ("TMA 8w4s", "gate/up", g13(with_(GATE_UP, num_stages=4), True)),
        ("TMA bn64 4w3s", "gate/up", g13(with_(GATE_UP, block_n=64, num_warps=4), True)),
        ("per-thread 4w3s", "down", g2(DOWN, False)),
        ("TMA 4w3s", "down", g2(DOWN, True)),
        ("TMA 4w3s group 4", "down", g2(with_(DOWN, group_m=4), True)),
        ("TMA 4w4s", "down", g2(with_(DOWN, num_stages=4), True)),
        ("TMA 256 wide swapped 8w3s", "down", g2(with_(DOWN, block_n=256, num_warps=8,
                                                         swap=True), True)),
        ("TMA 256 wide swapped bk64 8w4s", "down", g2(with_(DOWN, block_n=256, block_k=64,
                                                              num_warps=8, num_stages=4,
                                                              swap=True), True)),
        ("TMA 256 wide 8w3s (spills 112 B)", "down", g2(with_(DOWN, block_n=256, num_warps=8),
                                                        True)),
    ]
    return outs, runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    opts = parser.parse_args(argv)
    _, ceil, args, flops = km.fp8_prefill_case(opts.tokens)
    outs, runs = gemm_runs(args)
    first = {}
    print("| GEMM | loads, launch shape | ms | % of FP8 rate | bits equal to per-thread |")
    print("| --- | --- | ---: | ---: | --- |")
    for label, gemm, run in runs:
        run()
        us = kb.time_us(run)
        if gemm is None:
            print(f"| - | {label} | {us / 1e3:.3f} | | |", flush=True)
            continue
        got = outs[gemm].view(torch.uint8).clone() if gemm == "gate/up" else outs[gemm].clone()
        same = torch.equal(got, first.setdefault(gemm, got))
        work = flops * (2 / 3 if gemm == "gate/up" else 1 / 3)
        print(f"| {gemm} | {label} | {us / 1e3:.3f} | "
              f"{100 * work / us / 1e6 / ceil['fp8_TFLOPs']:.1f}% | {same} |", flush=True)
    ref = moe_fp8.ref_moe_fp8(*args)
    ctx = type("Ctx", (), {"rel_err": staticmethod(kb.rel_err)})
    per_thread = moe_fp8.moe_fp8_triton(*args, tma=False)
    print("| op | loads | ms | % of FP8 rate | check |")
    for label, tma in (("per-thread", False), ("TMA (launcher's choice)", None)):
        def op():
            return moe_fp8.moe_fp8_triton(*args, tma=tma)
        out = op()
        status = f"{km.check(ctx, 'fp8', out, ref)}, bits equal {torch.equal(out, per_thread)}"
        us = kb.time_us(op)
        print(f"| moe_fp8 T={opts.tokens} | {label} | {us / 1e3:.3f} | "
              f"{100 * flops / us / 1e6 / ceil['fp8_TFLOPs']:.1f}% | {status} |", flush=True)


if __name__ == "__main__":
    main()
