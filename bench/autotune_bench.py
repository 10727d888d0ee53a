"""The kernel search (beam_trtllm/engine/autotune.py) on the Beam-1.0 layer shapes: what
`beam-trt build --target sm90` runs on an H200, without a checkpoint.

    PYTHONPATH=. python3 bench/autotune_bench.py [--formats fp8,nvfp4] [--mode auto|quick]
                                                 [--budget S] [--out FILE.json]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/autotune_bench.py --smoke   # CPU, tiny shapes

For each recipe (fp8: every Linear and the experts FP8 W8A8; nvfp4: FP8 attention, NVFP4 dense
MLP and experts) it lists the engine's problems at decode batch 1 / 8 / 64 (the CUDA-graph
sizes) and a 2K-token prefill chunk, FP8 KV cache, 128K-token full-attention table, and runs
the search: one progress line per problem, then a table problem | default µs | chosen µs |
chosen config, and the search time. Each problem is measured against its own default launch
shape (the H200-swept tables: the ceiling a search must beat by >= 3% with the same output).
Times are device times of CUDA-graph replays, each call behind a write that evicts L2
(autotune.graph_timer), as in a decode step whose layer's weights were last read a layer ago.
About 2.5 minutes on an H200 for both recipes (--mode auto; the budget caps each recipe).
--smoke runs the tiny Beam's shapes in Triton's interpreter (wall-clock times: they say
nothing about speed; it shows the code path works). Results: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from beam_trtllm.config import PRESETS, preset  # noqa: E402
from beam_trtllm.engine.autotune import BUDGET_S, engine_problems, search, wall_timer  # noqa: E402
from beam_trtllm.engine.autotune_problems import recipe_plan  # noqa: E402
from beam_trtllm.engine.plan import BuildOptions  # noqa: E402


def options(smoke: bool) -> BuildOptions:
    if smoke:
        return BuildOptions(target="sm90", max_batch=2, max_num_tokens=8, max_seq_len=64,
                            block_size=8, cuda_graph_batch_sizes=(1, 2), kv_dtype="fp8")
    return BuildOptions(target="sm90", max_batch=64, max_num_tokens=2048, max_seq_len=131072,
                        block_size=64, cuda_graph_batch_sizes=(1, 8, 64), kv_dtype="fp8")


def table(rows: list[dict]) -> str:
    out = ["| problem | default µs | chosen µs | gain | chosen config |", "|---|---:|---:|---:|---|"]
    for r in rows:
        if r.get("default_us") is None:
            out.append(f"| {r['problem']} | - | - | - | {r.get('skipped') or 'default failed'} |")
            continue
        gain = r["default_us"] / r["chosen_us"]
        notes = f" ({len(r['rejected'])} rejected)" if r.get("rejected") else ""
        out.append(f"| {r['problem']} | {r['default_us']:.1f} | {r['chosen_us']:.1f} | "
                   f"{gain:.2f}x | {json.dumps(r['entry']) if r['entry'] else 'default'}{notes} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="fp8,nvfp4")
    ap.add_argument("--mode", choices=("auto", "quick"), default="auto")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds per recipe (default: the engine's, {BUDGET_S})")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    ap.add_argument("--out", type=Path, default=None, help="write the reports as JSON")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        sys.exit("no GPU: run on an H200, or with --smoke (and TRITON_INTERPRET=1) on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    cfg = PRESETS["tiny"] if args.smoke else preset("beam-1.0-501b")
    opts = options(args.smoke)
    name = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)"
    print(f"device: {name}; torch {torch.__version__}; mode {args.mode}", flush=True)
    timer = None if cuda else (lambda fn, config: wall_timer(fn, config, repeats=1))
    budget = args.budget if args.budget is not None else (BUDGET_S[args.mode] if cuda else 40.0)
    reports = {}
    for recipe in args.formats.split(","):
        problems = engine_problems(cfg, recipe_plan(cfg, recipe), opts, opts.kv_dtype, device)
        print(f"\n== recipe {recipe}: {len(problems)} problems, budget {budget:.0f} s", flush=True)
        t0 = time.monotonic()
        result = search(problems, args.mode, device, timer=timer, budget_s=budget,
                        progress=lambda line: print(line, flush=True))
        print(f"\nrecipe {recipe}: search {result['search_s']:.1f} s "
              f"(wall {time.monotonic() - t0:.1f} s incl. random weights), "
              f"{len(result['entries'])} of {len(problems)} problems improved\n")
        print(table(result["report"]), flush=True)
        reports[recipe] = result["report"]
    if args.out:
        args.out.write_text(json.dumps({"device": name, "mode": args.mode, "reports": reports},
                                       indent=1))


if __name__ == "__main__":
    main()
