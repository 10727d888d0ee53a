"""Speed of the beam:: kernels at Beam-1.0 shapes on one GPU, against ceilings measured in the
same run: device-to-device copy bandwidth (bytes read + written) and the BF16 / FP8 / FP32
GEMM rates of cuBLAS on random 8192^3 products.

    PYTHONPATH=. python3 bench/kernels.py [--preset beam-1.0-501b] [--out DIR] [--only ...] [--smoke]

Per op it prints our time, the eager PyTorch time (the op's `ref_` on the GPU, or torch's
SDPA where the reference would materialise the full score matrix), the bytes or FLOPs the op
must move or do, the achieved rate, and that rate as a share of its ceiling, and it checks the
output against the reference at that shape. Times are medians of triton.testing.do_bench (L2
flushed between runs); decode-path ops (decode attention, batch-1 router / norm / qk_prep) are
timed as replays of a captured CUDA graph, as the engine runs them (the router over enough
distinct weight sets that they do not stay in L2). Tile sweeps: bench/kernels_sweep.py.
If bench/kernels_moe.py exists, its `run(ctx)` adds the MoE / linear rows to the same table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import plugins  # noqa: E402,F401  (registers torch.ops.beam.*)
from beam_trtllm.config import preset  # noqa: E402
from plugins.add_rmsnorm import ref_add_rmsnorm  # noqa: E402
from plugins.attention import ref_attention  # noqa: E402
from plugins.group_router import ref_group_router  # noqa: E402
from plugins.qk_prep import ref_qk_prep  # noqa: E402
from plugins.rmsnorm import ref_rmsnorm  # noqa: E402

DEV = "cuda"
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
ROWS: list[dict] = []
# Problem sizes: Beam-1.0 prefill chunk, long-context decode, batched decode. --smoke shrinks
# them (and skips timing) to run every code path in seconds, on the CPU too.
SIZES = dict(tokens=16384, long_ctx=131072, batch=32, batch_ctx=8192, sliding_batch=64,
             router_layers=16, copy_elems=1 << 30, gemm=8192)
SMOKE_SIZES = dict(tokens=300, long_ctx=700, batch=3, batch_ctx=200, sliding_batch=5,
                   router_layers=2, copy_elems=1 << 16, gemm=256)
SMOKE = False


# ----------------------------------------------------------------------------- timing
def time_us(fn) -> float:
    if SMOKE:
        fn()
        return 1.0
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def time_graph_us(fn, calls: int = 1) -> float:
    """Median replay time of a CUDA graph of `fn` divided by the `calls` op calls inside it."""
    if SMOKE:
        return time_us(fn) / calls
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3 / calls


def measure_ceilings() -> dict:
    n = SIZES["copy_elems"]  # 2 GiB of BF16 each way
    src, dst = torch.randn(n, device=DEV, dtype=BF16), torch.empty(n, device=DEV, dtype=BF16)
    copy_gbs = 2 * n * 2 / time_us(lambda: dst.copy_(src)) / 1e3
    del src, dst
    m = SIZES["gemm"]
    a, b = torch.randn(m, m, device=DEV, dtype=BF16), torch.randn(m, m, device=DEV, dtype=BF16)
    bf16 = 2 * m**3 / time_us(lambda: a @ b) / 1e6
    a8, b8 = a.to(FP8), b.to(FP8).t().contiguous().t()  # column-major B, as _scaled_mm wants
    one = torch.ones((), device=DEV)
    fp8 = float("nan")
    if DEV == "cuda":
        fp8 = 2 * m**3 / time_us(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=BF16)) / 1e6
    af, bf = a.float(), b.float()
    torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = 2 * m**3 / time_us(lambda: af @ bf) / 1e6
    return {"copy_GBps": copy_gbs, "bf16_TFLOPs": bf16, "fp8_TFLOPs": fp8, "fp32_TFLOPs": fp32}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def add_row(op, shape, ours_us, eager_us, work, unit, ceiling, check, note=""):
    """work: bytes (unit 'GB/s') or FLOPs (unit 'TFLOP/s') the op must move / do."""
    rate = work / ours_us / (1e3 if unit == "GB/s" else 1e6)
    ROWS.append(dict(op=op, shape=shape, ours_us=ours_us, eager_us=eager_us, rate=rate,
                     unit=unit, ceiling=ceiling, pct=100 * rate / ceiling, check=check,
                     note=note))
    print(f"  {op:<28} {shape:<34} {ours_us:9.1f} us  {rate:8.1f} {unit}  "
          f"({100 * rate / ceiling:5.1f}%)  {check}", flush=True)


# ----------------------------------------------------------------------------- norms
def bench_norms(cfg, ceil):
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    w = 1 + 0.1 * torch.randn(h, device=DEV, dtype=BF16)
    for t in (SIZES["tokens"], 1):
        x = torch.randn(t, h, device=DEV, dtype=BF16)
        y = torch.randn(t, h, device=DEV, dtype=BF16)
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
    for t, full in ((SIZES["tokens"], True), (SIZES["tokens"], False), (64, True)):
        qkvg = torch.randn(t, width, device=DEV, dtype=BF16)
        pos = torch.randint(0, 1 << 20, (t,), device=DEV)
        w = 1 + 0.1 * torch.randn(d, device=DEV, dtype=BF16)
        k_cache = torch.zeros(t // 64 + 1, 64, hkv, d, device=DEV, dtype=BF16)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(k_cache.shape[0] * 64, device=DEV)[:t]
        one = torch.ones((), device=DEV)
        gate_bias = 0.5 * torch.randn(hq, device=DEV, dtype=BF16)
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
    k_cache = torch.randn(n_blocks, bs, hkv, d, device=DEV, dtype=BF16).to(kv_dtype)
    v_cache = torch.randn(n_blocks, bs, hkv, d, device=DEV, dtype=BF16).to(kv_dtype)
    scale = torch.tensor(1.0 if kv_dtype == BF16 else 1 / 64, device=DEV)
    index = torch.randperm(n_blocks, device=DEV).view(batch, per_seq).int()
    ar = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    return dict(q=torch.randn(batch, hq, d, device=DEV, dtype=BF16) * 2,
                k_new=torch.randn(batch, hkv, d, device=DEV, dtype=BF16),
                v_new=torch.randn(batch, hkv, d, device=DEV, dtype=BF16),
                gate=torch.rand(batch, hq, d, device=DEV, dtype=BF16), k_cache=k_cache,
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
        cache = torch.zeros(rows, bs, hkv, d, device=DEV, dtype=BF16)
        q = torch.randn(t, hq, d, device=DEV, dtype=BF16) * 2
        k = torch.randn(t, hkv, d, device=DEV, dtype=BF16)
        v = torch.randn(t, hkv, d, device=DEV, dtype=BF16)
        zero = torch.zeros(1, device=DEV, dtype=torch.int32)
        cu = torch.tensor([0, t], device=DEV, dtype=torch.int32)
        case = dict(q=q, k_new=k, v_new=v, gate=torch.ones(t, hq, d, device=DEV, dtype=BF16),
                    k_cache=cache,
                    v_cache=cache, cu_seqlens_q=cu, q_start=zero, hist_start=zero,
                    cache_index=torch.arange(rows, device=DEV, dtype=torch.int32)[None],
                    window=window, k_scale=torch.ones((), device=DEV),
                    v_scale=torch.ones((), device=DEV))
        ours = lambda: torch.ops.beam.attention(**case)  # noqa: E731
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))
        if window:
            pos = torch.arange(t, device=DEV)
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
    weights = [torch.randn(e, h, device=DEV) / h**0.5 * 2 for _ in range(layers)]
    bias = 0.05 * torch.randn(e, device=DEV)
    for t in (1, SIZES["tokens"]):
        x = torch.randn(t, h, device=DEV, dtype=BF16)
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


def table(ceil) -> str:
    lines = ["| op | shape | ours (µs) | eager (µs) | speed-up | achieved | ceiling | "
             "% of ceiling | check vs ref | note |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in ROWS:
        eager = f"{r['eager_us']:.1f}" if r["eager_us"] else "—"
        speed = f"{r['eager_us'] / r['ours_us']:.1f}×" if r["eager_us"] else "—"
        lines.append(f"| {r['op']} | {r['shape']} | {r['ours_us']:.1f} | {eager} | {speed} | "
                     f"{r['rate']:.1f} {r['unit']} | {r['ceiling']:.1f} {r['unit']} | "
                     f"{r['pct']:.1f}% | {r['check']} | {r['note']} |")
    lines.append(f"\nCeilings measured in this run: copy {ceil['copy_GBps']:.0f} GB/s (read + "
                 f"write), BF16 GEMM {ceil['bf16_TFLOPs']:.0f} TFLOP/s, FP8 GEMM "
                 f"{ceil['fp8_TFLOPs']:.0f} TFLOP/s, FP32 GEMM {ceil['fp32_TFLOPs']:.1f} TFLOP/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="beam-1.0-501b")
    parser.add_argument("--block-size", type=int, default=64, help="KV block size of full layers")
    parser.add_argument("--out", type=Path, help="write table.md and results.json here")
    parser.add_argument("--only", default="",
                        help="comma list of: norms,qk_prep,decode,prefill,router,moe")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, no timing: run every path once (CPU works too)")
    opts = parser.parse_args(argv)
    global DEV, SMOKE
    if opts.smoke:
        SMOKE = True
        SIZES.update(SMOKE_SIZES)
        DEV = "cuda" if torch.cuda.is_available() else "cpu"
    elif not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    cfg, t0 = preset(opts.preset), time.time()
    name = torch.cuda.get_device_name() if DEV == "cuda" else "CPU (smoke)"
    print(f"{name} | torch {torch.__version__} | triton {triton.__version__}"
          f" | preset {opts.preset}", flush=True)
    ceil = measure_ceilings()
    print(f"ceilings: {json.dumps({k: round(v, 1) for k, v in ceil.items()})}", flush=True)
    only = set(filter(None, opts.only.split(",")))
    steps = [("norms", bench_norms, ()), ("qk_prep", bench_qk_prep, ()),
             ("decode", bench_attention_decode, (opts.block_size,)),
             ("prefill", bench_attention_prefill, (opts.block_size,)), ("router", bench_router, ())]
    for name, fn, extra in steps:
        if not only or name in only:
            fn(cfg, ceil, *extra)
            torch.cuda.empty_cache()
    moe = Path(__file__).with_name("kernels_moe.py")
    if moe.exists() and (not only or "moe" in only):
        sys.path.insert(0, str(moe.parent))
        import kernels_moe

        ctx = SimpleNamespace(cfg=cfg, ceilings=ceil, device=DEV, smoke=SMOKE, time_us=time_us,
                              time_graph_us=time_graph_us, add_row=add_row, rel_err=rel_err)
        kernels_moe.run(ctx)
    text = table(ceil)
    print("\n" + text)
    print(f"total {time.time() - t0:.0f} s")
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "table.md").write_text(text + "\n")
        (opts.out / "results.json").write_text(json.dumps(
            dict(ceilings=ceil, rows=ROWS, device=name),
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
