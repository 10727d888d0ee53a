"""FP8 MoE prefill (16K tokens at Beam-1.0 shapes) with and without tail blocks: how much of
the MMA work is padding, and the op's time per tail size (0 = every partial block padded to
128 rows). Each variant's output is checked against ref_moe_fp8 at the bench tolerance.

    PYTHONPATH=. python3 bench/moe_prefill_probe.py [--tokens 16384] [--tails 0,16,32,64]
"""

from __future__ import annotations

import argparse

import torch

import kernels as kb
import kernels_moe as km
from plugins import moe_fp8
from plugins._moe_common import GemmConfig


def padding(ids: torch.Tensor, experts: int, block_m: int, tail_m: int) -> float:
    """Sorted rows (tail-block layout of plugins/_moe_sort.py) over pairs."""
    counts = torch.bincount(ids.flatten().long(), minlength=experts)
    rem = counts % block_m
    last = torch.where(rem == 0, 0, block_m)
    if tail_m:
        last = torch.where((rem > 0) & (rem <= tail_m), tail_m, last)
    return float((counts // block_m * block_m + last).sum()) / ids.numel()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--tails", default="0,16,32,64")
    opts = parser.parse_args(argv)
    cfg, ceil, args, flops = km.fp8_prefill_case(opts.tokens)
    ids = args[1]
    ref = moe_fp8.ref_moe_fp8(*args)
    ctx = type("Ctx", (), {"rel_err": staticmethod(kb.rel_err)})
    print("| tail_m | rows / pairs | ms | TFLOP/s | % of FP8 rate | check |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for tail in [int(v) for v in opts.tails.split(",")]:
        c13 = GemmConfig(128, 128, 128, 8, 3, swap=True, tail_m=tail)
        c2 = GemmConfig(128, 128, 128, 4, 3, tail_m=tail)

        def run():
            return moe_fp8.moe_fp8_triton(*args, config13=c13, config2=c2)
        status = km.check(ctx, "fp8", run(), ref)
        us = kb.time_us(run)
        rate = flops / us / 1e6
        print(f"| {tail} | {padding(ids, cfg.num_experts, 128, tail):.3f} | {us / 1e3:.3f} | "
              f"{rate:.0f} | {100 * rate / ceil['fp8_TFLOPs']:.1f}% | {status} |", flush=True)


if __name__ == "__main__":
    main()
