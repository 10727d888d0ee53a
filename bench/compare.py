"""Compare two runs of bench/suite.py, metric by metric.

    python3 bench/compare.py OLD/suite.json NEW/suite.json [--threshold 3] [--all] [--fail]

Matches the metrics of the two runs by name (kernel times, per-layer decode / prefill times
and their multiples of the floor, whole-model steps, the ceilings each step measured) and
prints a Markdown table of old, new and the change, worse or better by the metric's own
direction (a time lower, a rate higher). By default only the changes beyond --threshold
percent are listed, then the metrics found in one run only. Since the floors move with the
ceilings each run measures, compare the "x floor" rows across machines and the times within
one. --fail exits 1 when a metric got worse beyond the threshold. About a second on any
machine (no GPU, no torch); tests/test_bench_smoke.py runs it on bench/suite.py --smoke's
output.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def load(path: Path) -> tuple[dict, dict]:
    """(env, {key: metric}) of a suite.json, with a clear error for anything else."""
    try:
        suite = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        sys.exit(f"{path}: not a readable suite.json ({exc})")
    if not isinstance(suite, dict) or "metrics" not in suite or "env" not in suite:
        sys.exit(f"{path}: no 'metrics' / 'env': not written by bench/suite.py")
    return suite["env"], {m["key"]: m for m in suite["metrics"]}


def change(old: dict, new: dict) -> tuple[float, str]:
    """(percent change of the value, "worse" / "better" / "") by the metric's direction."""
    a, b = old["value"], new["value"]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (a, b)) or a == 0:
        return float("nan"), ""
    pct = 100 * (b - a) / abs(a)
    if pct == 0:
        return pct, ""
    worse = pct > 0 if new.get("better", "lower") == "lower" else pct < 0
    return pct, "worse" if worse else "better"


def compare(old: dict, new: dict, threshold: float, show_all: bool) -> tuple[list[str], int]:
    rows, worse = [], 0
    for key in [k for k in new if k in old]:
        pct, verdict = change(old[key], new[key])
        beyond = math.isfinite(pct) and abs(pct) > threshold
        worse += bool(beyond and verdict == "worse")
        if show_all or beyond:
            mark = f"**{verdict}**" if beyond else verdict
            rows.append(f"| {key} | {old[key]['value']:.4g} | {new[key]['value']:.4g} | "
                        f"{new[key]['unit']} | {pct:+.1f}% | {mark} |")
    lines = ["| metric | old | new | unit | change | |", "| --- | ---: | ---: | --- | ---: | --- |"]
    lines += rows or ["| (no change beyond the threshold) | | | | | |"]
    only_old = sorted(set(old) - set(new))
    only_new = sorted(set(new) - set(old))
    if only_old:
        lines += ["", "Only in the old run: " + ", ".join(only_old)]
    if only_new:
        lines += ["", "Only in the new run: " + ", ".join(only_new)]
    return lines, worse


def describe(env: dict) -> str:
    v = env.get("versions", {})
    return (f"{env.get('date')}, commit {env.get('commit')}, {env.get('machine')}, "
            f"torch {v.get('torch')}, Triton {v.get('triton')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--threshold", type=float, default=3.0,
                    help="percent change below which a metric counts as unchanged (default 3)")
    ap.add_argument("--all", action="store_true", help="list every common metric")
    ap.add_argument("--fail", action="store_true", help="exit 1 if a metric got worse")
    args = ap.parse_args(argv)
    (old_env, old), (new_env, new) = load(args.old), load(args.new)
    print(f"old: {describe(old_env)}\nnew: {describe(new_env)}\n")
    lines, worse = compare(old, new, args.threshold, args.all)
    print("\n".join(lines))
    print(f"\n{worse} metric(s) worse by more than {args.threshold:g}%")
    return 1 if (args.fail and worse) else 0


if __name__ == "__main__":
    sys.exit(main())
