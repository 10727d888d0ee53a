"""The kernel search and the launchers' tuning hooks through the real Triton kernels (GPU, or
the CPU in Triton's interpreter: `TRITON_INTERPRET=1 pytest -m kernel tests/test_autotune_kernels.py`).

What a launcher ran is read off its kernel launches (the interpreter's launch entry point is
wrapped to record each launch's meta-parameters; the kernel still runs)."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch
from engine_helpers import TINY_OPTS

from beam_trtllm.engine.autotune import Problem, search
from beam_trtllm.engine.autotune_cases import CASES, decode_setting
from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine_dir import read_engine_dir
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.tuned_kernels import LOCAL_FILE, TUNED_FILE, load_autotune
from plugins import moe_nvfp4, tuning
from plugins._attention_decode import DECODE_CONFIG
from plugins._moe_common import GemmConfig
from plugins._tiles import linear_config

pytestmark = pytest.mark.kernel
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _empty_table():
    tuning.clear()
    yield
    tuning.clear()


@contextlib.contextmanager
def launches():
    """Yields a list that collects (kernel name, meta-parameters) of each interpreted launch."""
    from triton.runtime.interpreter import InterpretedFunction

    original, seen = InterpretedFunction.run, []

    def run(self, *args, **kwargs):
        seen.append((self.fn.__name__, kwargs))
        return original(self, *args, **kwargs)

    InterpretedFunction.run = run
    try:
        yield seen
    finally:
        InterpretedFunction.run = original


def _meta(seen, kernel: str) -> list[dict]:
    return [kw for name, kw in seen if name == kernel]


@pytest.mark.skipif(DEV == "cuda", reason="reads launches off Triton's interpreter")
def test_search_picks_a_checked_shape_and_the_launcher_runs_it():
    """The real search on one tiny linear_fp8 problem: every candidate runs and is checked
    against the default; the (deterministic) timer makes block_n=32 the fastest, so the table
    holds it, and once installed `beam::linear_fp8` launches with it (and without, the default)."""
    problem = Problem("linear_fp8", ("linear_fp8", 4, 96, 256), "linear_fp8 m=3 N=96 K=256",
                      {"n": 96, "k": 256, "size": 3})
    default = linear_config(3, 1)
    want = dataclasses.replace(default, block_n=32)  # among the first (quick) alternatives
    assert default.block_n != 32
    timed = []

    def timer(fn, config):
        fn()
        timed.append(config)
        return 10.0 if config == want else 100.0

    lines = []
    result = search([problem], "quick", "cpu", timer=timer, progress=lines.append)
    assert result["entries"] == {problem.key: want} and len(timed) == 4
    row = result["report"][0]
    assert row["default_us"] == 100.0 and row["chosen_us"] == 10.0 and row["rejected"] == []
    assert lines[0].startswith("[1/1] linear_fp8 m=3 N=96 K=256: default 100.0 us, 10.0 us with")
    tuning.install(json.loads(json.dumps({"entries": tuning.to_json(result["entries"])["entries"]})))
    data = CASES["linear_fp8"].make(problem.params, 3, torch.device("cpu"), torch.Generator())
    args = (data["x"][:3], data["w"], data["ws"], data["xs"])
    with launches() as seen:
        tuned = torch.ops.beam.linear_fp8(*args)
    assert [kw["BLOCK_N"] for kw in _meta(seen, "_linear_fp8_kernel")] == [32]
    tuning.clear()
    with launches() as seen:
        untuned = torch.ops.beam.linear_fp8(*args)
    assert [kw["BLOCK_N"] for kw in _meta(seen, "_linear_fp8_kernel")] == [default.block_n]
    assert tuned.shape == untuned.shape == (3, 96)


@pytest.mark.skipif(DEV == "cuda", reason="reads launches off Triton's interpreter")
def test_moe_and_decode_launches_take_installed_shapes():
    gen = torch.Generator().manual_seed(0)
    moe = {"experts": 4, "inner": 32, "hidden": 64, "top_k": 2, "size": 6}
    d = CASES["moe_nvfp4"].make(moe, 6, torch.device("cpu"), gen)
    w2 = GemmConfig(16, 32, 64, 4, 2, swap=True)
    attn = {"hq": 4, "hkv": 2, "d": 32, "capacity": 64, "block_size": 8, "window": 0,
            "kv_dtype": "bfloat16", "size": 2}
    a = CASES["attention_decode"].make(attn, 2, torch.device("cpu"), gen)
    stages = decode_setting("num_stages", 64)  # the setting the launcher reads at capacity 64
    cu = torch.arange(3, dtype=torch.int32)
    tuning.install(tuning.to_json({
        ("moe_nvfp4", 8, 4, 32, 64, "bfloat16"): {"w13": None, "w2": w2},
        tuning.decode_key(2, 64, 4, 2, 32, torch.bfloat16, torch.bfloat16): {stages: 4, "splits": 3}}))

    def run():
        with launches() as seen:
            torch.ops.beam.moe_nvfp4(d["x"][:3], d["ids"][:3], d["weights"][:3], *d["w"])
            torch.ops.beam.attention(a["q"], a["k_new"], a["v_new"], a["gate"], a["k_cache"],
                                     a["v_cache"], cu, a["q_start"], a["hist_start"],
                                     a["cache_index"], 0, a["scale"], a["scale"])
        gemms = [(kw["BLOCK_N"], kw["BLOCK_K"], kw["num_stages"]) for kw in _meta(seen, "_moe_nvfp4_kernel")]
        split = [(kw["NUM_SPLITS"], kw["num_stages"]) for kw in _meta(seen, "_decode_split_kernel")]
        return gemms, split

    d13 = d2 = moe_nvfp4.DECODE  # 6 pairs: direct, moe_nvfp4's own decode shape
    assert run() == ([(d13.block_n, d13.block_k, d13.num_stages), (32, 64, 2)],
                     [(3, 4)])  # gate/up default, down tuned; decode tuned
    tuning.clear()
    gemms, split = run()
    assert gemms == [(c.block_n, c.block_k, c.num_stages) for c in (d13, d2)]
    assert split[0][1] == DECODE_CONFIG[stages] != 4  # the default tables


@pytest.mark.skipif(DEV == "cuda", reason="builds without a GPU")
def test_first_load_tunes_caches_and_refuses_a_foreign_table(tiny_dir, tmp_path):
    opts = BuildOptions(**{**TINY_OPTS, "max_batch": 1, "target": "sm90"})
    engine_dir = build_engine(tiny_dir, tmp_path / "e", opts)
    lines = []
    spec = read_engine_dir(engine_dir)
    done = load_autotune(spec, torch.device("cpu"), "quick", lines.append)
    assert "kernels: tuning for Triton interpreter (cpu) now (left to first load)" in lines[0]
    assert sum(line.startswith("[") for line in lines) == 2  # decode B=1: full, sliding
    assert done.endswith(f"cached in {engine_dir / LOCAL_FILE}")
    cached = json.loads((engine_dir / LOCAL_FILE).read_text())
    assert len(cached["report"]) == 2 and cached["device"]["capability"] == "cpu"
    installed = tuning.installed()
    tuning.clear()
    lines.clear()
    assert load_autotune(spec, torch.device("cpu"), "quick", lines.append).startswith(
        f"kernels: {len(installed)} tuned launch shapes installed from {engine_dir / LOCAL_FILE}")
    assert tuning.installed() == installed and len(lines) == 1
    # a build-time table of another GPU: refused with a line, then this GPU's cache is used
    foreign = {"format": "beam-trt-tuned-kernels", "version": 1, "entries": [],
               "device": {"name": "NVIDIA H100 80GB HBM3", "capability": "sm90"}}
    spec = spec.__class__(**{**spec.__dict__, "tuned": foreign})
    lines.clear()
    load_autotune(spec, torch.device("cpu"), "off", lines.append)
    assert lines == [f"kernels: {TUNED_FILE} was tuned on NVIDIA H100 80GB HBM3 (sm90), this is "
                     "Triton interpreter (cpu): refused, its shapes are not installed",
                     "kernels: launcher defaults (autotune off)"]


@pytest.mark.skipif(DEV != "cuda", reason="times CUDA launches")
def test_search_on_the_gpu_keeps_shapes_that_agree():
    """The real search with CUDA-event timing on a decode GEMM and a decode attention of Beam
    widths: every candidate either fits and agrees with the default or is out of resources,
    and the installed table runs through the public ops."""
    from beam_trtllm.engine.autotune import disagreement

    problems = [
        Problem("linear_fp8", ("linear_fp8", 1, 14336, 5120), "qkv+gate m=1",
                {"n": 14336, "k": 5120, "size": 1}),
        Problem("attention_decode", tuning.decode_key(8, 512, 48, 8, 128, torch.bfloat16, torch.bfloat16),
                "sliding B=8", {"hq": 48, "hkv": 8, "d": 128, "capacity": 512, "block_size": 512,
                                "window": 512, "kv_dtype": "bfloat16", "size": 8}),
    ]
    result = search(problems, "quick", "cuda", budget_s=60, progress=print)
    for row in result["report"]:
        assert row["default_us"] > 0 and row["chosen_us"] <= row["default_us"]
        assert all(r.startswith(("out of resources", "does not compile")) for r in row["rejected"]), \
            row["rejected"]
    tuning.install(tuning.to_json(result["entries"]))
    data = CASES["linear_fp8"].make(problems[0].params, 1, torch.device("cuda"), torch.Generator("cuda"))
    tuned = torch.ops.beam.linear_fp8(data["x"][:1], data["w"], data["ws"], data["xs"])
    tuning.clear()
    untuned = torch.ops.beam.linear_fp8(data["x"][:1], data["w"], data["ws"], data["xs"])
    assert disagreement(tuned, untuned, "gemm-fp8") is None
