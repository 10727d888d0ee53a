"""Speed of the per-channel FP8 ops (beam::linear_fp8_channel, beam::moe_fp8_channel:
compressed-tensors FP8_DYNAMIC checkpoints) at Beam-1.0 decode shapes on one GPU, against the
weight-read floor: the bytes of FP8 weights and scales a call must read, at the device copy
bandwidth measured in the same run (bench/_common.measure_ceilings: a 2 GiB copy).

    PYTHONPATH=. python3 bench/kernels_fp8_channel.py [--out DIR] [--tokens 1,8,64]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/kernels_fp8_channel.py --smoke   # CPU

Rows: linear_fp8_channel for the q/k/v/gate [14336 x 5120], o_proj [5120 x 6144] and a dense
MLP's gate/up and down at each token count (the per-token activation quantizer included), and
moe_fp8_channel (top-8 of 256 experts, distinct random experts per token; the op's x and h
quantizers, both GEMMs and the combine) at each token count. Each row: time (median CUDA-graph
replay of calls that cycle through enough weight copies to exceed L2, so weights come from
HBM as in a model's decode), GB/s of weights read, and "x floor" = time / (bytes / copy rate).
Target (issue 25): the MoE op at batch 1 within 1.3x its floor. The output is checked against
the op's reference at each shape. About 1 minute on an H200; --smoke: tiny preset, no timing,
every path once (1-2 minutes in the interpreter on the 2-core CPU box).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import plugins  # noqa: E402,F401  (registers torch.ops.beam.*)
from _common import (  # noqa: E402
    BF16, FP8, add_row, dev, rel_err, report_run, smoke, start_run, time_graph_us,
)
from plugins.linear_fp8_channel import ref_linear_fp8_channel  # noqa: E402
from plugins.moe_fp8_channel import ref_moe_fp8_channel  # noqa: E402

L2_BYTES = 200 << 20  # cycle weight copies past this (H200 L2: 50 MB)


def _channel(n: int, k: int):
    """Random FP8 codes and per-row scales of an [n, k] weight ~ N(0, 1/k)."""
    w = torch.randn(n, k, device=dev()) * k**-0.5
    scale = w.abs().amax(1) / 448
    return (w / scale[:, None]).to(FP8), scale.float()


def _copies(nbytes: int) -> int:
    return 1 if smoke() else max(1, -(-L2_BYTES // nbytes))


def bench_linear(name: str, n: int, k: int, tokens: list[int], ceil: dict) -> None:
    weights = [_channel(n, k) for _ in range(_copies(n * k))]
    nbytes = n * k + 4 * n
    for t in tokens:
        x = torch.randn(t, k, device=dev(), dtype=BF16)

        def calls():
            for w, s in weights:
                torch.ops.beam.linear_fp8_channel(x, w, s)

        got = torch.ops.beam.linear_fp8_channel(x, *weights[0])
        check = f"rel {rel_err(got.cpu(), ref_linear_fp8_channel(x.cpu(), *(a.cpu() for a in weights[0]))):.1e}"
        us = time_graph_us(calls, len(weights))
        # (no eager column: the op's reference runs on the CPU)
        add_row(f"linear_fp8_channel {name}", f"T={t} [{n} x {k}]", us, 0.0, nbytes,
                "GB/s", ceil["copy_GBps"], check, f"x floor {ceil['copy_GBps'] * 1e3 * us / nbytes:.2f}"
                if not smoke() else "")


def _experts(e: int, h: int, inner: int):
    w13, s13 = zip(*(_channel(2 * inner, h) for _ in range(e)))
    w2, s2 = zip(*(_channel(h, inner) for _ in range(e)))
    return torch.stack(w13), torch.stack(s13), torch.stack(w2), torch.stack(s2)


def bench_moe(cfg, tokens: list[int], ceil: dict) -> None:
    e, h, inner, k = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                      cfg.num_experts_per_tok)
    per_expert = 3 * inner * h + 4 * (2 * inner + h)
    sets = [_experts(e, h, inner) for _ in range(_copies(k * per_expert) if not smoke() else 1)]
    for t in tokens:
        x = torch.randn(t, h, device=dev(), dtype=BF16)
        ids = torch.rand(t, e, device=dev()).topk(k, dim=-1).indices.to(torch.int32)
        w = torch.rand(t, k, device=dev()) + 0.05
        w = (w / w.sum(-1, keepdim=True)).float()
        nbytes = int(ids.unique().numel()) * per_expert  # the distinct experts' weights

        def calls():
            for ws in sets:
                torch.ops.beam.moe_fp8_channel(x, ids, w, *ws, scale=cfg.routed_scaling_factor)

        got = torch.ops.beam.moe_fp8_channel(x, ids, w, *sets[0], scale=cfg.routed_scaling_factor)
        want = ref_moe_fp8_channel(*(a.cpu() for a in (x, ids, w, *sets[0])),
                                   scale=cfg.routed_scaling_factor)
        us = time_graph_us(calls, len(sets))
        add_row("moe_fp8_channel", f"T={t} E={e} top-{k} I={inner} H={h}", us, 0.0,
                nbytes, "GB/s", ceil["copy_GBps"], f"rel {rel_err(got.cpu(), want):.1e}",
                f"x floor {ceil['copy_GBps'] * 1e3 * us / nbytes:.2f}" if not smoke() else "")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Measures: " + __doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=None,
                        help="model shapes (default beam-1.0-501b; tiny with --smoke)")
    parser.add_argument("--tokens", default="1,8,64", help="decode token counts (default 1,8,64)")
    parser.add_argument("--out", type=Path, help="write table.md and results.json here")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny preset and sizes, no timing: every path once (CPU works)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    run = start_run(opts, "kernels_fp8_channel.py")
    if run is None:
        return 2
    name, cfg, t0, env, ceil = run
    tokens = [int(t) for t in opts.tokens.split(",") if t]
    h, attn = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    qkvg = 2 * cfg.q_size + 2 * cfg.kv_size
    for label, n, k in (("q/k/v/gate", qkvg, h), ("o_proj", h, attn),
                        ("dense gate/up", 2 * cfg.intermediate_size, h),
                        ("dense down", h, cfg.intermediate_size)):
        bench_linear(label, n, k, tokens, ceil)
    bench_moe(cfg, tokens, ceil)
    report_run(opts, name, env, ceil, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
