"""The whole GPU benchmark suite in one command: kernels, per-layer decode and prefill, and
whole-model decode throughput, each against its ceiling measured in the same run.

    PYTHONPATH=.:bench python3 bench/suite.py --out DIR [--budget 570] [--peer]
    PYTHONPATH=.:bench python3 bench/suite.py --out DIR --smoke     # CPU: every step, tiny

Steps, each a fresh process (its own CUDA context and memory), in this order:
- kernels: bench/kernels_bench.py --moe-formats fp8,nvfp4 --no-eager (norms, qk_prep, attention
  decode and prefill, router, MoE decode against the weight-read floor and prefill against the FP8 /
  BF16 GEMM rate, linear layers), ceilings: copy bandwidth and cuBLAS GEMM rates;
- fp8_channel: bench/kernels_fp8_channel.py, when that file exists;
- engine: bench/engine_bench.py --formats fp8,nvfp4 (per-layer batch-1 decode against the
  weight-read floor, 8 x 2K prefill against the GEMM floor, kernels per layer, whole-model
  decode at batch 1 and 64 through Engine.step()), ceilings measured by the step itself;
- peer (--peer, if at least 200 s of the budget are left): engine_bench.py --formats bf16
  --peer, transformers' model under torch.compile against the engine's BF16 MoE layers.
About 7 minutes on an H200 (9 with --peer); --budget caps the whole (each step is stopped at
what is left of it, and the steps after it are skipped). Writes DIR/suite.json (every
number, the machine, commit and versions, each step's command, exit status and log tail)
and DIR/suite.md (the tables docs/BENCHMARKS.md shows); each step's own files are kept under
DIR/<step>/. Compare two runs with bench/compare.py OLD/suite.json NEW/suite.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(BENCH)]

from _common import environment  # noqa: E402
from _suite_report import metrics, render  # noqa: E402

PEER_MIN_S = 200  # the peer compiles two models: ~2-3 minutes on an H200


def steps(smoke: bool, peer: bool) -> list[dict]:
    """(name, command, JSON files it writes under its directory) of each step."""
    tiny = ["--smoke"] if smoke else []
    out = [dict(name="kernels", args=["kernels_bench.py", "--moe-formats", "fp8,nvfp4",
                                      "--no-eager", *tiny],
                files=["results.json"], interpret=True)]
    if (BENCH / "kernels_fp8_channel.py").exists():
        out.append(dict(name="fp8_channel", args=["kernels_fp8_channel.py", *tiny], files=None,
                        interpret=True))
    engine = ["engine_bench.py", "--formats", "fp8" if smoke else "fp8,nvfp4",
              "--timeline-layers", "1,3"]
    out.append(dict(name="engine", args=[*engine, *tiny], files=["engine_bench.json"]))
    if peer:
        out.append(dict(name="peer", args=["engine_bench.py", "--formats", "bf16", "--peer",
                                           "--skip-throughput", *tiny],
                        files=["engine_bench.json"], min_s=0 if smoke else PEER_MIN_S))
    return out


def child_env(interpret: bool, smoke: bool) -> dict:
    """The caller's environment with the repository and bench/ first on PYTHONPATH (what
    was there before, e.g. a transformers wheel's directory, stays after them)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(ROOT), str(BENCH)] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env["PYTHONPATH"] = ":".join(dict.fromkeys(paths))
    if smoke and interpret:
        env["TRITON_INTERPRET"] = "1"  # kernels on the CPU: before triton is imported
    return env


def run_step(step: dict, out: Path, seconds_left: float, smoke: bool) -> dict:
    """Run one step with its own --out directory, stopped after `seconds_left`; its exit
    status, time, log tail and the JSON files it wrote."""
    where = out / step["name"]
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(BENCH / step["args"][0]), *step["args"][1:], "--out", str(where)]
    print(f"[suite] {step['name']}: {' '.join(cmd[1:])} (at most {seconds_left:.0f} s)", flush=True)
    t0, log = time.monotonic(), where / "log.txt"
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(step.get("interpret", False), smoke),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        stop = threading.Timer(max(1.0, seconds_left), proc.kill)  # the budget's end
        stop.start()
        for line in proc.stdout:  # show progress as it comes, keep it all in the log
            sys.stdout.write(line)
            sink.write(line)
        rc = proc.wait()
        stop.cancel()
    if time.monotonic() - t0 >= seconds_left:
        rc = "timeout"
    result = dict(cmd=" ".join(cmd[1:]), rc=rc, seconds=round(time.monotonic() - t0, 1),
                  log_tail=log.read_text()[-3000:], data={})
    names = step["files"] or sorted(p.name for p in where.glob("*.json"))
    for name in names:
        path = where / name
        if path.exists():
            result["data"][name] = json.loads(path.read_text())
    print(f"[suite] {step['name']}: exit {rc} after {result['seconds']:.0f} s", flush=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for suite.json / .md")
    ap.add_argument("--budget", type=float, default=570.0,
                    help="seconds for the whole suite (default 570: one 10-minute call)")
    ap.add_argument("--peer", action="store_true", help="also the torch.compile peer")
    ap.add_argument("--smoke", action="store_true", help="every step in --smoke (CPU)")
    ap.add_argument("--order", default="", metavar="STEPS",
                    help="the steps to run first, in this order (e.g. engine,kernels: the one "
                         "whose numbers matter most before the budget runs out); the rest follow")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0, env = time.monotonic(), environment()
    suite = {"env": env, "budget_s": args.budget, "smoke": args.smoke, "steps": {}}
    first = [name for name in args.order.split(",") if name]
    for step in sorted(steps(args.smoke, args.peer),
                       key=lambda st: first.index(st["name"]) if st["name"] in first
                       else len(first)):
        left = args.budget - (time.monotonic() - t0)
        if left < step.get("min_s", 30):
            suite["steps"][step["name"]] = dict(rc="skipped", seconds=0, data={},
                                                log_tail=f"skipped: {left:.0f} s of budget left")
            print(f"[suite] {step['name']}: skipped, {left:.0f} s left", flush=True)
            continue
        suite["steps"][step["name"]] = run_step(step, args.out, left, args.smoke)
    suite["seconds"] = round(time.monotonic() - t0, 1)
    suite["metrics"] = metrics(suite)
    (args.out / "suite.json").write_text(json.dumps(suite, indent=1, default=str))
    text = render(suite)
    (args.out / "suite.md").write_text(text)
    print("\n" + text)
    print(f"[suite] wrote {args.out / 'suite.json'} and suite.md in {suite['seconds']:.0f} s")
    return 0 if all(s["rc"] == 0 for s in suite["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
