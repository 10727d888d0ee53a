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
from beam_trtllm.config import preset
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
    cfg = preset("beam-1.0-501b")
    ceil = kb.measure_ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, FP8 {ceil['fp8_TFLOPs']:.0f} TFLOP/s")
    packed = km.experts("fp8", cfg, seed=1)
    x, ids, w = km.routing(cfg, opts.tokens, seed=opts.tokens)
    scales = {"a13_scale": (x.abs().amax().float() / 448).reshape(()),
              "a2_scale": torch.tensor(km.H_AMAX / 448, device="cuda")}
    args = km.moe_args("fp8", x, ids, w, packed, scales)
    ref = moe_fp8.ref_moe_fp8(*args)
    flops = 2 * opts.tokens * 8 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
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
        print(f"| {tail} | {padding(ids, cfg.n_routed_experts, 128, tail):.3f} | {us / 1e3:.3f} | "
              f"{rate:.0f} | {100 * rate / ceil['fp8_TFLOPs']:.1f}% | {status} |", flush=True)


if __name__ == "__main__":
    main()
