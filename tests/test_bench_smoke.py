"""Every benchmark in bench/ still runs: each file that is not a helper (helpers start with
"_") answers --help with what it measures, and runs in --smoke mode on the CPU (Triton's
interpreter where kernels are involved, tiny shapes) as the GPU run would, through the same
code. bench/suite.py --smoke runs kernels_bench.py, kernels_fp8_channel.py and engine_bench.py
(and its --peer) the way the H200 run does; bench/compare.py then reads its suite.json.

The commands run as subprocesses, three at a time, started once for the module; the --help
of every benchmark runs in one of them (runpy, one import of torch for all)."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
BENCHMARKS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))
# --smoke runs not already made by the suite, trimmed to what keeps the file near a minute
SMOKE = {
    # the suite's kernels_bench.py step runs moe_fp8 / moe_nvfp4 and the linear rows
    "kernels_moe.py": ["--smoke", "--formats", "fp8_block,bf16", "--tokens", "1", "--no-linear",
                       "--sweep", "fp8:1"],
    "kernels_sweep.py": ["--smoke", "--only", "router"],
    "decode_sweep.py": ["--smoke", "--only", "norm1"],
    "decode_fp8kv.py": ["--smoke"],
    "autotune_bench.py": ["--smoke", "--formats", "fp8", "--mode", "quick", "--budget", "2"],
    "convert_bench.py": ["--smoke", "--recipes", "fp8-block"],
    "engine_gpu_check.py": ["--smoke"],
    "engine_bench_parallel.py": ["--smoke", "--layouts", "tp1,ep2"],
    "host_overhead.py": ["--smoke"],
    "grammar_bench.py": ["--smoke", "--bench-model", "bf16", "--batch", "1", "2", "--tokens", "4",
                         "--repeats", "1"],  # the tiny path: test_grammar_engine, the demo
    "long_context.py": ["--smoke"],
    "serve_bench.py": ["--smoke"],
    "agreement.py": ["--smoke"],
    "quant_quality.py": ["--smoke"],
    "spec_bench.py": ["--smoke", "--batch-invariant"],
}
INTERPRETED = {"kernels_moe.py", "kernels_sweep.py", "decode_sweep.py", "autotune_bench.py",
               "decode_fp8kv.py"}
IN_SUITE = {"suite.py", "kernels_bench.py", "kernels_fp8_channel.py", "engine_bench.py",
            "compare.py"}
# Help text must say what a benchmark measures against which ceiling and how long it takes.
HELP_WORDS = ("ceiling", "floor", "against")


def _env(interpret: bool) -> dict:
    """Triton's interpreter for the kernel benchmarks; the engine's and converter's run the
    ops' torch references on the CPU, as the engine does there."""
    paths = [str(ROOT), str(BENCH)] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    env = dict(os.environ, PYTHONPATH=":".join(paths), PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    return env | ({"TRITON_INTERPRET": "1"} if interpret else {})


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    interpret = Path(args[0]).name in INTERPRETED
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(interpret),
                          capture_output=True, text=True, timeout=timeout)


# `python3 bench/X.py --help` for every X in one process: each file run as __main__ (as the
# command line runs it) with its output and exit status captured.
HELP_DRIVER = """
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    buf, rc = io.StringIO(), None
    sys.argv = [path, "--help"]
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            rc = exc.code or 0
        except Exception as exc:  # report it as this file's failure, go on with the next
            rc, _ = 1, buf.write(f"{type(exc).__name__}: {exc}")
    out[path] = {"rc": 0 if rc is None else rc, "text": buf.getvalue()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every command of this file, started together (three at a time); name -> result."""
    out = tmp_path_factory.mktemp("bench")
    jobs = {f"smoke {name}": [str(BENCH / name), *args] for name, args in SMOKE.items()
            if (BENCH / name).exists()}
    jobs["suite"] = [str(BENCH / "suite.py"), "--smoke", "--peer", "--out", str(out / "suite")]
    jobs["help"] = ["-c", HELP_DRIVER, *(str(BENCH / name) for name in BENCHMARKS)]
    first = ["suite", "smoke convert_bench.py"]  # the longest
    order = first + sorted(set(jobs) - set(first))
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(_run, jobs[name]) for name in order if name in jobs}
        results = {name: f.result() for name, f in futures.items()}
    _ok(results["help"])
    helps = json.loads(results["help"].stdout.strip().splitlines()[-1])
    results |= {f"help {Path(p).name}": h for p, h in helps.items()}
    results["suite_dir"] = out / "suite"
    return results


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-3000:]}"


def test_no_bench_module_shadows_an_installed_module():
    """bench/ is sys.path[0] when a benchmark runs, so a bench/NAME.py hides an installed NAME:
    bench/kernels.py hid Hugging Face's `kernels`, which transformers 5.25 imports."""
    outside = [p for p in sys.path if p and Path(p).resolve() != BENCH]
    stems = sorted(p.stem for p in BENCH.glob("*.py"))
    shadowed = {s: spec.origin for s in stems
                if (spec := importlib.machinery.PathFinder.find_spec(s, outside)) is not None}
    assert not shadowed, f"bench/ modules named like installed ones: {shadowed}"


@pytest.mark.slow
@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_answers_help_with_what_it_measures(runs, name):
    result = runs[f"help {name}"]
    assert result["rc"] == 0, f"{name} --help: exit {result['rc']}\n{result['text'][-3000:]}"
    text = result["text"].lower()
    assert "usage:" in text, text
    assert any(w in text for w in HELP_WORDS), f"{name} --help names no ceiling:\n{text}"
    assert "about" in text and ("minute" in text or " s " in text or "second" in text), \
        f"{name} --help does not say how long it takes:\n{text}"
    assert name == "compare.py" or "--smoke" in text, f"{name} has no --smoke mode"


@pytest.mark.slow
@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_runs_in_smoke_mode(runs, name):
    assert name in SMOKE or name in IN_SUITE, f"{name}: no --smoke run in this file"
    if name in SMOKE:
        _ok(runs[f"smoke {name}"])


@pytest.mark.slow
def test_suite_writes_one_json_and_one_table_and_compare_reads_them(runs, tmp_path):
    _ok(runs["suite"])
    where = runs["suite_dir"]
    suite = json.loads((where / "suite.json").read_text())
    assert suite["env"]["commit"] and suite["env"]["versions"]["torch"]
    expected = {"kernels", "engine", "peer"} | (
        {"fp8_channel"} if (BENCH / "kernels_fp8_channel.py").exists() else set())
    assert set(suite["steps"]) == expected and all(s["rc"] == 0 for s in suite["steps"].values())
    keys = {m["key"] for m in suite["metrics"]}
    for part in ("kernels/ceiling/copy_GBps", "kernels/moe_fp8 T=1 x floor",
                 "engine/fp8 layer 1 sliding MoE decode x floor",
                 "engine/fp8 layer 3 full MoE prefill x floor",
                 "engine/fp8 whole model batch 1 ms/step", "peer/peer ms per MoE layer"):
        assert part in keys, f"{part} missing from suite.json's metrics"
    table = (where / "suite.md").read_text()
    assert "Ceilings measured" in table and "whole-model decode" in table
    # compare: a run against itself changes nothing; a slower copy of it is flagged worse
    same = _run([str(BENCH / "compare.py"), str(where / "suite.json"), str(where / "suite.json"),
                 "--fail"], timeout=60)
    _ok(same)
    assert "0 metric(s) worse" in same.stdout
    slower = dict(suite, metrics=[dict(m, value=m["value"] * (1.5 if m["better"] == "lower"
                                                              else 1.0))
                                  for m in suite["metrics"]])
    (tmp_path / "slower.json").write_text(json.dumps(slower))
    worse = _run([str(BENCH / "compare.py"), str(where / "suite.json"),
                  str(tmp_path / "slower.json"), "--fail"], timeout=60)
    assert worse.returncode == 1 and "**worse**" in worse.stdout, worse.stdout[-2000:]
    bad = _run([str(BENCH / "compare.py"), str(where / "suite.md"), str(where / "suite.json")],
               timeout=60)
    assert bad.returncode != 0 and "suite.md" in bad.stderr
