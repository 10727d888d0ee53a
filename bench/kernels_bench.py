"""Speed of the beam:: kernels at Beam-1.0 shapes on one GPU, each against a ceiling measured
in the same run (bench/_common.py: device copy bandwidth, cuBLAS BF16 / FP8 / FP32 GEMM rates).

    PYTHONPATH=. python3 bench/kernels_bench.py [--out DIR]
        [--only norms,qk_prep,decode,prefill,router,moe]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/kernels_bench.py --smoke      # CPU, seconds

Rows: rmsnorm / add_rmsnorm and qk_prep (GB/s against copy), attention decode at 128K and
batched (GB/s of K/V against copy) and prefill at 16K (TFLOP/s against BF16), group_router
(batch 1 against copy, 16K tokens against FP32), and from bench/kernels_moe.py the MoE
(batch-1 decode against its weight-read floor, 16K prefill against the FP8 / BF16 rate) and
linear rows. Per row: our time, the eager PyTorch time (the op's `ref_`, or torch's SDPA for
prefill), the achieved rate and its share of the ceiling, and the output checked against the
reference at that shape. Times are medians of triton.testing.do_bench (L2 flushed); decode-path
ops are timed as CUDA-graph replays, as the engine runs them. About 4 minutes on an H200
(--moe-formats fp8,nvfp4 --no-eager: about 2). Tile sweeps: bench/kernels_sweep.py,
bench/decode_sweep.py. Results: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import kernels_moe  # noqa: E402
import plugins  # noqa: E402,F401  (registers torch.ops.beam.*)
from _common import (  # noqa: E402
    BF16, FP8, SIZES, add_row, dev, rel_err, report_run, start_run, time_graph_us, time_us,
)
from plugins.add_rmsnorm import ref_add_rmsnorm  # noqa: E402
from plugins.attention import ref_attention  # noqa: E402
from plugins.group_router import ref_group_router  # noqa: E402
from plugins.qk_prep import ref_qk_prep  # noqa: E402
from plugins.rmsnorm import ref_rmsnorm  # noqa: E402

STEPS = ("norms", "qk_prep", "decode", "prefill", "router", "moe")


# ----------------------------------------------------------------------------- norms
def bench_norms(cfg, ceil):
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    w = 1 + 0.1 * torch.randn(h, device=dev(), dtype=BF16)
    for t in (SIZES["tokens"], 1):
        x = torch.randn(t, h, device=dev(), dtype=BF16)
        y = torch.randn(t, h, device=dev(), dtype=BF16)
        a, b = cfg.residual_coeffs(7)
        ours = lambda: torch.ops.beam.add_rmsnorm(x, y, w, w, a, b, eps)  # noqa: E731
        eager = lambda: ref_add_rmsnorm(x, y, w, w, a, b, eps)  # noqa: E731
        got, want = ours(), eager()
        check = f"h' rel {rel_err(got[0], want[0]):.1e}, x rel {rel_err(got[1], want[1]):.1e}"
        small = t == 1  # launch-bound: time ours as graph replays (eager stays eager)
        add_row("add_rmsnorm", f"[{t}, {h}] bf16", (time_graph_us if small else time_us)(ours),
                time_us(eager), 4 * t * h * 2, "GB/s", ceil["copy_GBps"], check,
                "ours: graph replay" if small else "")
        if not small:
            ours = lambda: torch.ops.beam.rmsnorm(x, w, eps)  # noqa: E731
            eager = lambda: ref_rmsnorm(x, w, eps)  # noqa: E731
            add_row("rmsnorm", f"[{t}, {h}] bf16", time_us(ours), time_us(eager), 2 * t * h * 2,
                    "GB/s", ceil["copy_GBps"], f"rel {rel_err(ours(), eager()):.1e}")


# ----------------------------------------------------------------------------- qk_prep
def bench_qk_prep(cfg, ceil):
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    width = 2 * hq * d + 2 * hkv * d  # q, k, v, gate
    for t, full in ((SIZES["tokens"], True), (SIZES["tokens"], False), (SIZES["few_tokens"], True)):
        qkvg = torch.randn(t, width, device=dev(), dtype=BF16)
        pos = torch.randint(0, 1 << 20, (t,), device=dev())
        w = 1 + 0.1 * torch.randn(d, device=dev(), dtype=BF16)
        k_cache = torch.zeros(t // 64 + 1, 64, hkv, d, device=dev(), dtype=BF16)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(k_cache.shape[0] * 64, device=dev())[:t]
        one = torch.ones((), device=dev())
        gate_bias = 0.5 * torch.randn(hq, device=dev(), dtype=BF16)
        args = (qkvg, pos, w, w, gate_bias, k_cache, v_cache, slots, one, one, full,
                cfg.rms_norm_eps, cfg.rope_theta)
        got = torch.ops.beam.qk_prep(*args)
        want = ref_qk_prep(*args)
        check = f"q rel {rel_err(got[0], want[0]):.1e}, k rel {rel_err(got[1], want[1]):.1e}"
        # read qkvg; write q, k, v, the gate and the cache rows
        work = t * (width * 2 + (2 * hq + 2 * hkv) * d * 2 + 2 * hkv * d * 2)
        small = t <= 64  # launch-bound: ours as graph replays (the ref syncs: not capturable)
        ours = (time_graph_us if small else time_us)(lambda: torch.ops.beam.qk_prep(*args))
        add_row("qk_prep " + ("full" if full else "sliding"), f"T={t}", ours,
                time_us(lambda: ref_qk_prep(*args)), work, "GB/s", ceil["copy_GBps"], check,
                "ours: graph replay" if small else "")


# ----------------------------------------------------------------------------- attention
def paged_decode_case(cfg, batch, context, block_size, kv_dtype, window=0):
    """A decode step of `batch` sequences with `context` cached tokens each, random block
    tables over a shuffled pool (or one ring row each when window > 0)."""
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    bs = window or block_size
    per_seq = 1 if window else math.ceil(context / bs)
    n_blocks = batch * per_seq
    k_cache = torch.randn(n_blocks, bs, hkv, d, device=dev(), dtype=BF16).to(kv_dtype)
    v_cache = torch.randn(n_blocks, bs, hkv, d, device=dev(), dtype=BF16).to(kv_dtype)
    scale = torch.tensor(1.0 if kv_dtype == BF16 else 1 / 64, device=dev())
    index = torch.randperm(n_blocks, device=dev()).view(batch, per_seq).int()
    ar = torch.arange(batch + 1, device=dev(), dtype=torch.int32)
    return dict(q=torch.randn(batch, hq, d, device=dev(), dtype=BF16) * 2,
                k_new=torch.randn(batch, hkv, d, device=dev(), dtype=BF16),
                v_new=torch.randn(batch, hkv, d, device=dev(), dtype=BF16),
                gate=torch.rand(batch, hq, d, device=dev(), dtype=BF16), k_cache=k_cache,
                v_cache=v_cache,
                cu_seqlens_q=ar, q_start=torch.full_like(ar[1:], context),
                hist_start=torch.zeros_like(ar[1:]), cache_index=index, window=window,
                k_scale=scale, v_scale=scale)


def bench_attention_decode(cfg, ceil, block_size):
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    long_ctx, batch, batch_ctx = SIZES["long_ctx"], SIZES["batch"], SIZES["batch_ctx"]
    cases = [(1, long_ctx, BF16, 0), (1, long_ctx, FP8, 0), (batch, batch_ctx, BF16, 0),
             (SIZES["sliding_batch"], batch_ctx, BF16, cfg.sliding_window)]
    for batch, ctx, kv, window in cases:
        case = paged_decode_case(cfg, batch, ctx, block_size, kv, window)
        ours = lambda: torch.ops.beam.attention(**case)  # noqa: E731
        got, want = ours(), ref_attention(**case)
        seen = min(ctx, window - 1) if window else ctx
        work = batch * seen * hkv * d * 2 * case["k_cache"].element_size()
        kind = f"sliding w={window}" if window else f"full bs={block_size}"
        # Graph replays, as the engine runs decode: eager, the CPU cost of two launches
        # exceeds the GPU time at batch 1 and the GPU idles between them.
        add_row(f"attention decode {kind}", f"B={batch} ctx={ctx} kv={str(kv)[6:]}",
                time_graph_us(ours), time_us(lambda: ref_attention(**case)), work, "GB/s",
                ceil["copy_GBps"], f"rel {rel_err(got, want):.1e}", "ours: graph replay")


def bench_attention_prefill(cfg, ceil, block_size):
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    t = SIZES["tokens"]
    for window in (0, cfg.sliding_window):
        bs = window or block_size
        rows = 1 if window else triton.cdiv(t, bs)
        cache = torch.zeros(rows, bs, hkv, d, device=dev(), dtype=BF16)
        q = torch.randn(t, hq, d, device=dev(), dtype=BF16) * 2
        k = torch.randn(t, hkv, d, device=dev(), dtype=BF16)
        v = torch.randn(t, hkv, d, device=dev(), dtype=BF16)
        zero = torch.zeros(1, device=dev(), dtype=torch.int32)
        cu = torch.tensor([0, t], device=dev(), dtype=torch.int32)
        case = dict(q=q, k_new=k, v_new=v, gate=torch.ones(t, hq, d, device=dev(), dtype=BF16),
                    k_cache=cache,
                    v_cache=cache, cu_seqlens_q=cu, q_start=zero, hist_start=zero,
                    cache_index=torch.arange(rows, device=dev(), dtype=torch.int32)[None],
                    window=window, k_scale=torch.ones((), device=dev()),
                    v_scale=torch.ones((), device=dev()))
        ours = lambda: torch.ops.beam.attention(**case)  # noqa: E731
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))
        if window:
            pos = torch.arange(t, device=dev())
            mask = (pos[:, None] >= pos[None]) & (pos[:, None] - pos[None] < window)
            extra = dict(attn_mask=mask)
            pairs = sum(min(i + 1, window) for i in range(t))
        else:
            extra = dict(is_causal=True)
            pairs = t * (t + 1) // 2
        def sdpa():
            return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True, **extra)
        got = ours().view(t, hq, d)
        want = sdpa()[0].transpose(0, 1)  # gate is 1: the same function
        kind = f"sliding w={window}" if window else "full causal"
        add_row(f"attention prefill {kind}", f"T={t} one sequence", time_us(ours), time_us(sdpa),
                4 * hq * d * pairs, "TFLOP/s", ceil["bf16_TFLOPs"],
                f"rel {rel_err(got, want):.1e} vs SDPA", "eager = torch SDPA")


# ----------------------------------------------------------------------------- router
def bench_router(cfg, ceil):
    e, h = cfg.num_experts, cfg.hidden_size
    args = (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    layers = SIZES["router_layers"]  # 16 x 5.2 MB of FP32 weight > 60 MB L2: reads HBM
    weights = [torch.randn(e, h, device=dev()) / h**0.5 * 2 for _ in range(layers)]
    bias = 0.05 * torch.randn(e, device=dev())
    for t in (1, SIZES["tokens"]):
        x = torch.randn(t, h, device=dev(), dtype=BF16)
        ours = lambda: torch.ops.beam.group_router(x, weights[0], bias, *args)  # noqa: E731
        eager = lambda: ref_group_router(x, weights[0], bias, *args)  # noqa: E731
        got, want = ours(), eager()
        same = float((got[0] == want[0]).all(dim=1).float().mean())
        check = f"ids equal for {100 * same:.2f}% of tokens, w rel {rel_err(got[1], want[1]):.1e}"
        if t == 1:  # launch-bound: a graph of one call per layer, each with its own weight
            def every_layer():
                return [torch.ops.beam.group_router(x, w, bias, *args) for w in weights]
            add_row("group_router", f"T=1 ({layers} layers in one graph)",
                    time_graph_us(every_layer, layers), time_us(eager), e * h * 4, "GB/s",
                    ceil["copy_GBps"], check, "ours: graph replay, per call; eager: not captured")
        else:
            add_row("group_router", f"T={t}", time_us(ours), time_us(eager), 2 * t * e * h,
                    "TFLOP/s", ceil["fp32_TFLOPs"], check, "ceiling: cuBLAS FP32 GEMM")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Measures: " + __doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=None,
                        help="model shapes (default beam-1.0-501b; tiny with --smoke)")
    parser.add_argument("--block-size", type=int, default=64, help="KV block size of full layers")
    parser.add_argument("--out", type=Path, help="write table.md and results.json here")
    parser.add_argument("--only", default="", help="comma list of: " + ",".join(STEPS))
    parser.add_argument("--moe-formats", default="",
                        help="MoE formats of the moe rows (default all: fp8,nvfp4,fp8_block,bf16)")
    parser.add_argument("--moe-tokens", default="",
                        help="token counts of the moe rows (<= 64: decode, else prefill; "
                             "default 1,16,16384)")
    parser.add_argument("--no-eager", action="store_true",
                        help="skip timing the MoE / linear references (saves ~1 min)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny preset and sizes, no timing: every path once (CPU works)")
    return parser.parse_args(argv)


def run_steps(opts, cfg, ceil) -> dict:
    only = set(filter(None, opts.only.split(",")))
    steps = [("norms", bench_norms, ()), ("qk_prep", bench_qk_prep, ()),
             ("decode", bench_attention_decode, (opts.block_size,)),
             ("prefill", bench_attention_prefill, (opts.block_size,)), ("router", bench_router, ())]
    for name, fn, extra in steps:
        if not only or name in only:
            fn(cfg, ceil, *extra)
            if dev() == "cuda":
                torch.cuda.empty_cache()
    if only and "moe" not in only:
        return {}
    ctx = SimpleNamespace(cfg=cfg, ceilings=ceil, time_us=time_us, time_graph_us=time_graph_us,
                          add_row=add_row, rel_err=rel_err, eager=not opts.no_eager,
                          formats=[f for f in opts.moe_formats.split(",") if f],
                          tokens=[int(t) for t in opts.moe_tokens.split(",") if t])
    return kernels_moe.run(ctx)


def main(argv=None) -> int:
    opts = parse_args(argv)
    run = start_run(opts, "kernels_bench.py")
    if run is None:
        return 2
    name, cfg, t0, env, ceil = run
    moe = run_steps(opts, cfg, ceil)
    report_run(opts, name, env, ceil, t0, **moe)
    return 1 if moe.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
