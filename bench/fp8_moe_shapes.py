"""moe_fp8 at T=1 over gate/up launch shapes with 256-byte K steps (the read pattern that
bench/nvfp4_read_probe.py --fp8 reads at the copy ceiling) and fewer stages, down fixed at
its default; CUDA-graph replays, each checked against ref_moe_fp8 once. (issue 5)

    PYTHONPATH=.:bench python3 bench/fp8_moe_shapes.py
"""

from __future__ import annotations

import torch

import kernels_moe as km
from beam_trtllm.config import preset
from kernels import time_graph_us
from plugins import moe_fp8
from plugins._moe_common import GemmConfig

SHAPES = ((64, 128, 4, 4), (64, 256, 4, 2), (64, 256, 4, 3), (32, 256, 2, 2), (32, 256, 2, 3),
          (32, 256, 4, 3), (64, 512, 4, 2), (32, 512, 2, 2))  # (rows, K, warps, stages)


def main():
    cfg = preset("beam-1.0-501b")
    packed = km.experts("fp8", cfg, seed=1)
    x, ids, w = km.routing(cfg, 1, seed=1)
    scales = {"a13_scale": (x.abs().amax().float() / 448).reshape(()),
              "a2_scale": torch.tensor(km.H_AMAX / 448, device="cuda")}
    args = km.moe_args("fp8", x, ids, w, packed, scales)
    want = moe_fp8.ref_moe_fp8(*args).float()
    floor = km.expert_bytes(packed, ids) / 4273e9 * 1e6
    down = GemmConfig(16, 64, 128, 4, 4, swap=True)
    print(f"moe_fp8 T=1: floor {floor:.1f} us at 4,273 GB/s; down {down}")
    for bn, bk, nw, st in SHAPES:
        c13 = GemmConfig(16, bn, bk, nw, st, swap=True)
        fn = lambda: moe_fp8.moe_fp8_triton(*args, config13=c13, config2=down)  # noqa: E731
        try:
            rel = ((fn().float() - want).norm() / want.norm()).item()
            us = time_graph_us(fn)
        except Exception as exc:  # a shape that does not fit: report, go on
            print(f"gate/up {bn} x {bk}, {nw}w, {st}s: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        print(f"gate/up {bn} x {bk}, {nw}w, {st}s: {us:7.1f} us  {us / floor:.2f}x  rel {rel:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
