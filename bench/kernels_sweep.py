"""Tile / launch-shape sweeps behind the defaults of the attention-side kernels (H200).

    PYTHONPATH=. python3 bench/kernels_sweep.py [--out DIR] [--only rows,decode,fp8,prefill,router]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/kernels_sweep.py --smoke   # CPU, two configs a grid

Each sweep times one op at a Beam-1.0 shape over a grid of configurations and prints the six
best with their rate as a share of the ceiling measured in the same run (copy bandwidth for
the norms, decode attention and the batch-1 router; cuBLAS BF16 for prefill attention, FP32
for the 16K-token router). The chosen defaults live next to the kernels (ROW_CONFIG,
DECODE_CONFIG, PREFILL_CONFIG, ROUTER_CONFIG): rerun this when a kernel or the GPU changes.
Decode is timed as CUDA-graph replays (as the engine runs it); the rest with do_bench. About
5 minutes on an H200 for every sweep; --table then reruns bench/kernels_bench.py with the best rows.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as bc  # noqa: E402  (timers, ceilings, the --smoke switch)
import kernels_bench as kb  # noqa: E402  (bench/kernels_bench.py: the decode cases and the table)
from beam_trtllm.config import preset  # noqa: E402
from plugins import _attention_decode, _attention_prefill, group_router, rmsnorm  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
OutOfResources = triton.runtime.errors.OutOfResources
GRID = {"limit": None}  # --smoke: the first two configurations of each grid


@contextlib.contextmanager
def patched(table: dict, **changes):
    old = dict(table)
    table.update(changes)
    try:
        yield
    finally:
        table.clear()
        table.update(old)


def run_grid(name, grid, timed, work, unit, ceiling, skip=(OutOfResources,)):
    """Time each configuration, skipping (with the reason) one that raises `skip` (a tile that
    does not fit in shared memory, by default), and print the six fastest."""
    results = []
    for conf in grid[:GRID["limit"]]:
        try:
            us = timed(conf)
        except skip as exc:
            print(f"  {name} {conf}: skipped: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            continue
        results.append(dict(us=us, **conf))
    results.sort(key=lambda r: r["us"])
    for r in results[:6]:
        rate = work / r["us"] / (1e3 if unit == "GB/s" else 1e6)
        print(f"  {name} {r}: {rate:.0f} {unit} ({100 * rate / ceiling:.1f}%)", flush=True)
    return {name: results}


def sweep_rows(cfg, ceil):
    t, h, eps = bc.SIZES["tokens"], cfg.hidden_size, cfg.rms_norm_eps
    x, y = torch.randn(t, h, device=bc.dev(), dtype=BF16), torch.randn(t, h, device=bc.dev(), dtype=BF16)
    w = torch.ones(h, device=bc.dev(), dtype=BF16)
    # One row per tile (more rows spilled or ran slower on the H200: 2026-11-29 sweep), a
    # persistent grid of programs_per_sm x SMs, and loads STAGES tiles ahead (cp.async).
    grid = [dict(ROWS=1, elems_per_thread=e, programs_per_sm=p, STAGES=s)
            for e in (16, 32) for p in (2, 4) for s in (1, 2, 3)]

    def timed(fn):
        def run(conf):
            with patched(rmsnorm.ROW_CONFIG["many"], **conf):
                return bc.time_us(fn)
        return run
    out = run_grid("add_rmsnorm", grid, timed(lambda: torch.ops.beam.add_rmsnorm(
        x, y, w, w, 0.9, 0.4, eps)), 4 * t * h * 2, "GB/s", ceil["copy_GBps"])
    out |= run_grid("rmsnorm", grid, timed(lambda: torch.ops.beam.rmsnorm(x, w, eps)),
                    2 * t * h * 2, "GB/s", ceil["copy_GBps"])
    return out


def _decode_timer(case):
    args = {k: v for k, v in case.items() if k != "cu_seqlens_q"}
    return lambda conf: bc.time_graph_us(lambda: _attention_decode.launch_decode(**args,
                                                                                 config=conf))


def sweep_decode(cfg, ceil, block_size=64):
    hkv, d, out = cfg.num_key_value_heads, cfg.head_dim, {}
    ctx = bc.SIZES["long_ctx"]
    for kv in (BF16, FP8):
        case = kb.paged_decode_case(cfg, 1, ctx, block_size, kv)
        grid = [dict(BLOCK_N=n, num_stages=s, programs_per_sm=p, programs_per_sm_fp8=p,
                     num_warps=4) for n in (64, 128) for s in (3, 4) for p in (2, 3, 4)]
        out |= run_grid(f"decode B=1 ctx={ctx} kv={str(kv)[6:]}", grid, _decode_timer(case),
                        ctx * hkv * d * 2 * kv.itemsize, "GB/s", ceil["copy_GBps"])
    window, batch = cfg.sliding_window, bc.SIZES["sliding_batch"]
    for padded in (False, True):
        case = kb.paged_decode_case(cfg, batch, bc.SIZES["batch_ctx"], block_size, BF16, window)
        if padded:  # ring rows one slot longer: row stride not a power of two
            for name in ("k_cache", "v_cache"):
                ring = torch.randn(batch, window + 1, hkv, d, device=bc.dev(), dtype=BF16)
                case[name] = ring[:, :window]
        grid = [dict(BLOCK_N=n, splits=s, num_stages=3, num_warps=4, programs_per_sm=2,
                     num_stages_short=3, min_split=256) for n in (64, 128) for s in (1, 2, 4)]
        out |= run_grid(f"decode sliding B={batch} padded={padded}", grid, _decode_timer(case),
                        batch * (window - 1) * hkv * d * 4, "GB/s", ceil["copy_GBps"])
    return out


def sweep_fp8(cfg, ceil, block_size=64):
    """FP8-KV decode at B=1, 128K: tile width, warps and programs per SM."""
    hkv, d, ctx = cfg.num_key_value_heads, cfg.head_dim, bc.SIZES["long_ctx"]
    case = kb.paged_decode_case(cfg, 1, ctx, block_size, FP8)
    grid = [dict(BLOCK_N=n, num_warps=w, programs_per_sm_fp8=p)
            for n in (128, 256) for w in (4, 8) for p in (3,)]
    return run_grid(f"decode B=1 ctx={ctx} kv=fp8", grid, _decode_timer(case),
                    ctx * hkv * d * 2, "GB/s", ceil["copy_GBps"])


def sweep_prefill(cfg, ceil):
    """PREFILL_CONFIG by layer kind: one fresh 16K-token sequence, full (causal) and sliding."""
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    t = bc.SIZES["tokens"]
    zero = torch.zeros(1, device=bc.dev(), dtype=torch.int32)
    grid = [dict(BLOCK_M=m, BLOCK_N=n, num_stages=s, num_warps=w)
            for m, n, s, w in itertools.product((64, 128), (32, 64, 128), (2, 3), (4, 8))]
    results = {}
    for window in (0, cfg.sliding_window):
        bs = window or 64
        cache = torch.zeros(1 if window else triton.cdiv(t, bs), bs, hkv, d, device=bc.dev(),
                            dtype=BF16)
        case = dict(q=torch.randn(t, hq, d, device=bc.dev(), dtype=BF16),
                    k_new=torch.randn(t, hkv, d, device=bc.dev(), dtype=BF16),
                    v_new=torch.randn(t, hkv, d, device=bc.dev(), dtype=BF16),
                    gate=torch.ones(t, hq, d, device=bc.dev(), dtype=BF16), k_cache=cache,
                    v_cache=cache, cu_seqlens_q=torch.tensor([0, t], device=bc.dev(),
                                                             dtype=torch.int32),
                    q_start=zero, hist_start=zero,
                    cache_index=torch.arange(cache.shape[0], device=bc.dev(),
                                             dtype=torch.int32)[None],
                    window=window, k_scale=torch.ones((), device=bc.dev()),
                    v_scale=torch.ones((), device=bc.dev()))
        pairs = sum(min(i + 1, window or t) for i in range(t))
        kind = f"sliding w={window}" if window else "full"
        results |= run_grid(
            f"prefill {kind} T={t}", grid,
            lambda conf, case=case: bc.time_us(lambda: _attention_prefill.launch_prefill(
                **case, config=conf)),
            4 * hq * d * pairs, "TFLOP/s", ceil["bf16_TFLOPs"])
    return results


def sweep_router(cfg, ceil):
    e, h = cfg.num_experts, cfg.hidden_size
    args = (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    layers = bc.SIZES["router_layers"]
    weights = [torch.randn(e, h, device=bc.dev()) / h**0.5 for _ in range(layers)]
    bias = torch.zeros(e, device=bc.dev())
    x1 = torch.randn(1, h, device=bc.dev(), dtype=BF16)

    def one(conf):
        with patched(group_router.ROUTER_CONFIG["few"], **conf):
            return bc.time_graph_us(
                lambda: [torch.ops.beam.group_router(x1, w, bias, *args) for w in weights], layers)
    grid = [dict(BLOCK_E=be, BLOCK_H=bh, SPLIT=s, num_warps=4)
            for be in (1, 2, 4) for bh in (1024, 2048) for s in (1, 2, 5)]
    out = run_grid("router T=1 (graph, per call)", grid, one, e * h * 4, "GB/s",
                   ceil["copy_GBps"])
    t = bc.SIZES["tokens"]
    xt = torch.randn(t, h, device=bc.dev(), dtype=BF16)

    def many(conf):
        with patched(group_router.ROUTER_CONFIG["many"], **conf):
            return bc.time_us(lambda: torch.ops.beam.group_router(xt, weights[0], bias, *args))
    grid = [dict(BLOCK_T=bt, BLOCK_E=be, BLOCK_H=bh, DOT_PREC=p, num_warps=w, SPLIT=1)
            for p in ("ieee", "tf32x3") for bt, be, bh in ((32, 64, 32), (64, 64, 32),
                                                           (128, 64, 32), (64, 128, 32))
            for w in (4, 8)]
    return out | run_grid(f"router T={t}", grid, many, 2 * t * e * h, "TFLOP/s",
                          ceil["fp32_TFLOPs"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="beam-1.0-501b")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", default="",
                        help="comma list of: rows,decode,fp8,prefill,router")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, no timing")
    parser.add_argument("--table", default="",
                        help="then run bench/kernels_bench.py --only TABLE with the best row "
                             "config")
    opts = parser.parse_args(argv)
    bc.configure(opts.smoke)
    if opts.smoke:
        GRID["limit"], opts.preset = 2, "tiny"
    elif not torch.cuda.is_available():
        sys.exit("bench/kernels_sweep.py needs a CUDA GPU (or --smoke)")
    cfg = preset(opts.preset)
    ceil = bc.measure_ceilings()
    print(f"ceilings: {json.dumps({k: round(v, 1) for k, v in ceil.items()})}", flush=True)
    only = set(filter(None, opts.only.split(",")))
    results = {}
    for name, fn in (("rows", sweep_rows), ("decode", sweep_decode), ("fp8", sweep_fp8),
                     ("prefill", sweep_prefill), ("router", sweep_router)):
        if not only or name in only:
            results |= fn(cfg, ceil)
            torch.cuda.empty_cache()
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "sweep.json").write_text(json.dumps(dict(ceilings=ceil, **results), indent=1))
    if opts.table:
        if "add_rmsnorm" in results:  # the fastest add_rmsnorm config for both row kernels
            best = {k: v for k, v in results["add_rmsnorm"][0].items() if k != "us"}
            rmsnorm.ROW_CONFIG["many"].update(best)
            print(f"row kernels use {best}", flush=True)
        args = ["--only", opts.table] + (["--out", str(opts.out)] if opts.out else [])
        return kb.main(args + (["--smoke"] if opts.smoke else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
