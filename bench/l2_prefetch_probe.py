"""Does pulling o_proj's and the router's weights into L2 during the attention side of a batch-1
decode step make them faster, and what does the prefetch cost on the stream? (H200)

    PYTHONPATH=. python3 bench/l2_prefetch_probe.py [--case oproj-router|qkv] [--window-us 15]
        [--out DIR]

Each variant is one CUDA graph, replayed and timed with CUDA events (median):
    fill 512 MB (evicts L2)  ->  [beam::l2_prefetch]  ->  spin for W µs  ->  [o_proj, router]
The spin stands in for qk_prep + attention + combine (latency-bound, HBM idle); case `qkv`
times the next layer's q/k/v GEMM instead (its window would be the MoE combine and the
boundary norm, ~7 µs). Reported:
the targets' time cold (no prefetch), after a prefetch over table chunk sizes and rows per
program, and L2-hot (the targets replayed back to back, no fill), each minus the graph without
the targets; and the prefetch's own cost on the stream (prefetch + spin minus spin). Outputs
of every variant are checked bit for bit against the cold run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import plugins  # noqa: F401  (registers torch.ops.beam.*)
from beam_trtllm.config import BeamConfig
from plugins.l2_prefetch import launch_l2_prefetch, prefetch_table

DEV = torch.device("cuda")


def graph_ms(fn, replays: int = 60) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=("oproj-router", "qkv"), default="oproj-router")
    ap.add_argument("--window-us", type=float, default=15.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = BeamConfig()
    torch.manual_seed(0)
    hid, o_in = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    w_o = (torch.randn(hid, o_in, device=DEV) * 0.5).to(torch.float8_e4m3fn)
    w_o_scale = torch.tensor(0.01, device=DEV)
    in_scale = torch.tensor(0.05, device=DEV)
    xq = (torch.randn(1, o_in, device=DEV) * 4).to(torch.float8_e4m3fn)
    x = torch.randn(1, hid, device=DEV).to(torch.bfloat16)
    w_r = torch.randn(cfg.n_routed_experts, hid, device=DEV) * 0.02
    b_r = torch.randn(cfg.n_routed_experts, device=DEV) * 0.01
    qkv_out = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    w_qkv = (torch.randn(qkv_out, hid, device=DEV) * 0.5).to(torch.float8_e4m3fn)
    xq_qkv = (torch.randn(1, hid, device=DEV) * 4).to(torch.float8_e4m3fn)
    fill = torch.empty(256 << 20, dtype=torch.float16, device=DEV)
    cycles = int(args.window_us * torch.cuda.get_device_properties(DEV).clock_rate / 1e3)
    outs: dict[str, list] = {}

    def targets(tag):
        if args.case == "qkv":
            outs[tag] = [torch.ops.beam.linear_fp8(xq_qkv, w_qkv, w_o_scale, in_scale,
                                                   torch.bfloat16)]
            return
        y = torch.ops.beam.linear_fp8(xq, w_o, w_o_scale, in_scale, torch.bfloat16)
        ids, wts = torch.ops.beam.group_router(x, w_r, b_r, cfg.n_group, cfg.topk_group,
                                               cfg.num_experts_per_tok,
                                               cfg.routed_scaling_factor, cfg.norm_topk_prob)
        outs[tag] = [y, ids, wts]

    def step(tag, table=None, rows=32, with_targets=True, window=True):
        def fn():
            fill.fill_(1.0)
            if table is not None:
                launch_l2_prefetch(table, rows)
            if window:
                torch.cuda._sleep(cycles)
            if with_targets:
                targets(tag)
        return fn

    rows_out = []
    base = graph_ms(step("base", with_targets=False))
    base0 = graph_ms(step("base0", with_targets=False, window=False))
    cold = graph_ms(step("cold")) - base
    cold0 = graph_ms(step("cold0", window=False)) - base0
    hot = graph_ms(lambda: targets("hot"))
    rows_out.append(("cold (no prefetch)", "-", "-", cold * 1e3, cold0 * 1e3))
    rows_out.append(("L2-hot (no fill)", "-", "-", hot * 1e3, hot * 1e3))
    ref = [t.clone() for t in outs["cold"]]
    for chunk in (16 << 10, 64 << 10, 256 << 10, 1008 << 10):
        table = prefetch_table([w_qkv] if args.case == "qkv" else [w_o, w_r], chunk)
        for rows in (32, 8, 1):
            tag = f"pf{chunk}_{rows}"
            t = graph_ms(step(tag, table, rows)) - base
            t0 = graph_ms(step(tag + "0", table, rows, window=False)) - base0
            cost = graph_ms(step(tag, table, rows, with_targets=False)) - base
            for a, b in zip(ref, outs[tag]):
                assert torch.equal(a, b), f"{tag}: output differs from the cold run's"
            rows_out.append((f"prefetch then targets (cost on stream {cost * 1e3:.1f} µs)",
                             f"{chunk >> 10} KB x {table.shape[0]}", rows, t * 1e3, t0 * 1e3))
    if args.case == "qkv":
        print(f"q/k/v [{qkv_out} x {hid}] FP8 = {w_qkv.numel() / 1e6:.1f} MB; "
              f"window {args.window_us} µs ({cycles} cycles)")
    else:
        mb = (w_o.numel() + w_r.numel() * 4) / 1e6
        print(f"o_proj [{hid} x {o_in}] FP8 + router [{cfg.n_routed_experts} x {hid}] FP32 = "
              f"{mb:.1f} MB; window {args.window_us} µs ({cycles} cycles)")
    print(f"| variant | chunks | rows/program | targets µs after {args.window_us} µs window "
          f"| targets µs, no window |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows_out:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"l2_prefetch_probe_{args.case}.json").write_text(json.dumps(rows_out, indent=1))


if __name__ == "__main__":
    main()
