"""Engine benchmark: per-layer decode and prefill, and whole-model decode, of a full-width Beam.

    PYTHONPATH=. python3 bench/engine_bench.py [--formats fp8,nvfp4] [--out DIR]
    PYTHONPATH=. python3 bench/engine_bench.py --smoke          # CPU, reference ops, seconds

The model (bench/_engine_model.py): Beam-1.0 at full width cut to 4 layers (0: dense sliding,
1-2: MoE sliding, 3: MoE full), random weights made on the GPU in the engine's repacked layout,
FP8 (W8A8) or NVFP4 (W4A16 on Hopper), attention projections FP8 in both, BF16 KV cache.
Ceilings measured first in the same run: device copy bandwidth and cuBLAS BF16 / FP8 / FP32
GEMM rates. Reported per format:
- whole-model decode through `Engine.step()` (scheduler, CUDA graphs, sampler) at batch 1 and
  64: ms per step and tokens/s (timed first, before any section that uses the profiler);
- per-layer batch-1 decode at 2K context against the layer's weight-read floor (bytes touched
  / copy bandwidth): one replay of a one-layer CUDA graph, and per layer in a graph chaining
  the layer 8 times (the launch paid once, as in the whole-model graph); the kernels of
  --timeline-layers inside that graph, with the idle gaps between them;
- CUDA kernels launched per layer in one eager decode step (torch profiler);
- 8 x 2K prefill per layer (one chunk of 16K tokens) against its GEMM floor (FLOPs / the
  FP8, BF16 and FP32 rates measured under sustained load, as a prefill runs; the burst
  rates' floor beside it): the layer's share of whole forwards launched back to back (CUDA
  events between the layers), and the layer run alone (synchronized around it: also the
  host's time to reach its first kernels, and the clocks nearer their peak).
About 2.5 minutes on an H200 for fp8,nvfp4 (weights are made on the device: ~40 GB for FP8);
--peer adds ~2 minutes. Results: docs/BENCHMARKS.md.

A/B options (GPU): --chain-ab times the layers under decode-chain / attention-config variants
in one process (--chain-ab-batch for a batch above 1, --chain-ab-timelines to profile each;
the profiler disturbs the times measured after it), --throughput-ab the batch-64 whole-model
step under chain variants. --ncu-layers runs a few eager decode steps of those layers for a
kernel profiler and exits (docs/BENCHMARKS.md "How to run").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from _engine_layers import (  # noqa: E402
    chain_ab, chain_layer, chain_links, count_launches, cuda_time, decode_chunks,
    decode_inputs, decode_layers, graph_timeline, layer_input, log,
)
from _engine_model import (  # noqa: E402
    bench_config, decode_bytes, make_engine, prefill_flops,
)
from _engine_ceilings import measure_ceilings  # noqa: E402
from _engine_peer import peer_layer_ms  # noqa: E402
from _engine_report import print_table  # noqa: E402
from _common import environment  # noqa: E402

from beam_trtllm.engine.batch import build_step  # noqa: E402
from beam_trtllm.engine.types import SamplingParams  # noqa: E402

GB = 1e9


def prefill(engine, seqs: int, seq_len: int, device, iters: int) -> tuple:
    """Schedule `seqs` prompts of `seq_len` in one chunk and time each layer's forward two ways:
    in one forward (CUDA events between the layers, one synchronize at the end: the layer's
    share of a prefill, the host launching ahead as the engine's forward does), and alone
    (synchronized before and after: its GPU time plus the host's time to its first kernels).
    -> (chunks, in-pass ms, alone ms, layer 1's kernels), medians per layer."""
    for k in range(seqs):
        prompt = torch.randint(0, engine.cfg.vocab_size - 8, (seq_len,)).tolist()
        engine.add_request(f"p{k}", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    chunks = engine.scheduler.schedule()
    assert sum(c.n for c in chunks) == seqs * seq_len, "budget must hold the whole prefill"
    s = build_step(chunks, engine.kv_plan.block_size, engine.cfg.sliding_window, device)
    model = engine.model
    alone = [[] for _ in model.layers]
    with torch.inference_mode():
        for it in range(iters + 1):  # the first pass compiles the kernels
            x = first_layer_inputs(model, s)
            for i in range(len(model.layers)):
                out = []
                ms = cuda_time(lambda: out.append(model.layer(i, *x, s)), 1, device)
                x = out[0]
                if it:
                    alone[i].append(ms)
        in_pass = layers_in_one_pass(model, s, device, iters)
        logits = model.logits(x[1], s)
        kernels = prefill_kernels(model, s, device) if device.type == "cuda" else None
    engine._after_forward(chunks, logits)  # commit the KV and sample the first tokens
    return (chunks, [statistics.median(t) for t in in_pass],
            [statistics.median(t) for t in alone], kernels)


def first_layer_inputs(model, s) -> tuple:
    h = torch.nn.functional.embedding(s.input_ids, model.embed)
    return (h, *model.input_norm(h))


def layers_in_one_pass(model, s, device, iters: int) -> list[list[float]]:
    """Each layer's ms in `iters` whole forwards launched back to back (one synchronize at the
    end: the GPU under sustained load, as in a long prefill), stamps between the layers (CUDA
    events; on the CPU wall time, the host running the ops)."""
    cuda = device.type == "cuda"

    def stamp():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    if cuda:
        torch.cuda.synchronize()
    passes = []
    for _ in range(iters):
        x = first_layer_inputs(model, s)
        stamps = [stamp()]
        for i in range(len(model.layers)):
            x = model.layer(i, *x, s)
            stamps.append(stamp())
        passes.append(stamps)
    if cuda:
        torch.cuda.synchronize()
    elapsed = (lambda a, b: a.elapsed_time(b)) if cuda else (lambda a, b: (b - a) * 1e3)
    return [[elapsed(p[i], p[i + 1]) for p in passes] for i in range(len(model.layers))]


def prefill_kernels(model, s, device, layer: int = 1) -> list[tuple[str, float]]:
    """Layer `layer`'s prefill kernels (torch profiler, one forward after the timed ones):
    (name, ms) in launch order; where the prefill's time goes."""
    from torch.profiler import ProfilerActivity, profile

    x = first_layer_inputs(model, s)
    for i in range(layer):
        x = model.layer(i, *x, s)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.layer(layer, *x, s)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    return [(e.name[:60], e.time_range.elapsed_us() / 1e3) for e in events]


def decode_throughput(engine, batch: int, prompt_len: int, steps: int, device) -> dict:
    """Whole-model decode through Engine.step() (scheduler, graphs, sampler included)."""
    for k in range(batch):
        prompt = torch.randint(0, engine.cfg.vocab_size - 8, (prompt_len,)).tolist()
        engine.add_request(f"d{batch}-{k}", prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    while any(r.num_computed < len(r.prompt_ids) for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(2):
        engine.step()
    graph_steps = engine.stats["graph_steps"]
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3 / steps
    for k in range(batch):
        engine.abort(f"d{batch}-{k}")
    engine.step()
    return {"batch": batch, "step_ms": ms, "tokens_per_s": batch * 1e3 / ms,
            "graph_steps": engine.stats["graph_steps"] - graph_steps, "steps": steps}


def section(res: dict, name: str, fn):
    """Run one part of the bench; a failure is recorded and the others still run."""
    t = time.perf_counter()
    try:
        out = fn()
        log(f"{res['format']}: {name} done in {time.perf_counter() - t:.1f} s")
        return out
    except Exception as exc:  # noqa: BLE001  (report every part even if one fails)
        traceback.print_exc()
        res.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
        log(f"{res['format']}: {name} FAILED: {exc}")
        return None


def bench_format(fmt: str, args, device, ceilings: dict) -> dict:
    cfg = bench_config(args.smoke)
    seqs, seq_len = (8, 2048) if not args.smoke else (2, 40)
    res = {"format": fmt, "layers": []}
    t = time.perf_counter()
    engine = make_engine(cfg, fmt, device, max_num_tokens=seqs * seq_len)
    res["setup_s"] = time.perf_counter() - t
    log(f"{fmt}: weights made in {res['setup_s']:.1f} s, "
        f"{torch.cuda.memory_allocated() / 2**30 if device.type == 'cuda' else 0:.1f} GiB on the GPU")
    whole_model_decode(engine, args, device, res)  # first: before the profiler runs
    # the median of 5 passes: with 2, two layers of the same shape differed by 3% (2026-12-01)
    pre = section(res, "prefill 8x2K", lambda: prefill(engine, seqs, seq_len, device, iters=5))
    if pre is None:
        return res
    chunks, prefill_ms, alone_ms, res["prefill_kernels_layer1"] = pre
    batch1 = decode_chunks(engine, chunks)
    if device.type == "cuda":  # the prefill's sustained load leaves the clocks power-capped
        time.sleep(2.0)  # for a while; batch-1 decode runs far below the cap (2026-12-03)
    decode = section(res, "per-layer decode graphs", lambda: decode_layers(engine, batch1, device, 200))
    decode_ms, chained_ms = decode if decode else (None, None)
    if args.chain_ab and device.type == "cuda":
        res["chain_ab"] = section(res, "decode chain A/B", lambda: chain_ab(
            engine, decode_chunks(engine, chunks, args.chain_ab_batch), device, args.chain_ab,
            args.chain_rounds, args.timeline_layers if args.chain_ab_timelines else ()))
    for i in args.timeline_layers:
        res[f"timeline_layer{i}"] = section(res, f"layer-{i} graph timeline",
                                            lambda i=i: graph_timeline(engine, batch1, device, i))
    launches = section(res, "launch count", lambda: count_launches(engine, batch1, device))
    for i in range(cfg.num_hidden_layers):
        nbytes = decode_bytes(cfg, fmt, i, context=seq_len)
        flops = prefill_flops(cfg, fmt, i, seqs, seq_len)
        floor_prefill = sum(flops[u] / ceilings[f"{u}_TFLOPs"] for u in flops) / 1e9
        floor_burst = sum(flops[u] / ceilings.get(f"{u}_burst_TFLOPs", ceilings[f"{u}_TFLOPs"])
                          for u in flops) / 1e9
        res["layers"].append({
            "layer": i, "kind": ("full" if cfg.is_full(i) else "sliding") + (" MoE" if cfg.is_moe(i) else " dense"),
            "decode_ms": decode_ms[i] if decode_ms else None,
            "decode_chained_ms": chained_ms[i] if chained_ms else None,
            "decode_floor_ms": nbytes / ceilings["copy_GBps"] / 1e6, "decode_bytes_MB": nbytes / 1e6,
            "kernels": launches[i].get("kernels") if launches else None,
            "memcpy_memset": launches[i].get("memcpy_memset") if launches else None,
            "kernel_names": launches[i].get("names") if launches else None,
            "kernel_us": launches[i].get("kernel_us") if launches else None,
            "prefill_ms": prefill_ms[i], "prefill_alone_ms": alone_ms[i],
            "prefill_floor_ms": floor_prefill, "prefill_floor_burst_ms": floor_burst,
            "prefill_TFLOP": {u: f / 1e12 for u, f in flops.items()}})
    return res


def whole_model_decode(engine, args, device, res: dict) -> None:
    """Batch-1 and batch-64 decode through Engine.step() with CUDA graphs, and the
    --throughput-ab variants. Run before the per-layer sections, which use the torch
    profiler (timelines, launch counts): chained layer times measured after it spread by up
    to 10% (2026-11-30, docs/benchmarks-history.md "How the benchmarks measure")."""
    if device.type == "cuda":
        from beam_trtllm.engine.graphs import DecodeGraphs

        engine.graphs = section(res, "capture decode graphs (1, 64)", lambda: DecodeGraphs(
            engine.model, engine.options, engine.kv_plan, engine.cfg, device, sizes=(1, 64)))
    batches = () if args.skip_throughput else (1, 64) if not args.smoke else (1, 4)
    res["decode"] = [d for b in batches if (d := section(res, f"decode batch {b}", lambda b=b:
                     decode_throughput(engine, b, 128 if not args.smoke else 6,
                                       32 if not args.smoke else 2, device))) is not None]
    if args.throughput_ab and device.type == "cuda":
        res["throughput_ab"] = section(res, "decode throughput A/B", lambda: throughput_ab(
            engine, device, args.throughput_ab, args.chain_rounds))


def throughput_ab(engine, device, variants: str, rounds: int, batch: int = 64) -> list[dict]:
    """Whole-model decode throughput at `batch` under each decode-chain variant (a --chain
    variant; ";" between them), alternating `rounds` times, graphs captured again for each."""
    from beam_trtllm.engine.graphs import DecodeGraphs
    from plugins import _pdl

    run_chain, run_graphs, out = _pdl.decode_chain_links(), engine.graphs, []
    try:
        for r in range(rounds):
            for v in variants.split(";"):
                _pdl.set_decode_chain(chain_links(v))
                engine.graphs = DecodeGraphs(engine.model, engine.options, engine.kv_plan,
                                             engine.cfg, device, sizes=(batch,))
                out.append({"round": r, "chain": v,
                            **decode_throughput(engine, batch, 128, 32, device)})
                log(f"throughput {v}: batch {batch} {out[-1]['step_ms']:.3f} ms/step")
    finally:
        _pdl.set_decode_chain(run_chain)
        engine.graphs = run_graphs
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="fp8,nvfp4",
                    help="fp8, nvfp4 (attention FP8 in both, as the shipped recipes), bf16 "
                         "(unquantized; the format of the --peer comparison)")
    ap.add_argument("--smoke", action="store_true", help="narrow config on the CPU")
    ap.add_argument("--out", type=Path, default=None,
                    help="write engine_bench.json here (default: $OUT if set)")
    ap.add_argument("--chain-ab", default="", metavar="VARIANTS",
                    help="also time the layers under these decode-chain variants, alternating "
                         "(e.g. 'off;default;all;linear'; links: plugins/_pdl.py LINKS, "
                         "FOLDS; a variant may end in '|KEY=VALUE/...': decode attention "
                         "DECODE_CONFIG overrides, e.g. 'default|min_split_short=512')")
    ap.add_argument("--chain-rounds", type=int, default=2)
    ap.add_argument("--throughput-ab", default="", metavar="VARIANTS",
                    help="also time batch-64 decode throughput under these --chain variants "
                         "(';' between them), alternating --chain-rounds times")
    ap.add_argument("--chain-ab-batch", type=int, default=1,
                    help="the decode batch of --chain-ab (at most the 8 prefilled requests)")
    ap.add_argument("--chain-ab-timelines", action="store_true",
                    help="also profile --timeline-layers under each --chain-ab variant")
    ap.add_argument("--chain", default="default", metavar="VARIANT",
                    help="the decode chain of the whole run (main table, graphs, throughput): "
                         "a --chain-ab variant without overrides")
    ap.add_argument("--timeline-layers", default="1", type=lambda v: [int(i) for i in v.split(",")],
                    help="layers whose kernels are profiled inside the chained graph")
    ap.add_argument("--skip-throughput", action="store_true",
                    help="no whole-model decode throughput (batch 1 and 64)")
    ap.add_argument("--peer", action="store_true",
                    help="also time the torch.compile + CUDA-graph peer (transformers' model, "
                         "BF16, static cache, grouped-GEMM experts) per MoE layer at batch-1 "
                         "decode; compare with --formats bf16 (about 2 min on the H200)")
    ap.add_argument("--ncu-layers", default="", metavar="LAYERS",
                    help="only run 3 eager FP8 decode steps of these layers (e.g. 1,3) after an "
                         "8 x 2K prefill, for `ncu --kernel-name ...` to profile, and exit")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    from plugins import _pdl

    _pdl.set_decode_chain(chain_links(args.chain))
    torch.manual_seed(0)
    if args.ncu_layers:
        eager_layers_for_profiler(args, device)
        return
    ceilings = measure_ceilings(device)
    log(f"ceilings: {ceilings}")
    results, env = [], environment()
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)

    def save():
        if out:
            out.mkdir(parents=True, exist_ok=True)
            Path(out, "engine_bench.json").write_text(json.dumps(
                {"env": env, "ceilings": ceilings, "results": results, "device": env["machine"]},
                indent=1))
    for fmt in args.formats.split(","):
        try:
            results.append(bench_format(fmt, args, device, ceilings))
        except Exception as exc:  # noqa: BLE001  (report every format even if one fails)
            traceback.print_exc()
            results.append({"format": fmt, "error": f"{type(exc).__name__}: {exc}"})
        gc.collect()  # the format's engine (40 GB of FP8 weights) goes before the next one
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
        print_table(results[-1:], ceilings)
    if args.peer:
        results.append({"format": "peer", "peer": run_peer(args, device)})
        save()
    print_table(results, ceilings)


def eager_layers_for_profiler(args, device) -> None:
    """Eager batch-1 FP8 decode of --ncu-layers, three times each after an 8 x 2K prefill: the
    launches a kernel profiler looks at (ncu --kernel-name regex:... --launch-count 6)."""
    seqs, seq_len = (8, 2048) if not args.smoke else (2, 40)
    engine = make_engine(bench_config(args.smoke), "fp8", device, max_num_tokens=seqs * seq_len)
    chunks, _, _ = prefill(engine, seqs, seq_len, device, iters=1)
    s, h = decode_inputs(engine, decode_chunks(engine, chunks), device)
    with torch.inference_mode():
        for i in (int(v) for v in args.ncu_layers.split(",")):
            x, xq = layer_input(engine.model, i, h)
            chain_layer(engine.model, i, h, x, xq, s, 3)
            if device.type == "cuda":
                torch.cuda.synchronize()
            log(f"layer {i}: 3 eager decode steps done")


def run_peer(args, device) -> dict:
    cfg = bench_config(args.smoke)
    try:
        return peer_layer_ms(cfg, device, context=2048 if not args.smoke else 40,
                             steps=48 if not args.smoke else 4)
    except Exception as exc:  # noqa: BLE001  (the engine's numbers stand without it)
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    main()
