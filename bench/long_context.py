"""Long-context benchmark: one 128K-token and one 1M-token request through a full-width Beam
engine dir (FP8 weights, FP8 KV cache): chunked prefill and decode at that depth against
their floors, and the GPU memory used against `beam-trt info`'s plan.

    PYTHONPATH=.:bench python3 bench/long_context.py --out OUT    # H200, about 5 minutes
    PYTHONPATH=.:bench python3 bench/long_context.py --smoke      # CPU, narrow model, seconds

The model (bench/_long_context_model.py): Beam-1.0's widths (the beam-1.0-501b preset) cut to
--layers (default sD,fM: a sliding-window dense layer and a full-attention MoE layer with 256
FP8 experts), random weights at realistic magnitudes written as the checkpoint `beam-trt
convert --quant fp8` writes, built by `beam-trt build` (--target sm90, its kernel search
included; --kv-dtype fp8 --max-batch 1 --max-seq-len = the longest context --max-num-tokens
16384) and loaded with Engine.from_dir (CUDA graphs on). Ceilings, measured first in the same
run: copy bandwidth and cuBLAS FP8 / BF16 / FP32 GEMM rates (as bench/engine_bench.py), and
the attention rate of torch's SDPA (flash attention, BF16, Beam's 48 heads of 128; the faster
of causal 16K and a 16K chunk over 64K keys). Per request (random token ids; the prompt leaves
room for the decode steps, so the sequence ends at the context):
- chunked prefill through Engine.step(), one progress line per chunk: seconds and tokens/s
  against the floor = GEMM FLOPs at the GEMM rates + attention FLOPs (4 * visible keys * heads
  * head_dim, causal) at the attention rate;
- decode at that depth: ms per Engine.step() (graph replay, scheduler, sampler), the mean of
  a run of --decode-steps steps timed as a whole (the engine launches a step ahead), and the decode CUDA graph's replay alone (GPU time), against the
  floor = bytes one step reads (weights, LM head, FP8 KV of every visible position) / copy;
- GPU memory after loading (weights + KV cache + graphs: torch's allocated bytes), at the
  prefill's peak (max_memory_allocated) and the device's use (mem_get_info), against the plan
  of `beam-trt info ENGINE_DIR --context MAX_SEQ_LEN` (beam_trtllm.info.report: FP8 weight
  bytes + the KV of one sequence).
A warm-up request of two chunks runs first (kernel compilation). Time on an H200, about 5
minutes: 1-2 to write the checkpoint and build (about 14 GB each for sD,fM under --work-dir,
removed at the end; the build's kernel search is at most 75 s), about 1 for the 1M prefill,
whose causal attention is 4 * 2^40 / 2 * 48 * 128 = 1.35e16 FLOPs per full layer: 23 s at
SDPA's ~580 TFLOP/s, 32 s at the 426 TFLOP/s of the engine's prefill kernel (kernels_bench.py,
2026-12-01). Writes long_context.json and long_context.md to --out (default: $OUT if set).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from _common import environment  # noqa: E402
from _engine_layers import cuda_time, log  # noqa: E402
from _long_context_model import (  # noqa: E402
    bench_config, checkpoint_plan, decode_bytes, floor_seconds, planned_bytes, prefill_flops,
    write_checkpoint,
)
from _long_context_report import checks, markdown, memory_result, token_label  # noqa: E402

from beam_trtllm.engine.plan import BuildOptions, cdiv  # noqa: E402
from beam_trtllm.engine.types import SamplingParams  # noqa: E402

CONTEXTS, SMOKE_CONTEXTS = (131072, 1048576), (256, 2048)
WARM_DECODE = 2  # decode steps before the timed ones (and before the graph replay timing)
GIB = 1 << 30


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="narrow model, contexts 256 and 2048, on the CPU (the ops' references)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write long_context.json and .md here (default: $OUT if set)")
    ap.add_argument("--layers", default="sD,fM",
                    help="the cut: s/f = sliding/full attention, D/M = dense/MoE, e.g. sD,sM,fM")
    ap.add_argument("--contexts", default=None, type=lambda v: [int(x) for x in v.split(",")],
                    help="request lengths in tokens (default 131072,1048576; --smoke 256,2048)")
    ap.add_argument("--max-num-tokens", type=int, default=None,
                    help="the build's token budget per step = the prefill chunk "
                         "(default 16384; --smoke 256)")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="timed decode steps per request (default 32; --smoke 4)")
    ap.add_argument("--autotune", default="auto", choices=("auto", "quick", "off"),
                    help="the build's kernel search (`beam-trt build --autotune`)")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="where the checkpoint and engine dir are written (default: the "
                         "system temp dir); both are removed at the end")
    ap.add_argument("--engine-dir", type=Path, default=None,
                    help="build the engine dir here and keep it; if it already holds one, "
                         "use it and skip the checkpoint and build")
    args = ap.parse_args(argv)
    args.contexts = args.contexts or list(SMOKE_CONTEXTS if args.smoke else CONTEXTS)
    args.max_num_tokens = args.max_num_tokens or (256 if args.smoke else 16384)
    args.decode_steps = args.decode_steps or (4 if args.smoke else 32)
    shortest = 1 + WARM_DECODE + args.decode_steps + 2
    if min(args.contexts) < shortest:
        ap.error(f"--contexts: each must be >= {shortest} tokens (1 prompt token + "
                 f"{WARM_DECODE} + --decode-steps + 1 generated)")
    return args


def build_options(args) -> BuildOptions:
    cuda = not args.smoke
    return BuildOptions(target="sm90" if cuda else "cpu", max_batch=1,
                        max_seq_len=max(args.contexts), max_num_tokens=args.max_num_tokens,
                        kv_dtype="fp8", block_size=32 if cuda else 16, autotune=args.autotune,
                        cuda_graph_batch_sizes=(1,) if cuda else ())


# ---------------------------------------------------------------------------- ceilings
def measure_ceilings(cfg, device, smoke: bool) -> dict:
    from _engine_ceilings import measure_ceilings as gemm_and_copy

    out = gemm_and_copy(device)
    out.update(attention_ceiling(cfg, device, smoke))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def attention_ceiling(cfg, device, smoke: bool) -> dict:
    """torch SDPA's rate at Beam's heads (BF16; flash attention on the GPU), the faster of a
    causal T x T prefill and a T-token chunk over S cached keys (no mask): FLOPs 4 * keys *
    heads * head_dim over the median time."""
    t, s = (64, 256) if smoke else (16384, 65536)
    h, d, bf16 = cfg.num_attention_heads, cfg.head_dim, torch.bfloat16
    try:
        q = torch.randn(1, h, t, d, device=device, dtype=bf16)
        k, v = (torch.randn(1, h, s, d, device=device, dtype=bf16) for _ in range(2))
        kt, vt = k[:, :, :t].contiguous(), v[:, :, :t].contiguous()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        rates = {}
        shapes = (("causal", lambda: sdpa(q, kt, vt, is_causal=True), t * (t + 1) / 2),
                  ("chunk", lambda: sdpa(q, k, v), float(t * s)))
        for name, fn, keys in shapes:
            fn()
            ms = cuda_time(fn, 1 if smoke else 5, device)
            rates[f"attention_{name}_TFLOPs"] = 4.0 * keys * h * d / ms / 1e9
        where = f"SDPA bf16, {h} heads x {d}: causal {t}x{t}, chunk {t} over {s}"
        return {**rates, "attention_TFLOPs": max(rates.values()), "attention_shapes": where}
    except Exception as exc:  # noqa: BLE001  (fall back to the BF16 GEMM rate, and say so)
        traceback.print_exc()
        return {"attention_TFLOPs": None, "attention_note": f"SDPA timing failed: {exc}"}


# ---------------------------------------------------------------------------- engine dir
@contextlib.contextmanager
def engine_dir(args, cfg, opts: BuildOptions, device, res: dict):
    """The engine dir: built from a fresh random checkpoint (removed once built), or the one
    --engine-dir already holds."""
    from beam_trtllm.engine.build import build_engine

    if args.engine_dir is not None and (args.engine_dir / "engine.json").is_file():
        log(f"using the engine dir in {args.engine_dir} (no checkpoint, no build)")
        res["build"] = {"reused": str(args.engine_dir)}
        yield args.engine_dir
        return
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="beam-long-context-", dir=args.work_dir))
    target = args.engine_dir or work / "engine"
    try:
        t = time.perf_counter()
        written = write_checkpoint(cfg, work / "checkpoint", device, log)
        res["build"] = {"checkpoint_GB": written / 1e9, "checkpoint_s": time.perf_counter() - t}
        t = time.perf_counter()
        target.parent.mkdir(parents=True, exist_ok=True)
        build_engine(work / "checkpoint", target, opts, progress=log, overwrite=True)
        res["build"]["build_s"] = time.perf_counter() - t
        shutil.rmtree(work / "checkpoint")
        log(f"engine dir built in {res['build']['build_s']:.0f} s; checkpoint removed")
        yield target
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_space(args, cfg) -> None:
    """Refuse at once (before any GPU work) a work dir without room for the checkpoint and
    the engine dir (about the same size)."""
    if args.engine_dir is not None and (args.engine_dir / "engine.json").is_file():
        return
    where = args.work_dir or Path(tempfile.gettempdir())
    while not where.exists():
        where = where.parent
    need = 2 * planned_bytes(checkpoint_plan(cfg)) + GIB
    free = shutil.disk_usage(where).free
    if free < need:
        raise SystemExit(f"{where}: {free / 1e9:.1f} GB free, the checkpoint and the engine dir "
                         f"need {need / 1e9:.1f} GB; pass --work-dir on a larger disk")
    log(f"work dir {where}: {free / 1e9:.0f} GB free, {need / 1e9:.1f} GB needed")


def load_engine(path: Path, device, res: dict):
    from beam_trtllm.engine.engine import Engine

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    t = time.perf_counter()
    engine = Engine.from_dir(path, device=device, verify=False, progress=log)
    res["load_s"] = time.perf_counter() - t
    log(f"engine loaded in {res['load_s']:.1f} s")
    return engine, base


# ---------------------------------------------------------------------------- one request
def run_request(engine, context: int, args, ceilings: dict, device, base: int) -> dict:
    """Prefill `context` - generated tokens of random ids in chunks, then decode to
    `context`; the times, floors and memory."""
    steps, label = args.decode_steps, token_label(context)
    max_tokens = 1 + WARM_DECODE + steps + 1  # the last step (untimed) finishes the request
    prompt_len = context - max_tokens
    ids = torch.randint(0, engine.cfg.vocab_size, (prompt_len,),
                        generator=torch.Generator().manual_seed(context)).tolist()
    rid = f"long-context-{context}"
    engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    req = engine.requests[rid]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out = {"context": context, "label": label, "prompt_tokens": prompt_len}
    out["prefill"] = prefill(engine, req, ceilings, device, label)
    out["memory"] = memory_now(device, base)
    out["decode"] = decode(engine, req, steps, ceilings, device)
    return out


def prefill(engine, req, ceilings: dict, device, label: str) -> dict:
    cfg, prompt_len = engine.cfg, len(req.prompt_ids)
    floor = floor_seconds(prefill_flops(cfg, 0, prompt_len, sampled=1), ceilings)
    n_chunks = cdiv(prompt_len, engine.options.max_num_tokens)
    chunks, started, floor_done = [], time.perf_counter(), 0.0
    while req.num_computed < prompt_len:
        start, t = req.num_computed, time.perf_counter()
        engine.step()
        sync(device)
        seconds, n = time.perf_counter() - t, req.num_computed - start
        if n <= 0:
            raise RuntimeError(f"{label}: a prefill step computed no tokens at position {start}")
        chunk_floor = floor_seconds(prefill_flops(cfg, start, n, int(start + n == prompt_len)),
                                    ceilings)["total"]
        chunks.append({"start": start, "tokens": n, "s": seconds, "floor_s": chunk_floor})
        floor_done += chunk_floor
        elapsed = time.perf_counter() - started
        left = max(0.0, elapsed / floor_done * (floor["total"] - floor_done))
        log(f"{label}: chunk {len(chunks)}/{n_chunks} positions [{start:,}, {start + n:,}) "
            f"{seconds:.3f} s ({n / seconds:,.0f} tok/s, {seconds / chunk_floor:.2f}x floor); "
            f"{elapsed:.1f} s so far, ~{left:.0f} s left")
    elapsed = time.perf_counter() - started
    if len(req.output_ids) != 1:
        raise RuntimeError(f"{label}: the prefill sampled {len(req.output_ids)} tokens, not 1")
    return {"s": elapsed, "tokens_per_s": prompt_len / elapsed, "floor": floor,
            "x_floor": elapsed / floor["total"], "chunks": chunks}


def decode(engine, req, steps: int, ceilings: dict, device) -> dict:
    """Engine.step() at depth: WARM_DECODE steps, the graph replay timing, `steps` timed
    steps, then the step that finishes the request (freeing its KV: not a decode step's cost)."""
    for _ in range(WARM_DECODE):
        engine.step()
    replay = graph_replay(engine, req, device)
    # timed as a run: a sync per step would wait for the step launched ahead (overlap.py)
    graph_steps, overlapped = engine.stats["graph_steps"], engine.stats.get("overlapped_steps", 0)
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    mean_s = (time.perf_counter() - t) / steps
    while engine.has_unfinished():
        engine.step()
    if req.finish_reason != "length":
        raise RuntimeError(f"request {req.request_id}: ended {req.finish_reason!r} after "
                           f"{len(req.output_ids)} tokens, expected 'length'")
    depth = len(req.prompt_ids) + 1 + WARM_DECODE + steps // 2  # the timed steps' middle
    nbytes = decode_bytes(engine.cfg, depth)
    floor_ms = nbytes["total"] / ceilings["copy_GBps"] / 1e6
    step_ms = 1e3 * mean_s
    return {"steps": steps, "depth": depth, "step_ms": step_ms, "mean_step_ms": step_ms,
            "graph_steps": engine.stats["graph_steps"] - graph_steps,
            "overlapped_steps": engine.stats.get("overlapped_steps", 0) - overlapped, **replay,
            "floor_ms": floor_ms, "floor_bytes": nbytes, "x_floor": step_ms / floor_ms,
            "replay_x_floor": replay["replay_ms"] / floor_ms if replay["replay_ms"] else None,
            "host_ms": step_ms - replay["replay_ms"] if replay["replay_ms"] else None}


def graph_replay(engine, req, device, iters: int = 20) -> dict:
    """GPU time of one decode step: the engine's batch-1 decode graph filled for the
    request's next position and replayed (it rewrites that position's K/V with the values
    the next step writes), without the scheduler, host copies or sampler."""
    if engine.graphs is None:
        return {"replay_ms": None, "replay_note": "no CUDA graphs on this device"}
    from beam_trtllm.engine.request import Chunk

    try:
        if not engine.scheduler._ensure_blocks(req, req.num_computed + 1):
            raise RuntimeError("no free KV block for the next position")
        graphs = engine.graphs
        graphs._fill([Chunk(req, req.num_computed, 1)])
        graph = graphs.graphs[graphs.size_for(1)][0]
        return {"replay_ms": cuda_time(graph.replay, iters, device)}
    except (AttributeError, KeyError, TypeError, RuntimeError) as exc:
        traceback.print_exc()
        return {"replay_ms": None, "replay_note": f"{type(exc).__name__}: {exc}"}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_now(device, base: int) -> dict:
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"peak_allocated": torch.cuda.max_memory_allocated(device) - base,
            "allocated": torch.cuda.memory_allocated(device) - base,
            "reserved": torch.cuda.memory_reserved(device), "device_used": total - free}


# ---------------------------------------------------------------------------- the run
def attempt(res: dict, name: str, fn):
    """One part of the run; a failure is recorded and the others still run."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  (report every request even if one fails)
        traceback.print_exc()
        res.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
        log(f"{name} FAILED: {exc}")
        return None


def log_floors(cfg, contexts, ceilings: dict) -> None:
    for ctx in contexts:
        f = floor_seconds(prefill_flops(cfg, 0, ctx, 1), ceilings)
        ms = decode_bytes(cfg, ctx)["total"] / ceilings["copy_GBps"] / 1e6
        log(f"{token_label(ctx)}: prefill floor {f['total']:.2f} s (GEMMs {f['gemm']:.2f} s, "
            f"attention {f['attention']:.2f} s); decode floor {ms:.3f} ms per step")


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    started = time.perf_counter()
    torch.manual_seed(0)
    cfg = bench_config(args.layers, args.smoke, max(args.contexts))
    opts = build_options(args)
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    res = {"env": environment(), "command": " ".join(sys.argv), "smoke": args.smoke,
           "layers": args.layers, "options": opts.to_json(),
           "config": {k: v for k, v in cfg.to_hf().items() if k != "rope_parameters"},
           "requests": []}
    check_space(args, cfg)
    res["ceilings"] = ceilings = measure_ceilings(cfg, device, args.smoke)
    if ceilings["attention_TFLOPs"] is None:
        ceilings["attention_TFLOPs"] = ceilings["bf16_TFLOPs"]
    log(f"ceilings: {ceilings}")
    log_floors(cfg, args.contexts, ceilings)
    attempt(res, "engine", lambda: run_requests(args, cfg, opts, ceilings, device, res,
                                                out, started))
    res["total_s"] = time.perf_counter() - started
    res["checks"] = checks(res)
    save(out, res)
    print(markdown(res), flush=True)
    log(f"done in {res['total_s']:.0f} s")
    if res.get("errors"):
        sys.exit(1)


def run_requests(args, cfg, opts, ceilings: dict, device, res: dict, out, started: float):
    """Build and load the engine, then the warm-up request and the timed ones."""
    with engine_dir(args, cfg, opts, device, res) as path:
        engine, base = load_engine(path, device, res)
        res["memory"] = memory_result(engine, path, device, base)
        log(f"memory after loading: {res['memory']['summary']}")
        warm = min(2 * args.max_num_tokens, max(args.contexts))  # the timed chunks' shapes
        res["warmup"] = attempt(res, "warm-up", lambda: run_request(
            engine, warm, args, ceilings, device, base))
        for ctx in args.contexts:
            r = attempt(res, token_label(ctx), lambda ctx=ctx: run_request(
                engine, ctx, args, ceilings, device, base))
            res["requests"].append(r or {"context": ctx, "label": token_label(ctx)})
            res["total_s"] = time.perf_counter() - started
            save(out, res)


def save(out: Path | None, res: dict) -> None:
    text = json.dumps(res, indent=1, default=str)  # serialised on every run, --smoke too
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "long_context.json").write_text(text)
        (out / "long_context.md").write_text(markdown(res) + "\n")


if __name__ == "__main__":
    main()
