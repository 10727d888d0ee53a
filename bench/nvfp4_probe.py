"""Where the NVFP4 batch-1 decode time goes (issue 4's 1.5x-floor target): launch shapes and
pipeline depths of beam::moe_nvfp4 at T=1 and of beam::linear_nvfp4 at M=1, Beam-1.0 shapes,
CUDA-graph replays, each checked against its reference.

    PYTHONPATH=. python3 bench/nvfp4_probe.py [--tokens T]   # the sweep, batch T
    PYTHONPATH=. ncu --kernel-name regex:_moe_nvfp4 --launch-skip 4 --launch-count 2 \\
        python3 bench/nvfp4_probe.py --once 32,128,2,3   # a few plain calls for the profiler
"""

from __future__ import annotations

import argparse

import torch

import kernels_moe as km
from _linear_testdata import linear_args
from beam_trtllm.config import preset
from kernels import time_graph_us
from plugins import linear_nvfp4, moe_nvfp4
from plugins._moe_common import GemmConfig, combine

G = lambda bn, bk, nw, st, bm=16: GemmConfig(bm, bn, bk, nw, st, swap=True)  # noqa: E731
SHAPES = [G(64, 128, 4, 4), G(32, 128, 2, 3), G(32, 128, 2, 4), G(16, 128, 1, 3),
          G(16, 128, 1, 4), G(32, 64, 2, 3), G(32, 128, 2, 3, 8), G(32, 128, 2, 4, 8),
          G(16, 128, 1, 3, 8), G(16, 128, 1, 4, 8), G(64, 128, 4, 4, 8)]


def row(name, fn, want, floor_us):
    try:
        rel = ((fn().float() - want.float()).norm() / want.float().norm()).item()
        us = time_graph_us(fn)
        print(f"{name:40s} {us:8.1f} us  {us / floor_us:5.2f}x floor  rel {rel:.1e}", flush=True)
    except Exception as exc:  # a shape that does not compile: report, go on
        print(f"{name:40s} {type(exc).__name__}: {str(exc)[:120]}", flush=True)


def main():
    opts = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    opts.add_argument("--once", help="bn,bk,warps,stages: three plain moe calls (for ncu)")
    opts.add_argument("--tokens", type=int, default=1, help="decode batch (<= 64)")
    opts.add_argument("--shapes", help="bm,bn,bk,warps,stages[;...]: these shapes instead of "
                      "the built-in list")
    opts.add_argument("--hot", action="store_true",
                      help="also each shape with all 8 experts reading expert 0's bytes "
                      "(L2-resident): the decode's time without its HBM reads; stride-0 "
                      "views, so per-thread copies)")
    opts.add_argument("--copies", action="store_true",
                      help="also each shape with tma=False (per-thread copies, no TMA loads)")
    opts.add_argument("--no-tma", action="store_true", help="--once with tma=False")
    opts.add_argument("--same-expert", action="store_true",
                      help="every pair routed to one expert (its weights L2-resident; works "
                      "with the TMA loads, unlike --hot)")
    opts.add_argument("--gate-up-split", action="store_true",
                      help="gate/up at T=1 fused (one program: a gate and an up tile) against "
                      "gate and up tiles in separate programs (an ungated GEMM over 2I rows)")
    opts.add_argument("--no-linear", action="store_true", help="skip linear_nvfp4")
    opts.add_argument("--combine", action="store_true",
                      help="the default shapes with the combine in the down GEMM (the op's own "
                      "way for direct pairs), as a separate combine launch, and left out "
                      "(per_slot, as the engine runs it)")
    opts.add_argument("--split-probe", action="store_true",
                      help="what split-K would buy: each GEMM over half of K on twice the pairs")
    opts = opts.parse_args()
    cfg = preset("beam-1.0-501b")
    packed = km.experts("nvfp4", cfg, seed=1)
    x, ids, w = km.routing(cfg, opts.tokens, seed=1)
    if opts.same_expert:
        ids = torch.full_like(ids, int(ids[0, 0]))
    args = km.moe_args("nvfp4", x, ids, w, packed)
    if opts.split_probe:
        return split_probe(cfg, packed, x)
    if opts.gate_up_split:
        return gate_up_split(cfg, packed, ids)
    if opts.once:  # with --hot: the L2-resident weights
        c = G(*map(int, opts.once.split(",")))
        run_args = hot_args(args, cfg) if opts.hot else args
        for _ in range(3):
            moe_nvfp4.moe_nvfp4_triton(*run_args, config13=c, config2=c, tma=not opts.no_tma)
        torch.cuda.synchronize()
        return
    copy = 4274e9  # bytes/s, bench/kernels.py's copy ceiling on this H200
    want = moe_nvfp4.ref_moe_nvfp4(*args)
    floor = km.expert_bytes(packed, ids) / copy * 1e6
    print(f"moe_nvfp4 T={opts.tokens}: floor {floor:.1f} us")
    row("moe default", lambda: moe_nvfp4.moe_nvfp4_triton(*args), want, floor)
    if opts.combine:
        t = x.shape[0]
        row("  combine launch after the down GEMM", lambda: combine(
            moe_nvfp4.moe_nvfp4_triton(*args, per_slot=True).view(-1, x.shape[1]), w, t),
            want, floor)
        us = time_graph_us(lambda: moe_nvfp4.moe_nvfp4_triton(*args, per_slot=True))
        print(f"{'  no combine (per_slot)':40s} {us:8.1f} us", flush=True)
        row("  overlap off (down after all of gate/up)",
            lambda: moe_nvfp4.moe_nvfp4_triton(*args, overlap=False), want, floor)
        us = time_graph_us(lambda: moe_nvfp4.moe_nvfp4_triton(*args, per_slot=True, overlap=False))
        print(f"{'  overlap off, per_slot':40s} {us:8.1f} us", flush=True)
    pairs = [(c, c) for c in SHAPES]
    if opts.shapes:  # "gate/up shape|down shape" or one shape for both
        pairs = [tuple(GemmConfig(*map(int, one.split(",")), swap=True)
                       for one in (spec.split("|") * 2)[:2]) for spec in opts.shapes.split(";")]
    shapes = [c13 for c13, _ in pairs]
    name = lambda c: f"{c.block_m}x{c.block_n},{c.block_k},{c.num_warps}w,{c.num_stages}s"  # noqa: E731
    hot = hot_args(args, cfg) if opts.hot else None
    for c13, c2 in pairs:
        row(f"moe {name(c13)} | {name(c2)}",
            lambda: moe_nvfp4.moe_nvfp4_triton(*args, config13=c13, config2=c2), want, floor)
        if opts.copies:
            row("  same, per-thread copies (tma=False)",
                lambda: moe_nvfp4.moe_nvfp4_triton(*args, config13=c13, config2=c2, tma=False),
                want, floor)
        if hot is not None:
            us = time_graph_us(lambda: moe_nvfp4.moe_nvfp4_triton(*hot, config13=c13, config2=c2))
            print(f"{'  same, weights L2-resident (one expert)':40s} {us:8.1f} us", flush=True)
    if opts.no_linear:
        return
    n, k = 8240, cfg.hidden_size  # q/k/v + gate
    largs = linear_args("nvfp4", x.cpu(), n=n, seed=2)
    largs = tuple(a.cuda() for a in largs)
    want = linear_nvfp4.ref_linear_nvfp4(*largs)
    floor = sum(a.numel() * a.element_size() for a in largs[1:]) / copy * 1e6
    print(f"linear_nvfp4 M={opts.tokens} [{k} -> {n}]: floor {floor:.1f} us")
    row("linear default", lambda: linear_nvfp4.linear_nvfp4_triton(*largs), want, floor)
    for c in shapes:
        row(f"linear {name(c)}",
            lambda: linear_nvfp4.linear_nvfp4_triton(*largs, config=c), want, floor)


def hot_args(args, cfg):
    """moe_nvfp4's arguments with every expert's weights and scales read from expert 0's
    (`one_expert`); the launcher's checks are skipped from here on (stride-0 views are not
    contiguous)."""
    moe_nvfp4.check_moe_nvfp4 = lambda *a: (cfg.num_experts, cfg.moe_intermediate_size)
    return tuple(one_expert(a) if a.dim() == 3 else a for a in args)


def one_expert(t):
    """[E, rows, cols] -> the same shape with every expert reading expert 0's bytes (stride
    0): the 8 selected experts' 177 MB shrink to one expert's 22 MB, L2-resident."""
    return t.as_strided(t.shape, (0, t.stride(1), 1))


def gate_up_split(cfg, packed, ids):
    """gate/up alone at T=1 (8 pairs, direct): fused against separate gate and up programs."""
    e, h, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    routing = moe_nvfp4.plan_routing(ids, e, 8, direct=True)
    a = torch.randn(8, h, device="cuda").to(torch.bfloat16)  # ungated: activation row = pair
    args = (packed["w13"], packed["w13_scale"], packed["w13_scale_2"])
    for c in (moe_nvfp4.DECODE_TMA, G(32, 256, 2, 4, 8), G(16, 256, 1, 3, 8), G(64, 256, 4, 3, 8)):
        for gated in (True, False):
            n = inner if gated else 2 * inner
            out = torch.empty(8, n, device="cuda", dtype=torch.bfloat16)
            us = time_graph_us(lambda: moe_nvfp4._gemm(a[:1] if gated else a, *args, out, routing,
                                                       8, 8, n, h, gated, c, True))
            print(f"gate/up {'fused' if gated else 'split'} {c.block_n},{c.block_k},"
                  f"{c.num_warps}w,{c.num_stages}s  {us:7.1f} us", flush=True)


def split_probe(cfg, packed, x):
    """Each decode GEMM alone at T=1 (8 experts, whole K) against the same bytes as 16 pairs
    over the first half of K (what a 2-way split of K would launch, without its reduction)."""
    e, h, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    perm = torch.randperm(e, device="cuda")
    for gated, w, s, s2, n, k in ((True, "w13", "w13_scale", "w13_scale_2", inner, h),
                                  (False, "w2", "w2_scale", "w2_scale_2", h, inner)):
        for pairs, depth in ((8, k), (16, k // 2)):
            ids = perm[:pairs].view(pairs // 8, 8).to(torch.int32)
            a = torch.randn(pairs // 8 if gated else pairs, depth, device="cuda").to(torch.bfloat16)
            words = packed[w][:, :, : depth // 2]
            scales = packed[s][:, :, : depth // 16]
            routing = moe_nvfp4.plan_routing(ids, e, 16, direct=True)
            out = torch.empty(pairs, n, device="cuda", dtype=torch.bfloat16)
            for c in (moe_nvfp4.DECODE, G(16, 128, 1, 3), G(32, 128, 2, 4)):
                def run():
                    moe_nvfp4._gemm(a, words, scales, packed[s2], out, routing, pairs, 8, n,
                                    depth, gated, c, False)
                    return out
                us = time_graph_us(run)
                print(f"{'gate/up' if gated else 'down':8s} {pairs:2d} pairs x K={depth:5d} "
                      f"{c.block_n},{c.block_k},{c.num_warps}w,{c.num_stages}s  {us:7.1f} us",
                      flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
