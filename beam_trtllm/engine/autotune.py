"""The device search for an engine's Triton launch shapes (docs/ENGINE.md "Kernel autotuning").

`engine_problems(cfg, layer_plan, options, kv_dtype)` lists the distinct GEMM, MoE and
decode-attention problems the engine will run (its layer formats and shapes, at its CUDA-graph
decode batch sizes and its prefill chunk), bucketed as `plugins/tuning.py` looks them up.
`search(problems, ...)` then, per problem: runs the launcher's default on random inputs of the
right layout (autotune_cases.py), times it, and times each candidate launch shape; a candidate
that does not fit the GPU (Triton's OutOfResources) or does not compile is skipped, one whose output differs from
the default's by more than FP32 summation order can explain (`AGREEMENT`) is rejected, and the
fastest remaining one is kept if it beats the default by `MIN_GAIN`. The result is a table for
`plugins.tuning.install` plus a report of default vs chosen times, one progress line per
problem. The whole search stops starting new measurements after `budget_s`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import BeamConfig
from .autotune_cases import CASES, Problem  # noqa: F401  (Problem: part of this API)
from .types import EngineError

MODES = ("auto", "quick", "off")
BUDGET_S = {"auto": 75.0, "quick": 25.0}
MIN_GAIN = 0.03  # a candidate must be this much faster than the default (timer noise)

# Agreement of a candidate's output with the default's on the same inputs: (atol as a fraction
# of the default output's RMS, rtol, largest relative L2 norm of the difference). A launch
# shape only changes the order of FP32 sums (and, for FP8 MMAs, where partial sums are promoted
# to FP32), so outputs differ by rounding flips on scattered elements; a wrong shape (a lost
# K tile, a row written twice) moves whole rows or columns by O(RMS) or the L2 norm by >= 5%.
AGREEMENT = {
    # BF16 outputs of FP32 sums (W4A16 GEMMs, their MoE): a reordering flips a few elements
    # by one BF16 ULP (2^-8..2^-7 relative), and intermediate roundings carry a little further.
    "gemm": (2**-6, 2**-6, 2**-7),
    # FP8 MMAs promote partial sums every BLOCK_K: another BLOCK_K moves outputs by ~2^-7 RMS
    # (Hopper accumulates FP8 products with ~14 bits; tests/conftest.py "linear-fp8-mma").
    "gemm-fp8": (2**-4, 2**-5, 2**-6),
    # ... and moe_fp8 quantizes h to FP8: a few percent of h's codes move one E4M3 step (1/16
    # to 1/8 of the element), which the down projection spreads over every output.
    "moe-fp8": (2**-3, 2**-4, 2**-5),
    # Split-KV attention: another split or tile rescales the BF16-rounded probabilities
    # against another running max; outputs differ by ~2^-9 RMS plus one output ULP.
    "attention": (2**-6, 2**-6, 2**-7),
}


@dataclass
class Measurement:
    config: object
    us: float | None = None
    status: str = "ok"  # ok | mismatch: ... | out of resources | budget


class Search:
    """Per-search state: the deadline and the timer."""

    def __init__(self, budget_s: float, timer, progress):
        self.deadline = time.monotonic() + budget_s
        self.timer, self.progress = timer, progress

    def left(self) -> float:
        return self.deadline - time.monotonic()


# ---------------------------------------------------------------------------- selection
def select(measured: list[Measurement], min_gain: float = MIN_GAIN) -> Measurement:
    """The default (measured[0]) unless a candidate that ran and agreed is faster by min_gain."""
    default = measured[0]
    ok = [m for m in measured[1:] if m.status == "ok" and m.us is not None]
    best = min(ok, key=lambda m: m.us, default=None)
    if best is None or default.us is None or best.us > default.us * (1 - min_gain):
        return default
    return best


def disagreement(out: torch.Tensor, ref: torch.Tensor, rule: str) -> str | None:
    """None if `out` equals `ref` up to what summation order explains (AGREEMENT), else why."""
    atol_rms, rtol, l2 = AGREEMENT[rule]
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"output {tuple(out.shape)} {out.dtype}, default {tuple(ref.shape)} {ref.dtype}"
    o, r = out.float(), ref.float()
    finite = torch.isfinite(r)
    if not bool(torch.isfinite(o)[finite].all()):
        return "non-finite outputs where the default's are finite"
    o, r = o[finite], r[finite]
    rms = float(r.pow(2).mean().sqrt()) if r.numel() else 0.0
    diff = (o - r).abs()
    bad = diff > atol_rms * rms + rtol * r.abs()
    if bool(bad.any()):
        return (f"{int(bad.sum())} of {r.numel()} outputs differ (max |diff| "
                f"{float(diff.max()):.3g}, output RMS {rms:.3g})")
    ratio = float(diff.norm() / r.norm()) if float(r.norm()) > 0 else float(diff.norm())
    if ratio > l2:
        return f"relative L2 difference {ratio:.2e} > {l2:.2e}"
    return None


def _measure(run, config, ref, rule: str, s: Search) -> tuple[Measurement, torch.Tensor | None]:
    import triton

    try:
        out = run(config)  # compiles on first use; OutOfResources is raised here
        if ref is not None:
            why = disagreement(out, ref, rule)
            if why is not None:
                return Measurement(config, status=f"mismatch: {why}"), None
        return Measurement(config, s.timer(lambda: run(config), config)), out
    except triton.runtime.errors.OutOfResources as exc:
        return Measurement(config, status=f"out of resources ({exc})"), None
    except (triton.compiler.errors.CompilationError, triton.runtime.errors.PTXASError) as exc:
        if config is None:  # the launcher's own shape must compile: that is a bug, not a skip
            raise
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        return Measurement(config, status=f"does not compile ({first[:200]})"), None


# ---------------------------------------------------------------------------- the search
def tune_problem(problem: Problem, data, mode: str, s: Search) -> dict:
    """Time the default and the candidates of one problem -> its report row (with "entry":
    the chosen config, None for the default)."""
    case = CASES[problem.family]
    run = case.runner(data, problem.params, problem.params["size"])
    seen: dict[str, Measurement] = {}
    default, ref = _measure(run, None, None, case.rule, s)
    seen[repr(None)] = default
    best = default
    stages = case.stages(problem.params, mode) if default.status == "ok" else []
    for stage in stages:  # nothing to check candidates against if the default did not run
        measured = []
        for config in stage(best.config):
            if repr(config) not in seen:
                seen[repr(config)] = (Measurement(config, status="budget") if s.left() <= 0
                                      else _measure(run, config, ref, case.rule, s)[0])
            measured.append(seen[repr(config)])
        best = select([default] + [m for m in measured if m is not default])
    rejected = [m.status for m in seen.values() if m.status not in ("ok", "budget")]
    return {"problem": problem.label, "key": list(problem.key), "default_us": default.us,
            "chosen_us": best.us, "entry": best.config, "tried": len(seen),
            "skipped": sum(m.status == "budget" for m in seen.values()), "rejected": rejected}


def search(problems: list[Problem], mode: str = "auto", device: torch.device | str = "cuda",
           timer: Callable | None = None, progress: Callable[[str], None] = print,
           budget_s: float | None = None, seed: int = 0) -> dict:
    """Tune `problems` on `device` -> {"entries": {key: config}, "report": [rows],
    "search_s": seconds}. `timer(fn, config) -> µs` (default: `graph_timer`'s device times
    on a GPU, wall clock in Triton's interpreter)."""
    from plugins import tuning

    if mode not in ("auto", "quick"):
        raise EngineError(f"autotune mode must be auto or quick to search, got {mode!r}")
    device = torch.device(device)
    _check_backend(device)
    s = Search(BUDGET_S[mode] if budget_s is None else budget_s,
               timer or default_timer(device, mode), progress)
    start = time.monotonic()
    order = sorted(range(len(problems)), key=lambda i: (-problems[i].uses, problems[i].group,
                                                        problems[i].params["size"]))
    rows, entries, data, data_group = [], {}, None, None
    with tuning.suspended(), torch.inference_mode():
        for n, i in enumerate(order, start=1):
            p = problems[i]
            if s.left() <= 0:
                rows.append({"problem": p.label, "key": list(p.key), "default_us": None,
                             "chosen_us": None, "entry": None, "skipped": "search budget spent"})
                progress(f"[{n}/{len(order)}] {p.label}: skipped (search budget spent: defaults)")
                continue
            if data_group != p.group:
                data = None  # free the previous group's tensors first
                gen = torch.Generator(device).manual_seed(seed)
                sizes = [q.params["size"] for q in problems if q.group == p.group]
                data, data_group = CASES[p.family].make(p.params, max(sizes), device, gen), p.group
            row = tune_problem(p, data, mode, s)
            rows.append(row)
            if row["entry"] is not None:
                entries[p.key] = row["entry"]
            progress(f"[{n}/{len(order)}] {_summary(row)}")
    del data
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the random weights' memory goes back before the engine loads
    return {"entries": entries, "report": [_json_row(r) for r in rows],
            "search_s": round(time.monotonic() - start, 1)}


def _summary(row: dict) -> str:
    if row["default_us"] is None:
        return f"{row['problem']}: default failed to run"
    chosen = "default kept" if row["entry"] is None else \
        f"{row['chosen_us']:.1f} us with {_describe(row['entry'])}"
    notes = [f"{len(row['rejected'])} rejected"] if row["rejected"] else []
    notes += [f"{row['skipped']} skipped (budget)"] if row["skipped"] else []
    return (f"{row['problem']}: default {row['default_us']:.1f} us, {chosen} "
            f"({row['tried']} tried{', ' if notes else ''}{', '.join(notes)})")


def _describe(config) -> str:
    from plugins.tuning import config_to_json

    return "default" if config is None else str(config_to_json(config))


def _json_row(row: dict) -> dict:
    from plugins.tuning import config_to_json

    out = dict(row)
    out["entry"] = config_to_json(row["entry"])
    return out


def _check_backend(device: torch.device) -> None:
    from plugins.registry import backend_for

    if backend_for(device) != "triton":
        raise EngineError(f"the kernel search needs the Triton kernels: a CUDA device, or "
                          f"TRITON_INTERPRET=1 on the CPU (got {device})")


def default_timer(device: torch.device, mode: str):
    if device.type == "cuda":
        return graph_timer(device, replays=15 if mode == "auto" else 7)
    return wall_timer


L2_FLUSH_BYTES = 96 << 20  # more than the H200's L2 (50 MB) and the B200's (126 MB / 2 dies)
GRAPH_REPS = 10  # calls per captured graph


def graph_timer(device: torch.device, replays: int):
    """-> timer(fn, config) giving the device time (µs) of one call of `fn`: GRAPH_REPS calls,
    each behind a write that evicts L2, captured in one CUDA graph and replayed (as the engine
    replays decode steps, with another layer's weights through L2 in between), minus the same
    graph of writes alone. CUDA events around eager calls (triton's do_bench) timed the
    launchers' Python instead: 195 µs for a 13 µs GEMM on the H200 (2026-11-29)."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)

    def capture(body):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_REPS):
                body()
        return graph

    def replay_us(graph) -> float:
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / GRAPH_REPS)
        return sorted(times)[len(times) // 2]

    flush_us = replay_us(capture(flush.zero_))

    def timer(fn, config) -> float:
        fn()  # compile (Triton) and allocate outside the capture
        torch.cuda.synchronize(device)
        graph = capture(lambda: (flush.zero_(), fn()))
        us = replay_us(graph)
        del graph
        return max(us - flush_us, 0.01)
    return timer


def wall_timer(fn, config, repeats: int = 3) -> float:
    """Median wall time (µs) of `repeats` calls: what Triton's interpreter offers."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------------- the problems
def engine_sizes(options) -> tuple[list[int], int]:
    """(decode batch sizes, one representative per tuning bucket: the largest engine size in
    it; the prefill chunk, the step's token budget)."""
    from plugins.tuning import bucket

    sizes = options.cuda_graph_batch_sizes or tuple(1 << i for i in range(options.max_batch.bit_length()))
    reps: dict[int, int] = {}
    for s in sizes:
        reps[bucket(s)] = max(reps.get(bucket(s), 0), s)
    return sorted(reps.values()), options.max_num_tokens


def engine_problems(cfg: BeamConfig, layer_plan: dict, options, kv_dtype: str,
                    device: torch.device | str = "cuda", sm_count: int | None = None
                    ) -> list[Problem]:
    """The distinct problems of this engine's layers at its decode and prefill sizes.
    sm_count (the device's, when it is present): leaves out the GEMMs the engine runs split
    over K there."""
    from plugins._common import sm_count as device_sm_count

    from .autotune_problems import attention_problems, linear_problems, moe_problems

    decode, prefill = engine_sizes(options)
    device = torch.device(device)
    cuda = device.type == "cuda"
    if sm_count is None and cuda and torch.cuda.is_available():
        sm_count = device_sm_count(device)
    return (linear_problems(cfg, layer_plan, decode, prefill, cuda, sm_count)
            + moe_problems(cfg, layer_plan, decode, prefill)
            + attention_problems(cfg, options, kv_dtype, decode))
