"""FP8 MoE at mid-size prefill token counts (a single prompt's chunk): the launcher's default
64-row per-thread shapes against tail-block layouts that take the TMA path. At these sizes
each expert gets 64-128 rows and the op streams every expert's weights about once, so it is
bound by weight reads more than by the tensor cores. Each run checked against ref_moe_fp8.

    PYTHONPATH=.:bench python3 bench/moe_mid_probe.py [--tokens 2048,4096]
"""

from __future__ import annotations

import argparse

import kernels as kb
import kernels_moe as km
from plugins import moe_fp8
from plugins._moe_common import GemmConfig as G

VARIANTS = {
    "default (per-thread, 64-row blocks)": {},
    "64/64 4w4s, 32-row tails, TMA": dict(config13=G(64, 64, 128, 4, 4, tail_m=32),
                                          config2=G(64, 64, 128, 4, 4, tail_m=32)),
    "64/64 4w4s, 32-row tails, per-thread": dict(config13=G(64, 64, 128, 4, 4, tail_m=32),
                                                 config2=G(64, 64, 128, 4, 4, tail_m=32),
                                                 tma=False),
    "64/128 4w3s, 32-row tails, TMA": dict(config13=G(64, 128, 128, 4, 3, tail_m=32),
                                           config2=G(64, 128, 128, 4, 3, tail_m=32)),
    "64 swapped gate/up, 32-row tails, TMA": dict(
        config13=G(64, 128, 128, 4, 3, swap=True, tail_m=32),
        config2=G(64, 128, 128, 4, 3, tail_m=32)),
    "16K-prefill shapes, 64-row tails, TMA": dict(
        config13=G(128, 128, 128, 8, 3, swap=True, tail_m=64),
        config2=G(128, 128, 128, 4, 3, tail_m=64)),
    "16K-prefill shapes, 32-row tails, TMA": dict(
        config13=G(128, 128, 128, 8, 3, swap=True, tail_m=32),
        config2=G(128, 128, 128, 4, 3, tail_m=32)),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="2048,4096")
    opts = parser.parse_args(argv)
    ctx = type("Ctx", (), {"rel_err": staticmethod(kb.rel_err)})
    for t in [int(v) for v in opts.tokens.split(",")]:
        _, ceil, args, flops = km.fp8_prefill_case(t)
        ref = moe_fp8.ref_moe_fp8(*args)
        for label, kw in VARIANTS.items():
            def run():
                return moe_fp8.moe_fp8_triton(*args, **kw)
            status = km.check(ctx, "fp8", run(), ref)
            us = kb.time_us(run)
            print(f"| T={t} | {label} | {us:.1f} | "
                  f"{100 * flops / us / 1e6 / ceil['fp8_TFLOPs']:.1f}% | {status} |", flush=True)


if __name__ == "__main__":
    main()
