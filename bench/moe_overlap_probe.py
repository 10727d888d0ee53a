"""The direct-pair MoE decode with its two GEMMs overlapped (the down GEMM launched early by
PDL, each program waiting for its own pair's h tiles) against the down GEMM after all of
gate/up: beam::moe_fp8 and beam::moe_nvfp4 at Beam-1.0 shapes, CUDA-graph replays, combined
and per slot (the engine's form), outputs compared bit for bit and against the reference.

    PYTHONPATH=.:bench python3 bench/moe_overlap_probe.py [--tokens 1,8] [--formats fp8,nvfp4]
"""

from __future__ import annotations

import argparse

import torch

import kernels_moe as km
from beam_trtllm.config import preset
from kernels import time_graph_us
from plugins import moe_fp8, moe_nvfp4

LAUNCHERS = {"fp8": moe_fp8.moe_fp8_triton, "nvfp4": moe_nvfp4.moe_nvfp4_triton}
REFERENCES = {"fp8": moe_fp8.ref_moe_fp8, "nvfp4": moe_nvfp4.ref_moe_nvfp4}
COPY = 4274e9  # bytes/s, bench/kernels.py's copy ceiling on this H200 (the floor's divisor)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def probe(fmt: str, packed, cfg, tokens: int) -> None:
    x, ids, w = km.routing(cfg, tokens, seed=tokens)
    scales = {"a13_scale": (x.abs().amax().float() / 448).reshape(()),
              "a2_scale": torch.tensor(km.H_AMAX / 448, device=x.device)}
    args = km.moe_args(fmt, x, ids, w, packed, scales)
    launch, want = LAUNCHERS[fmt], REFERENCES[fmt](*args)
    floor = km.expert_bytes(packed, ids) / COPY * 1e6
    print(f"moe_{fmt} T={tokens}: floor {floor:.1f} us (copy {COPY / 1e9:.0f} GB/s)", flush=True)
    for per_slot in (False, True):
        on = launch(*args, per_slot=per_slot)
        off = launch(*args, per_slot=per_slot, overlap=False)
        check = "bit-equal" if torch.equal(on, off) else "DIFFER"
        if not per_slot:
            check += f", rel {rel_error(on, want):.1e} vs ref"
        for name, overlap in (("overlapped", True), ("serial", False)):
            us = time_graph_us(lambda: launch(*args, per_slot=per_slot, overlap=overlap))
            form = "per slot" if per_slot else "combined"
            print(f"  {form:9s} {name:10s} {us:8.1f} us  {us / floor:5.2f}x floor  {check}",
                  flush=True)


def main() -> None:
    opts = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    opts.add_argument("--tokens", default="1,8", help="comma list of decode batches (<= 8)")
    opts.add_argument("--formats", default="fp8,nvfp4")
    opts = opts.parse_args()
    cfg = preset("beam-1.0-501b")
    for fmt in opts.formats.split(","):
        packed = km.experts(fmt, cfg, seed=1)
        for tokens in map(int, opts.tokens.split(",")):
            probe(fmt, packed, cfg, tokens)
        del packed
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
