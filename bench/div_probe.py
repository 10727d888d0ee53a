"""Is plugins._common.div_rn_by (RN32(x · RN64(1/s)), in FP64) the correctly rounded
FP32 quotient, as div.rn gives it, on the H200? And are the FP8 codes of the two always equal?

    PYTHONPATH=.:bench:tests/plugins python3 bench/div_probe.py [--pairs 4e9] [--batch 2**26]

Random pairs (tests/plugins/division_check.random_pairs: random FP32 bit patterns and
activation-like x; log-uniform scales, a quarter with all-ones significands), batch by batch.
Prints the mismatch counts: `normal` (normal FP32 quotients whose bits differ: must be 0),
`other` (subnormal / zero / inf / NaN quotients), `codes` (FP8 codes: must be 0).
"""

from __future__ import annotations

import argparse
import time

import torch

import plugins  # noqa: F401
from division_check import division_mismatches, random_pairs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=float, default=4e9)
    ap.add_argument("--batch", type=int, default=1 << 26)
    args = ap.parse_args()
    total = {"normal": 0, "other": 0, "codes": 0}
    batches = int(args.pairs // args.batch)
    start = time.time()
    for b in range(batches):
        x, s = random_pairs(args.batch, seed=b, device="cuda")
        for k, v in division_mismatches(x, s).items():
            total[k] += v
        if b % max(1, batches // 8) == 0:
            print(f"  batch {b + 1}/{batches}: {total} ({time.time() - start:.0f} s)", flush=True)
    print("| pairs | normal FP32 quotients differing | other quotients differing "
          "| FP8 codes differing |")
    print("| ---: | ---: | ---: | ---: |")
    print(f"| {batches * args.batch:,} | {total['normal']} | {total['other']} | {total['codes']} |")


if __name__ == "__main__":
    main()
