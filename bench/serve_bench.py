"""Serving benchmark: the tiny Beam through Dynamo (agg, disagg) against the engine called directly,
and TTFT of a repeated long prompt served from the host KV tier against recomputing it.

    python bench/serve_bench.py --engine-dir out/bench/engine [--tier-engine-dir out/bench/tier]

Load: closed loop at concurrency C (C requests in flight; a finished one is replaced) until
`--requests-per-slot` x C requests are done; each prompt ~`--prompt-tokens` tokens, exactly
`--max-tokens` generated (ignore_eos). Reported per setup and C: output tokens/s (total
generated / wall time), mean TTFT, mean inter-token latency (per request: (t_last - t_first) /
(n - 1)). The direct engine runs in this process through add_request/step, so "Dynamo
overhead" = 1 - dynamo tok/s / direct tok/s at the same C (the ceiling: the engine called
directly). Every request goes to 127.0.0.1. About 3 minutes on the 2-core CPU box for
`--concurrency 8 --rounds 1 --requests-per-slot 4 --skip tier --faults agg disagg`; --smoke
(a tiny engine built in a temp dir, agg and disagg at C=1, 4 tokens, no tier) about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynamo_graphs.graph import parse_graph  # noqa: E402
from dynamo_graphs.launch import launch  # noqa: E402

HANG_S = 120.0  # a request without an end after this long is counted as hung


def prompts(tokenizer, n: int, length: int, tag: str) -> list[list[int]]:
    """n distinct prompts of exactly `length` tokens (distinct heads: no prefix sharing)."""
    base = tokenizer.encode(" ".join(f"w{j}" for j in range(length)))
    out = []
    for i in range(n):
        head = tokenizer.encode(f"{tag} {i}:")
        out.append((head + base)[:length])
    return out


def p99(values) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))] if values else float("nan")


def summarize(records, wall: float, errors: int = 0, hung: int = 0) -> dict:
    tokens = sum(r["n"] for r in records)
    itls = [(r["t_last"] - r["t_first"]) / (r["n"] - 1) for r in records if r["n"] > 1]
    ttfts = [r["ttft"] for r in records]
    return {"tok_s": tokens / wall, "ttft_ms": 1e3 * statistics.mean(ttfts),
            "ttft_p99_ms": 1e3 * p99(ttfts),
            "itl_ms": 1e3 * statistics.mean(itls) if itls else float("nan"),
            "itl_p99_ms": 1e3 * p99(itls), "requests": len(records), "errors": errors,
            "hung": hung}


# --------------------------------------------------------------------------- direct engine
def run_direct(engine, work: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    from beam_trtllm.engine.types import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    pending = list(enumerate(work))
    live: dict[str, dict] = {}
    records = []
    t0 = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i, ids = pending.pop(0)
            rid = f"direct-{i}-{time.monotonic_ns()}"
            engine.add_request(rid, ids, sampling)
            live[rid] = {"t0": time.perf_counter(), "n": 0, "t_first": None, "t_last": None}
        for out in engine.step():
            r = live.get(out.request_id)
            if r is None or not out.new_token_ids and not out.finished:
                continue
            now = time.perf_counter()
            if out.new_token_ids:
                r["n"] += len(out.new_token_ids)
                r["t_first"] = r["t_first"] or now
                r["t_last"] = now
            if out.finished:
                r["ttft"] = r["t_first"] - r["t0"]
                records.append(live.pop(out.request_id))
    return summarize(records, time.perf_counter() - t0)


# --------------------------------------------------------------------------- through Dynamo
async def _one(session, url, ids, max_tokens, rec):
    """One streamed completion; raw SSE lines (a light client, so that client-side parsing
    does not count as server overhead on a 2-core machine)."""
    body = {"model": "beam", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                rec["t_first"] = rec["t_first"] or now
                rec["t_last"] = now
            if chunk.get("usage"):
                rec["n"] = chunk["usage"]["completion_tokens"]


async def run_dynamo(url: str, work, concurrency: int, max_tokens: int) -> dict:
    import aiohttp

    queue = list(work)
    records = []
    failures = {"errors": 0, "hung": 0}
    async with aiohttp.ClientSession() as session:

        async def slot():
            while queue:
                ids = queue.pop(0)
                rec = {"t0": time.perf_counter(), "n": 0, "t_first": None, "t_last": None}
                try:  # a request with no end within HANG_S counts as hung, not as a wait
                    await asyncio.wait_for(_one(session, url, ids, max_tokens, rec), HANG_S)
                except asyncio.TimeoutError:
                    failures["hung"] += 1
                    continue
                except (RuntimeError, OSError) as exc:
                    failures["errors"] += 1
                    print(f"request failed: {exc}", flush=True)
                    continue
                rec["ttft"] = rec["t_first"] - rec["t0"]
                records.append(rec)

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(slot() for _ in range(concurrency))), 1800)
        wall = time.perf_counter() - t0
    return summarize(records, wall, **failures)


def graph(name: str, engine_dir: Path, workers: list[dict], offload: dict | None = None):
    raw = {"name": name, "engine_dir": str(Path(engine_dir).resolve()), "served_model_name": "beam",
           "frontend": {"http_port": 0, "router_mode": "kv"}, "workers": workers,
           "timeouts": {"startup_s": 300}}
    if offload:
        raw["offload"] = offload
    return parse_graph(raw, Path(tempfile.mkdtemp()) / f"{name}.yaml")


# --------------------------------------------------------------------------- sections
def throughput(args, tokenizer) -> list[tuple]:
    """Both graphs stay up; each round runs direct, agg, disagg back to back at each C, so a
    change in the machine's background load hits all three alike. Median over rounds."""
    from beam_trtllm.engine.engine import Engine

    setups = {"agg": [{"name": "backend", "role": "agg"}],
              "disagg": [{"name": "prefill", "role": "prefill"},
                         {"name": "decode", "role": "decode"}]}
    graphs = {name: launch(graph(f"bench-{name}", args.engine_dir, w), echo=None)
              for name, w in setups.items()}
    samples: dict[tuple, list[dict]] = {}
    try:
        engine = Engine.from_dir(args.engine_dir)
        run_direct(engine, prompts(tokenizer, 2, args.prompt_tokens, "warm"), 2, 4)
        for running in graphs.values():
            asyncio.run(run_dynamo(running.url, prompts(tokenizer, 2, args.prompt_tokens, "w"),
                                   2, 4))
        for rnd in range(args.rounds):
            for c in args.concurrency:
                n = c * args.requests_per_slot
                work = prompts(tokenizer, n, args.prompt_tokens, f"r{rnd}d{c}")
                samples.setdefault(("direct", c), []).append(
                    run_direct(engine, work, c, args.max_tokens))
                for name, running in graphs.items():
                    work = prompts(tokenizer, n, args.prompt_tokens, f"r{rnd}{name}{c}")
                    samples.setdefault((name, c), []).append(
                        asyncio.run(run_dynamo(running.url, work, c, args.max_tokens)))
                print(f"round {rnd} c={c}: " + "; ".join(
                    f"{k[0]} {v[-1]['tok_s']:.1f} tok/s" for k, v in samples.items()
                    if k[1] == c), flush=True)
    finally:
        for running in graphs.values():
            running.stop()
    rows = []
    for (setup, c), runs in sorted(samples.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        med = {k: statistics.median(r[k] for r in runs)
               for k in ("tok_s", "ttft_ms", "itl_ms", "ttft_p99_ms", "itl_p99_ms")}
        base = statistics.median(r["tok_s"] for r in samples[("direct", c)])
        rows.append((setup, c, sum(r["requests"] for r in runs), med["tok_s"], med["ttft_ms"],
                     med["itl_ms"], 100 * (1 - med["tok_s"] / base), med["ttft_p99_ms"],
                     med["itl_p99_ms"], sum(r.get("errors", 0) for r in runs),
                     sum(r.get("hung", 0) for r in runs)))
    return rows


async def _ttft(url, ids) -> float:
    import aiohttp

    rec = {"t0": time.perf_counter(), "n": 0, "t_first": None, "t_last": None}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await _one(session, url, ids, 2, rec)
    return rec["t_first"] - rec["t0"]


def tier_ttft(args, tokenizer) -> list[tuple]:
    """Long prompt P: cold (recompute), device hit, and host-tier hit after eviction."""
    long_len = args.tier_prompt_tokens
    workers = [{"name": "backend", "role": "agg"}]
    running = launch(graph("bench-tier", args.tier_engine_dir, workers,
                           {"host_mib": args.host_mib}), echo=None)
    rows = []
    try:
        url = running.url
        asyncio.run(_ttft(url, prompts(tokenizer, 1, 64, "warm")[0]))
        for i in range(args.tier_repeats):
            p, filler, cold = prompts(tokenizer, 3, long_len, f"tier{i}")
            t_cold = asyncio.run(_ttft(url, p))  # recompute: never seen
            t_device = asyncio.run(_ttft(url, p))  # its blocks are still on the device
            asyncio.run(_ttft(url, filler))  # evicts P's blocks to the host tier
            t_host = asyncio.run(_ttft(url, p))  # loaded back from the host tier
            t_cold2 = asyncio.run(_ttft(url, cold))
            rows.append((i, long_len, 1e3 * t_cold, 1e3 * t_cold2, 1e3 * t_device,
                         1e3 * t_host, min(t_cold, t_cold2) / t_host))
            print(rows[-1], flush=True)
        status = (running.run_dir / "status" / "backend-0.json").read_text()
        print("worker status:", status)
    finally:
        running.stop()
    return rows


def faults(args) -> None:
    """The fault scenarios (bench/_serve_faults.py) on the shipped graphs, two workers per
    group so that a killed worker leaves a survivor to answer meanwhile."""
    from dynamo_graphs.graph import load_graph
    from dynamo_graphs.launch import check_engine_limits
    from _serve_faults import kill_verdict, run_faults

    failed = []
    for name in args.faults:
        graph = load_graph(ROOT / "dynamo_graphs" / f"{name}.yaml", args.engine_dir)
        from dataclasses import replace

        graph = replace(graph, frontend=replace(graph.frontend, http_port=0),
                        workers=tuple(replace(w, count=2) for w in graph.workers))
        context = check_engine_limits(graph)
        running = launch(graph, echo=None)
        try:
            groups = [w.name for w in graph.workers][::-1]  # decode before prefill
            res = run_faults(running, groups if len(groups) > 1 else groups * 2, args, context)
        finally:
            running.stop()
        print(f"\n### faults: {name}.yaml (2 workers per group)\n```\n"
              f"{json.dumps(res, indent=1, default=str)}\n```", flush=True)
        failed += [f"{name}.yaml: {line}" for line in kill_verdict(res, args.kill_back_s)]
    if failed:
        raise SystemExit("kill -9: a stream failed or hung, or a worker came back late:\n"
                         + "\n".join(failed))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir", type=Path, default=ROOT / "out/bench/engine")
    p.add_argument("--tier-engine-dir", type=Path, default=ROOT / "out/bench/tier")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tier-prompt-tokens", type=int, default=1800)
    p.add_argument("--tier-repeats", type=int, default=3)
    p.add_argument("--host-mib", type=float, default=64)
    p.add_argument("--skip", choices=["throughput", "tier"], nargs="*", default=[])
    p.add_argument("--faults", nargs="*", choices=["agg", "disagg"], default=None,
                   help="run the fault scenarios on the shipped agg.yaml / disagg.yaml")
    p.add_argument("--fault-scenarios", nargs="+", choices=["burst", "mixed", "kill"],
                   default=["burst", "mixed", "kill"], help="which of --faults' scenarios run")
    p.add_argument("--burst", type=int, default=50)
    p.add_argument("--mixed", type=int, default=1000)
    p.add_argument("--mixed-concurrency", type=int, default=64)
    p.add_argument("--kill-streams", type=int, default=32)
    p.add_argument("--kill-tokens", type=int, default=64)
    p.add_argument("--hang-s", type=float, default=60.0)
    p.add_argument("--kill-back-s", type=float, default=15.0,
                   help="bound on a killed worker's death-to-registered time (restart backoff "
                        "1 s + engine load and warm-up; 3.5-7.9 s measured on the CPU box)")
    p.add_argument("--smoke", action="store_true",
                   help="the script's whole path at toy sizes: a tiny engine built in a temp dir, "
                        "agg and disagg at C=1, 4 tokens, no tier")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the direct engine and of every worker (same for all)")
    args = p.parse_args()
    import os

    import torch

    from beam_trtllm.tokenizer import TextTokenizer
    from dynamo_graphs.launch import stop_on_signals

    stop_on_signals()  # stop the graphs on `kill`, too
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every worker
    torch.set_num_threads(args.threads)

    if args.smoke:
        _smoke_settings(args)
    tokenizer = TextTokenizer(args.engine_dir)
    if "throughput" not in args.skip:
        rows = throughput(args, tokenizer)
        print("\n| setup | concurrency | requests | output tok/s | mean TTFT ms | p99 TTFT ms "
              "| mean ITL ms | p99 ITL ms | errors | hung | tok/s below direct |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.0f} | {r[7]:.0f} "
                  f"| {r[5]:.1f} | {r[8]:.1f} | {r[9]} | {r[10]} | {r[6]:.1f}% |")
    if args.faults:
        faults(args)
    if "tier" not in args.skip:
        rows = tier_ttft(args, tokenizer)
        print("\n| repeat | prompt tokens | TTFT cold ms | TTFT cold (2nd prompt) ms "
              "| TTFT device hit ms | TTFT host-tier hit ms | speed-up vs recompute |\n"
              "|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[3]:.0f} | {r[4]:.0f} | {r[5]:.0f} "
                  f"| {r[6]:.1f}x |")


def _smoke_settings(args) -> None:
    """--smoke: the random tiny Beam built into a temp dir (kept for the run), one request at
    C=1 through each setup, 4 tokens, no tier section."""
    from beam_trtllm.engine.build import build_engine
    from beam_trtllm.engine.plan import BuildOptions
    from beam_trtllm.tiny import init_tiny

    tmp = Path(tempfile.mkdtemp(prefix="serve-bench-smoke-"))
    init_tiny(tmp / "tiny", seed=0)
    args.engine_dir = build_engine(tmp / "tiny", tmp / "engine", BuildOptions(
        max_batch=4, max_seq_len=256, max_num_tokens=256, block_size=16))
    args.concurrency, args.requests_per_slot, args.rounds = [1], 1, 1
    args.prompt_tokens, args.max_tokens = 16, 4
    args.skip = sorted(set(args.skip) | {"tier"})


if __name__ == "__main__":
    main()
