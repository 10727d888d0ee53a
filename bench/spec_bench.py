"""Speculative decoding (DFlash2) on the trained tiny Beam, and the verify step's cost at Beam's
full width.

Part 1 (trained tiny, `beam-trt init-tiny --trained`, with its drafter): the engine built for
this machine (BF16; `--target sm90` on an H200), then
- lossless: greedy output with drafts on (fixed and adaptive) == drafts off, token for token,
  on `--prompts` prompts (held-out dialogue requests and held-out stdlib code prefixes);
- mean acceptance length (tokens committed per verify step) and output tokens/s at batch 1, 8
  and 32 with drafts off / fixed / adaptive (CUDA graphs on where the device has them).
Part 2 (`--full-width`, CUDA only): a full-width Beam cut to a few layers (bench/_engine_model.py),
per layer the CUDA-graph time of a verify step (B sequences x (N + 1) tokens) against a decode
step (B x 1), B = 1, 8, 32, so the drafted speedup at Beam's size can be projected:
speedup ~ acceptance length / (verify cost / decode cost + draft cost / decode cost).

The speedup is measured against the drafts-off engine on the same machine (its ceiling: the
same CUDA-graph decode step), the verify cost against a decode step of the same batch.
About 3 minutes on an H200 (build, three engine loads with the drafter's torch.compile, 100
prompts x 64 tokens three times, the speed runs); --smoke: about 30 s on a 2-core CPU.

    python bench/spec_bench.py --out OUT [--device cuda] [--full-width] [--batch-invariant]
        [--smoke]

--batch-invariant adds the lossless check in the engine's batch-invariant mode (every decode
and verify step at one shape, docs/ENGINE.md): its drafts-on engines against its drafts-off
one, and its drafts-off engine against the default one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _engine_layers import cuda_time, log  # noqa: E402

from beam_trtllm.engine.types import SamplingParams  # noqa: E402


def trained_engine_dir(work: Path, device: str, autotune: str = "quick") -> Path:
    from beam_trtllm.engine.build import build_engine
    from beam_trtllm.engine.plan import BuildOptions
    from beam_trtllm.tiny import init_trained_tiny

    ckpt = work / "trained"
    init_trained_tiny(ckpt)
    opts = BuildOptions(target="sm90" if device == "cuda" else "cpu", max_batch=32,
                        max_seq_len=1024, max_num_tokens=2048,
                        cuda_graph_batch_sizes=(1, 8, 32) if device == "cuda" else (),
                        autotune=autotune)
    return build_engine(ckpt, work / "engine", opts, progress=log, draft=ckpt / "draft")


def bench_prompts(tokenizer, n: int, seed: int = 1234) -> list[list[int]]:
    """Half held-out dialogue requests (the training seed is 0), half held-out stdlib code."""
    from beam_trtllm.train.data import is_heldout, read_source, stdlib_files, stdlib_root
    from beam_trtllm.train.dialogues import dialogues

    chats = [e.prompt for e in dialogues(n, seed)][: (n + 1) // 2]
    rng = random.Random(seed)
    root = stdlib_root()
    code = []
    for rel in stdlib_files(root):
        text = read_source(root, rel) if is_heldout(rel) else None
        # a few windows per file (8 at most: Python 3.12's stdlib has fewer held-out files)
        for _ in range(min(8, len(text) // 2000) if text else 0):
            at = rng.randrange(0, len(text) - 400)
            code.append(text[at:at + 300])
    rng.shuffle(code)
    prompts = [tokenizer.encode(t) for t in chats]
    prompts += [tokenizer.encode(t) for t in code[: n - len(prompts)]]
    return [p[-400:] for p in prompts][:n]


def run(engine, prompts, max_tokens: int, batch: int) -> tuple[list[list[int]], float, float]:
    """Greedy outputs of `prompts`, `batch` at a time -> (outputs, output tokens/s end to end,
    decode tokens/s). Decode: the tokens after each request's first over the time after the
    batch's last first token (the prefill and the first token excluded: what drafts speed up)."""
    outs, tokens, decode_tokens, decode_s = [], 0, 0, 0.0
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids = [f"bench-{i + j}" for j in range(len(prompts[i:i + batch]))]
        for rid, prompt in zip(ids, prompts[i:i + batch]):
            engine.add_request(rid, prompt, sp)
        got = {rid: [] for rid in ids}
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id in got:
                    got[out.request_id] += out.new_token_ids
            if first is None and all(got.values()):
                first = time.perf_counter()
        sync()
        decode_s += time.perf_counter() - (first or time.perf_counter())
        outs += [got[r] for r in ids]
        tokens += sum(len(got[r]) for r in ids)
        decode_tokens += sum(len(got[r]) - 1 for r in ids)
    total = time.perf_counter() - t0
    return outs, tokens / total, decode_tokens / decode_s if decode_s else float("nan")


def lossless(engine, ref: list[list[int]], prompts, max_tokens: int, name: str) -> dict:
    """How many of `prompts` the engine answers (greedy, 8 at a time) with the tokens `ref`."""
    got, _, _ = run(engine, prompts, max_tokens, 8)
    same = sum(a == b for a, b in zip(ref, got))
    first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
             for a, b in zip(ref, got)]
    log(f"lossless {name}: {same}/{len(prompts)} prompts identical")
    return {"identical": same, "of": len(prompts),
            "first_divergence": [f for f in first if f is not None][:10]}


def invariant_lossless(path: Path, args, prompts, ref) -> dict:
    """The same check in the engine's batch-invariant mode (docs/ENGINE.md), against its own
    drafts-off engine; and that engine against the default one (`ref`)."""
    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.speculative import SpecConfig

    modes = {"off": False, "fixed": SpecConfig(compile=False),
             "adaptive": SpecConfig(adaptive=True, compile=False)}
    engines = {m: Engine.from_dir(path, device=args.device, speculative=s, batch_invariant=True)
               for m, s in modes.items()}
    inv_ref, _, _ = run(engines["off"], prompts, args.max_tokens, 8)
    out = {"invariant off vs default off": lossless(engines["off"], ref, prompts,
                                                    args.max_tokens, "invariant off vs default")}
    for m in ("fixed", "adaptive"):
        out[f"invariant {m}"] = lossless(engines[m], inv_ref, prompts, args.max_tokens,
                                         f"invariant {m}")
    return out


def tiny_part(args, work: Path) -> dict:
    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.speculative import SpecConfig

    path = trained_engine_dir(work, args.device, "off" if args.smoke else "quick")
    modes = {"off": False, "fixed": SpecConfig(), "adaptive": SpecConfig(adaptive=True)}
    engines = {m: Engine.from_dir(path, device=args.device, speculative=s) for m, s in modes.items()}
    prompts = bench_prompts(engines["off"].tokenizer, args.prompts)
    res = {"prompts": len(prompts), "max_tokens": args.max_tokens, "lossless": {}, "speed": []}
    ref, _, _ = run(engines["off"], prompts, args.max_tokens, 8)
    for m in ("fixed", "adaptive"):
        res["lossless"][m] = lossless(engines[m], ref, prompts, args.max_tokens, m)
    if args.batch_invariant:
        res["lossless"] |= invariant_lossless(path, args, prompts, ref)
    for batch in args.batches:
        sub = (prompts * ((batch + len(prompts) - 1) // len(prompts)))[:max(batch, args.speed_prompts)]
        for eng in engines.values():
            run(eng, sub, args.max_tokens, batch)  # warm-up: every shape's kernels compiled
        runs = {m: [] for m in engines}
        for _ in range(args.repeats):  # the modes in turn, so a drift of the machine hits all
            for m, eng in engines.items():
                runs[m].append(speed_run(eng, sub, args.max_tokens, batch))
        for m, rows in runs.items():
            row = {"batch": batch, "mode": m, "runs": rows}
            for key in ("tokens_per_s", "decode_tokens_per_s", "mean_acceptance_length"):
                vals = [r[key] for r in rows if r.get(key) is not None]
                row[key] = statistics.median(vals) if vals else None
            row["decode_range"] = (min(r["decode_tokens_per_s"] for r in rows),
                                   max(r["decode_tokens_per_s"] for r in rows))
            res["speed"].append(row)
            log(f"batch {batch} {m}: {row['tokens_per_s']:.0f} tok/s, decode "
                f"{row['decode_tokens_per_s']:.0f} tok/s (median of {len(rows)})"
                + (f", acceptance length {row['mean_acceptance_length'] or 0:.2f}"
                   if m != "off" else ""))
    return res


def speed_run(eng, prompts, max_tokens: int, batch: int) -> dict:
    """One timed pass: tokens/s end to end and in decode, the acceptance length, the share
    of verify steps that ran chained (spec_chain.py)."""
    before = dict(eng.stats) | (eng.spec.stats if eng.spec else {})
    _, tps, decode = run(eng, prompts, max_tokens, batch)
    row = {"tokens_per_s": tps, "decode_tokens_per_s": decode}
    if eng.spec is not None:
        st = eng.spec.stats
        steps = st["spec_verify_steps"] - before["spec_verify_steps"]
        acc = st["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        row["mean_acceptance_length"] = (acc + steps) / steps if steps else None
        chained = st["spec_chained_verifies"] - before["spec_chained_verifies"]
        row["chained_share"] = chained / steps if steps else None
    return row


def full_width_part(args) -> list[dict]:
    """Per layer: a verify step of B x (N + 1) tokens vs a decode step of B x 1 (CUDA graphs)."""
    from _engine_layers import layer_input
    from _engine_model import bench_config, make_engine

    from beam_trtllm.engine.batch import build_step
    from beam_trtllm.engine.request import Chunk, Request

    device = torch.device(args.device)
    cfg = bench_config(args.smoke)
    engine = make_engine(cfg, "fp8", device,
                         max_num_tokens=max(64, max(args.batches) * (args.draft + 1)))
    rows = []
    for batch in args.batches:
        reqs = []
        for b in range(batch):
            req = Request(f"v{b}", [1] * args.context, SamplingParams(), b, args.context + 64)
            engine.scheduler._admit(req, args.context)
            engine.scheduler.commit(Chunk(req, 0, args.context))
            assert engine.scheduler._ensure_blocks(req, args.context + args.draft + 1)
            reqs.append(req)
        drafts = tuple(range(3, 3 + args.draft))
        for q, chunks in ((1, [Chunk(r, r.num_computed - 1, 1) for r in reqs]),
                          (args.draft + 1, [Chunk(r, r.num_computed - 1, 1 + args.draft, drafts)
                                            for r in reqs])):
            s = build_step(chunks, engine.kv_plan.block_size, cfg.sliding_window, device)
            h = torch.randn(batch * q, cfg.hidden_size, device=device, dtype=torch.bfloat16)
            for i in range(cfg.num_hidden_layers):
                x, xq = layer_input(engine.model, i, h)
                fn = (lambda i=i, x=x, xq=xq: engine.model.layer(i, h, x, xq, s, into=i))
                fn()
                if device.type == "cuda":
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        fn()
                    ms = cuda_time(graph.replay, 50, device)
                else:
                    ms = cuda_time(fn, 2, device)
                kind = ("full" if cfg.is_full(i) else "sliding") + (" MoE" if cfg.is_moe(i) else " dense")
                rows.append({"batch": batch, "tokens_per_seq": q, "layer": i, "kind": kind, "ms": ms})
        for r in reqs:
            engine.scheduler.finish(r)
    return rows


def markdown(res: dict) -> str:
    out = []
    tiny = res.get("tiny")
    if tiny:
        out += ["| drafts | identical greedy outputs |", "| --- | --- |"]
        out += [f"| {m} | {v['identical']}/{v['of']} |" for m, v in tiny["lossless"].items()]
        out += ["", "| batch | drafts | tokens/s end to end | decode tokens/s (range) | x off "
                "(decode) | mean acceptance length |", "| ---: | --- | ---: | ---: | ---: | ---: |"]
        off = {r["batch"]: r["decode_tokens_per_s"] for r in tiny["speed"] if r["mode"] == "off"}
        for r in tiny["speed"]:
            acc = r.get("mean_acceptance_length")
            lo, hi = r["decode_range"]
            out.append(f"| {r['batch']} | {r['mode']} | {r['tokens_per_s']:.0f} | "
                       f"{r['decode_tokens_per_s']:.0f} ({lo:.0f}-{hi:.0f}) | "
                       f"{r['decode_tokens_per_s'] / off[r['batch']]:.2f} | "
                       f"{'' if acc is None else f'{acc:.2f}'} |")
    fw = res.get("full_width")
    if fw:
        out += ["", "| batch | layer | kind | decode ms | verify ms | verify / decode |",
                "| ---: | ---: | --- | ---: | ---: | ---: |"]
        dec = {(r["batch"], r["layer"]): r["ms"] for r in fw if r["tokens_per_seq"] == 1}
        for r in fw:
            if r["tokens_per_seq"] > 1:
                d = dec[(r["batch"], r["layer"])]
                out.append(f"| {r['batch']} | {r['layer']} | {r['kind']} | {d:.3f} | "
                           f"{r['ms']:.3f} | {r['ms'] / d:.2f} |")
    return "\n".join(out) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("out/spec_bench"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=100)
    p.add_argument("--speed-prompts", type=int, default=96,
                   help="prompts of each timed pass (at batch 32: three batches)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed passes per batch and mode "
                   "(the modes in turn; the median is reported)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--full-width", action="store_true")
    p.add_argument("--no-tiny", action="store_true")
    p.add_argument("--draft", type=int, default=7, help="draft tokens of the full-width verify step")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch-invariant", action="store_true",
                   help="also the lossless check in the engine's batch-invariant mode")
    p.add_argument("--smoke", action="store_true", help="a few prompts and tokens (CPU tests)")
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.speed_prompts, args.max_tokens, args.batches = 3, 2, 6, [1, 2]
        args.repeats = 1
        args.context = 40
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"date": time.strftime("%Y-%m-%d"), "device": args.device,
           "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_tiny:
            res["tiny"] = tiny_part(args, Path(tmp))
    if args.full_width:
        res["full_width"] = full_width_part(args)
    (args.out / "spec_bench.json").write_text(json.dumps(res, indent=2))
    (args.out / "spec_bench.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
