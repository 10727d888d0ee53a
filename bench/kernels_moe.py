"""MoE and linear rows of the kernel benchmark at Beam-1.0 shapes (H=5120, I=2560, E=256, top-8).

    PYTHONPATH=. python3 bench/kernels_moe.py [--out DIR] [--formats fp8,nvfp4] [--tokens 1,16,16384]
        [--sweep fp8:1,nvfp4:1,fp8:16384] [--no-eager] [--no-linear]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/kernels_moe.py --smoke   # CPU, seconds

bench/kernels_bench.py adds these rows to its table through `run(ctx)`; run alone, this script
measures the same ceilings (bench/_common.py) and prints the same table. About 2 minutes on an
H200 for fp8 and nvfp4 without --no-eager; each --sweep case adds 1-2 minutes.

Weights: every expert drawn at N(0, 1/fan_in) and quantized with the converter's encoders
(beam_trtllm.quant_formats), repacked as docs/DESIGN.md §2. Routing: the reference group router
on random router weights and inputs (realistic spread over 256 experts in 8 groups).
- decode (T tokens <= 64): timed as CUDA-graph replays (how the engine runs decode). Work =
  bytes of the distinct selected experts' weights and scales; the floor is those bytes over
  the measured copy bandwidth. Target: FP8 <= 1.3x floor, NVFP4 <= 1.5x floor at T=1.
- prefill (T > 64, 16384 by default; mid-size chunks with --tokens 2048,4096): eager launches.
  Work = 2*T*k*3*H*I FLOPs against the FP8 GEMM rate (FP8 formats) or the BF16 one. Target:
  FP8 >= 60% of the FP8 GEMM rate, FP8-block and NVFP4 >= 55% of theirs. On CUDA each
  prefill row has a "sustained" twin: the op and the GEMM ceilings each timed over ~0.4 s
  back to back, where the H200's power cap holds the clocks (the burst rows' do_bench runs
  ~0.1 s, mostly at peak clocks; bench/_engine_ceilings.py).
- --sweep FMT:T: launch shapes of both grouped GEMMs (gate/up, then down at gate/up's best).
Each row also checks the output against the op's ref_ at that shape (relative error and the
TOLERANCES entry of tests/conftest.py), and the graph rows check that a captured graph replays
correctly on new routing (no host syncs, no data-dependent shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "plugins"), str(ROOT / "bench")]

import _common  # noqa: E402

import plugins  # noqa: E402,F401
from _linear_testdata import linear_args  # noqa: E402
from _moe_testdata import moe_args, pack_experts  # noqa: E402
from beam_trtllm.config import preset  # noqa: E402
from plugins._reference import route  # noqa: E402
from conftest import TOLERANCES  # noqa: E402
from plugins import linear_fp8, linear_fp8_block, linear_nvfp4  # noqa: E402
from plugins import moe_bf16, moe_fp8, moe_fp8_block, moe_nvfp4  # noqa: E402
from plugins._moe_common import GemmConfig  # noqa: E402

BF16 = torch.bfloat16
MOE = {"fp8": moe_fp8, "nvfp4": moe_nvfp4, "fp8_block": moe_fp8_block, "bf16": moe_bf16}
LINEAR = {"fp8": linear_fp8, "fp8_block": linear_fp8_block, "nvfp4": linear_nvfp4}
TARGET_X_FLOOR = {"fp8": 1.3, "nvfp4": 1.5}
H_AMAX = 8.0  # static down_proj input scale = H_AMAX / 448 (covers silu(g)*u of unit inputs)


def experts(fmt: str, cfg, seed: int) -> dict:
    """All E experts of one MoE layer in `fmt`, quantized one expert at a time on the GPU."""
    e, h, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gen = torch.Generator(device=_common.dev()).manual_seed(seed)
    parts = defaultdict(list)
    for _ in range(e):
        gate = (torch.randn(1, inner, h, generator=gen, device=_common.dev()) * h**-0.5).to(BF16)
        up = (torch.randn(1, inner, h, generator=gen, device=_common.dev()) * h**-0.5).to(BF16)
        down = (torch.randn(1, h, inner, generator=gen, device=_common.dev()) * inner**-0.5).to(BF16)
        for name, tensor in pack_experts(fmt, gate, up, down).items():
            parts[name].append(tensor[0])
    return {name: torch.stack(ts).contiguous() for name, ts in parts.items()}


def expert_bytes(packed: dict, ids: torch.Tensor) -> int:
    """Bytes of the distinct selected experts' weights and scales (what a step must read)."""
    per_expert = sum(t[0].numel() * t.element_size() for t in packed.values() if t.dim() >= 1)
    return per_expert * int(ids.unique().numel())


def routing(cfg, t: int, seed: int):
    gen = torch.Generator(device=_common.dev()).manual_seed(seed)
    h, e = cfg.hidden_size, cfg.num_experts
    x = torch.randn(t, h, generator=gen, device=_common.dev()).to(BF16)
    weight = torch.randn(e, h, generator=gen, device=_common.dev()) * h**-0.5
    bias = torch.randn(e, generator=gen, device=_common.dev()) * 0.1
    ids, w = route(x, weight, bias, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok)
    return x, ids.to(torch.int32), w


def check(ctx, fmt, got, want, what="moe") -> str:
    """Relative error and whether the TOLERANCES entry of the CPU tests holds at this shape."""
    key = "moe-fp8" if (what == "moe" and fmt.startswith("fp8")) else what
    atol, rtol = TOLERANCES[(key, torch.bfloat16)]
    ok = torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol)
    return f"rel {ctx.rel_err(got, want):.1e} {'ok' if ok else 'OVER TOL'}"


def graph_replays_new_routing(cfg, fmt, packed, scales, t) -> str:
    """Capture the op once, then replay it on new x / routing copied into the same tensors."""
    op = getattr(torch.ops.beam, f"moe_{fmt}")
    x, ids, w = routing(cfg, t, seed=100)
    static = [x.clone(), ids.clone(), w.clone()]
    rest = moe_args(fmt, x, ids, w, packed, scales)[3:]
    op(*static, *rest)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*static, *rest)
    x2, ids2, w2 = routing(cfg, t, seed=101)
    for dst, src in zip(static, (x2, ids2, w2)):
        dst.copy_(src)
    graph.replay()
    return "graph ok" if torch.equal(out, op(x2, ids2, w2, *rest)) else "GRAPH MISMATCH"


def sustained_us(fn, burst_us: float) -> float:
    """Median µs of fn over the second half of ~0.4 s of back-to-back calls: the H200 holds
    its GEMM clocks for ~0.1 s of full load, then its power cap lowers them (~30%), so a
    prefill kernel timed in do_bench's 100 ms runs mostly at the burst clocks, while a
    prefill of Beam's 62 layers runs capped (docs/BENCHMARKS.md, engine bench 2026-12-03)."""
    from _engine_ceilings import sustained_ms

    return 1e3 * sustained_ms(fn, max(8, int(4e5 / burst_us)))


def bench_moe_format(ctx, fmt: str, tokens=(1, 16, 16384)) -> list[dict]:
    cfg, ceil = ctx.cfg, ctx.ceilings
    packed = experts(fmt, cfg, seed=1)
    mod = MOE[fmt]
    op, ref = getattr(torch.ops.beam, f"moe_{fmt}"), getattr(mod, f"ref_moe_{fmt}")
    results = []
    for t in tokens:
        x, ids, w = routing(cfg, t, seed=t)
        scales = {"a13_scale": (x.abs().amax().float() / 448).reshape(()),
                  "a2_scale": torch.tensor(H_AMAX / 448, device=_common.dev())}
        args = moe_args(fmt, x, ids, w, packed, scales)
        status = check(ctx, fmt, op(*args), ref(*args))
        eager = ctx.time_us(lambda: ref(*args)) if ctx.eager else 0.0
        shape = f"T={t} H={cfg.hidden_size} I={cfg.moe_intermediate_size} E={cfg.num_experts} k={cfg.num_experts_per_tok}"
        if t <= 64:
            ours = ctx.time_graph_us(lambda: op(*args))
            launches = ctx.time_us(lambda: op(*args))
            work = expert_bytes(packed, ids)
            floor = work / ceil["copy_GBps"] / 1e3
            if _common.dev() == "cuda":
                status += ", " + graph_replays_new_routing(cfg, fmt, packed, scales, t)
            note = f"graph replay; {ours / floor:.2f}x floor {floor:.1f} us; eager launches {launches:.1f} us"
            if t == 1 and fmt in TARGET_X_FLOOR:
                note += f"; target <= {TARGET_X_FLOOR[fmt]}x"
            ctx.add_row(f"moe_{fmt} decode", shape, ours, eager, work, "GB/s", ceil["copy_GBps"],
                        status, note)
            results.append(dict(fmt=fmt, t=t, us=ours, floor_us=floor, x_floor=ours / floor))
        else:
            ours = ctx.time_us(lambda: op(*args))
            flops = 2 * t * ids.shape[1] * 3 * cfg.hidden_size * cfg.moe_intermediate_size
            key = "fp8_TFLOPs" if fmt.startswith("fp8") else "bf16_TFLOPs"
            target = {"fp8": 60, "fp8_block": 55, "nvfp4": 55}.get(fmt)
            note = f"vs {key[:-7].upper()} GEMM rate" + (f"; target >= {target}%" if target else "")
            ctx.add_row(f"moe_{fmt} prefill", shape, ours, eager, flops, "TFLOP/s", ceil[key],
                        status, note)
            if fmt == "fp8_block":  # the per-thread-load kernel the TMA path replaced
                slow = lambda: moe_fp8_block.moe_fp8_block_triton(*args, tma=False)  # noqa: E731
                ctx.add_row("moe_fp8_block prefill, per-thread loads", shape, ctx.time_us(slow),
                            0.0, flops, "TFLOP/s", ceil[key], check(ctx, fmt, slow(), op(*args)),
                            "the launch before the TMA path")
            row = dict(fmt=fmt, t=t, us=ours, pct=100 * flops / ours / 1e6 / ceil[key])
            if f"{key[:-7]}_sustained_TFLOPs" in ceil:  # both under the power cap (see below)
                us = sustained_us(lambda: op(*args), ours)
                ctx.add_row(f"moe_{fmt} prefill, sustained", shape, us, 0.0, flops, "TFLOP/s",
                            ceil[f"{key[:-7]}_sustained_TFLOPs"], status,
                            "op and GEMM ceiling each ~0.4 s back to back")
                row |= dict(sustained_us=us,
                            sustained_pct=100 * flops / us / 1e6 / ceil[f"{key[:-7]}_sustained_TFLOPs"])
            results.append(row)
        if t in (1, 16384) and _common.dev() == "cuda":
            print(f"  breakdown moe_{fmt} T={t} (us per call): "
                  f"{kernel_breakdown(fmt, args, reps=20 if t == 1 else 5)}", flush=True)
    del packed
    if _common.dev() == "cuda":
        torch.cuda.empty_cache()
    return results


def kernel_breakdown(fmt: str, args, reps: int = 20) -> str:
    """Per-kernel device time of one op call (torch.profiler), for the write-up."""
    op = getattr(torch.ops.beam, f"moe_{fmt}")
    op(*args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            op(*args)
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:  # kernels, not the ops above them
            totals[evt.key[:48]] += evt.device_time_total / reps
    return ", ".join(f"{name} {us:.1f}" for name, us in sorted(totals.items(), key=lambda kv: -kv[1]))


def bench_linear(ctx, tokens=(1, 16384)) -> None:
    cfg, ceil = ctx.cfg, ctx.ceilings
    n = cfg.qkv_gate_size  # packed q, k, v and the output gate
    # linear_fp8 picks the Triton GEMM up to SMALL_M tokens and _scaled_mm above: both forced
    variants = [("fp8", {"use_scaled_mm": True}), ("fp8", {"use_scaled_mm": False}),
                ("fp8_block", {}), ("fp8_block", {"tma": False}), ("nvfp4", {})]
    for t in tokens:
        x = torch.randn(t, cfg.hidden_size, device=_common.dev()).to(BF16)
        for fmt, extra in variants:
            mod = LINEAR[fmt]
            args = linear_args(fmt, x.cpu(), n, seed=0)
            args = tuple(a.to(_common.dev()) for a in args)
            fast = getattr(mod, f"linear_{fmt}_triton")
            ref = getattr(mod, f"ref_linear_{fmt}")
            what = "linear-fp8-mma" if fmt.startswith("fp8") and _common.dev() == "cuda" else "linear"
            # the reference on the CPU, as in the kernel tests (torch's own float -> FP8
            # quantization on the GPU was seen one code off: BENCHMARKS "FP8 GEMM precision")
            want = ref(*(a.cpu() for a in args))
            status = check(ctx, fmt, fast(*args, **extra).cpu(), want, what=what)
            name = f"linear_{fmt}" + {True: " (_scaled_mm)", False: " (triton)", None: ""}[
                extra.get("use_scaled_mm")] + (" (per-thread loads)" if "tma" in extra else "")
            ours = (ctx.time_graph_us if t == 1 else ctx.time_us)(lambda: fast(*args, **extra))
            eager = ctx.time_us(lambda: ref(*args)) if ctx.eager else 0.0  # not capturable
            if t == 1:
                work = sum(a.numel() * a.element_size() for a in args[1:])
                ctx.add_row(name, f"T=1 [{cfg.hidden_size} -> {n}]", ours, eager, work, "GB/s",
                            ceil["copy_GBps"], status, "graph replay")
            else:
                key = "fp8_TFLOPs" if fmt.startswith("fp8") else "bf16_TFLOPs"
                ctx.add_row(name, f"T={t} [{cfg.hidden_size} -> {n}]", ours, eager,
                            2 * t * n * cfg.hidden_size, "TFLOP/s", ceil[key], status, f"vs {key[:-7]}")


def sweep(ctx, fmt: str, t: int) -> list[tuple]:
    """Time the op over launch shapes of the gate/up GEMM (down fixed), then of the down GEMM
    (gate/up at its best); both share block_m (one token sort)."""
    cfg = ctx.cfg
    packed = experts(fmt, cfg, seed=1)
    x, ids, w = routing(cfg, t, seed=t)
    scales = {"a13_scale": (x.abs().amax().float() / 448).reshape(()),
              "a2_scale": torch.tensor(H_AMAX / 448, device=_common.dev())}
    args = moe_args(fmt, x, ids, w, packed, scales)
    launch = getattr(MOE[fmt], f"moe_{fmt}_triton")
    decode = t <= 64
    timer = ctx.time_graph_us if decode else ctx.time_us
    if decode:  # weights on the MMA's M side (swap): 64+ rows on a warpgroup, 16/32 on mma.sync
        shapes = ((64, 128, 4, 4), (64, 128, 8, 4), (128, 128, 8, 4), (64, 256, 4, 4),
                  (64, 64, 4, 4), (32, 128, 2, 3), (32, 128, 2, 4), (32, 256, 2, 3),
                  (16, 128, 1, 3), (16, 256, 1, 4))  # 16/32 rows: mma.sync on 1-2 warps
        grid13 = [GemmConfig(16, bn, bk, nw, st, swap=True) for bn, bk, nw, st in shapes]
        down = [(bn, bk, nw, st, 8, True) for bn, bk, nw, st in shapes]
        default2 = (64, 128, 4, 4, 8, True)
    elif fmt == "fp8_block" and cfg.moe_intermediate_size % 128 == 0:  # the TMA prefill
        grid13 = [GemmConfig(*c) for c in (
            (128, 128, 128, 8, 3, 8, False, 64), (128, 128, 128, 8, 4, 8, False, 64),
            (128, 128, 128, 8, 3, 8, False, 32), (128, 128, 128, 8, 3, 4, False, 64),
            (128, 128, 128, 8, 3, 16, False, 64), (128, 128, 128, 8, 2, 8, False, 64),
            (128, 128, 128, 4, 3, 8, False, 64), (128, 128, 128, 8, 3, 8, True, 64),
            # 64 rows on 8 warps: 188 registers and no spills in the sm_90 build
            (64, 128, 128, 8, 3, 8, False, 32), (64, 128, 128, 8, 4, 8, False, 32))]
        down = [(128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 4, 4), (64, 128, 4, 4),
                (128, 128, 4, 3, 8, True), (128, 128, 8, 4)]
        default2 = (128, 128, 4, 3)
    else:
        grid13 = [GemmConfig(*c) for c in (
            (128, 64, 128, 8, 3), (128, 64, 128, 8, 4), (128, 128, 64, 8, 3),
            (128, 128, 128, 8, 3, 8, True), (128, 128, 128, 8, 4, 8, True),
            (128, 128, 64, 8, 4, 8, True), (128, 64, 256, 8, 3, 8, True),
            (128, 64, 128, 4, 4, 8, True), (128, 128, 128, 8, 3, 1, True))]
        down = [(128, 128, 8, 3), (128, 64, 8, 4), (256, 64, 8, 3), (256, 128, 8, 3),
                (128, 128, 8, 4), (128, 256, 8, 3), (128, 128, 4, 3)]
        default2 = (128, 128, 8, 3)
    if _common.smoke():  # two shapes a GEMM: the code path, in the interpreter's time
        grid13, down = grid13[:2], down[:2]
    found, best13 = [], None
    for stage in ("gate/up", "down"):
        pairs = ([(c, GemmConfig(c.block_m, *default2)) for c in grid13] if stage == "gate/up"
                 else [(best13, GemmConfig(best13.block_m, *d)) for d in down])
        pairs = [(a, dataclasses.replace(b, tail_m=a.tail_m)) for a, b in pairs]  # one sort
        results = []
        for c13, c2 in pairs:
            try:
                us = timer(lambda: launch(*args, config13=c13, config2=c2))
            except Exception as exc:  # out of shared memory / registers: report, go on
                print(f"  sweep {fmt} T={t} {stage} {c13} {c2}: {type(exc).__name__}", flush=True)
                continue
            results.append((us, c13, c2))
        results.sort(key=lambda r: r[0])
        best13 = results[0][1]
        for us, c13, c2 in results[:4]:
            print(f"  sweep {fmt} T={t} {stage}: {us:8.1f} us  gate/up {c13}  down {c2}", flush=True)
        found += [(stage,) + r for r in results]
    if _common.dev() == "cuda":
        print(f"  breakdown {fmt} T={t} (us per call): {kernel_breakdown(fmt, args)}", flush=True)
    return found


def run(ctx, sweep_cases=()) -> dict:
    """Entry point for bench/kernels_bench.py (ctx: cfg, ceilings, time_us, time_graph_us, add_row,
    rel_err; optional eager, formats, tokens, linear)."""
    out = {"moe": [], "sweep": [], "failed": []}
    tokens = tuple(getattr(ctx, "tokens", None)
                   or ((1, _common.SIZES["moe_prefill"]) if _common.smoke() else (1, 16, 16384)))
    formats = getattr(ctx, "formats", None) or list(MOE)
    ctx.eager = getattr(ctx, "eager", True)
    steps = [(f"moe_{fmt}", bench_moe_format, (fmt, tokens)) for fmt in formats]
    if getattr(ctx, "linear", True):
        steps.append(("linear", bench_linear, ((1, _common.SIZES["tokens"]),)))
    for case in sweep_cases:
        fmt, t = case.split(":")
        steps.append((f"sweep {fmt} T={t}", sweep, (fmt, int(t))))
    for name, fn, args in steps:
        try:
            result = fn(ctx, *args)
        except Exception:  # one broken step must not hide the others' numbers: report it
            traceback.print_exc()
            print(f"FAILED: {name}", flush=True)
            out["failed"].append(name)
            continue
        if name.startswith("moe_"):
            out["moe"] += result
        elif name.startswith("sweep") and result:
            out["sweep"] += [(name, s, us, str(a), str(b)) for s, us, a, b in result]
        if _common.dev() == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    import json
    import time
    from types import SimpleNamespace

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=None,
                        help="model shapes (default beam-1.0-501b; tiny with --smoke)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sweep", default="", help="launch-shape sweeps, e.g. fp8:1,nvfp4:1,fp8:16384")
    parser.add_argument("--formats", default="", help="comma list of moe formats (default all)")
    parser.add_argument("--tokens", default="", help="token counts (default 1,16,16384)")
    parser.add_argument("--no-eager", action="store_true", help="skip timing the references")
    parser.add_argument("--no-linear", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny preset and sizes, no timing: every path once (CPU works)")
    opts = parser.parse_args(argv)
    _common.configure(opts.smoke)
    if not opts.smoke and not torch.cuda.is_available():
        print("bench/kernels_moe.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    name = opts.preset or ("tiny" if opts.smoke else "beam-1.0-501b")
    t0, env = time.time(), _common.environment()
    print(f"{env['machine']} | torch {torch.__version__} | preset {name} | commit {env['commit']}",
          flush=True)
    ceil = _common.measure_ceilings()
    if torch.cuda.is_available() and not opts.smoke:  # the sustained GEMM rates too
        from _engine_ceilings import measure_ceilings

        sustained = measure_ceilings(torch.device("cuda"))
        ceil |= {f"{u}_sustained_TFLOPs": sustained[f"{u}_TFLOPs"] for u in ("bf16", "fp8")}
    print(f"ceilings: {json.dumps({k: round(v, 1) for k, v in ceil.items()})}", flush=True)
    ctx = SimpleNamespace(cfg=preset(name), ceilings=ceil, time_us=_common.time_us,
                          time_graph_us=_common.time_graph_us, add_row=_common.add_row,
                          rel_err=_common.rel_err, eager=not opts.no_eager,
                          linear=not opts.no_linear,
                          formats=[f for f in opts.formats.split(",") if f],
                          tokens=[int(t) for t in opts.tokens.split(",") if t])
    out = run(ctx, sweep_cases=[c for c in opts.sweep.split(",") if c])
    print(_common.table(ceil))
    print(f"total {time.time() - t0:.0f} s")
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "moe_results.json").write_text(json.dumps(
            dict(env=env, preset=name, ceilings=ceil, rows=_common.ROWS, **out), indent=1,
            default=str))
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
