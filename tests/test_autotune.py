"""Kernel autotuning without a GPU: the tuned-shape table (plugins/tuning.py) and its hooks'
lookups, the search's selection rules (correctness filter, OutOfResources skip, fastest kept)
on a synthetic problem, the problem list of the Beam-1.0 layers, and what `beam-trt build`
and the engine dir do with tuned tables. The real search runs in test_autotune_kernels.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import triton
from engine_helpers import TINY_OPTS, tiny_engine_dir  # noqa: F401

from beam_trtllm.config import preset
from beam_trtllm.engine.autotune import (AGREEMENT, Measurement, Problem, Search, disagreement,
                                         engine_problems, select, tune_problem)
from beam_trtllm.engine.autotune_cases import CASES, Case
from beam_trtllm.engine.autotune_problems import recipe_plan
from beam_trtllm.engine.build import build_engine, sha256_file
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.engine_dir import read_engine_dir
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.tuned_kernels import TABLE_FORMAT, TUNED_FILE
from beam_trtllm.engine.types import EngineError
from plugins import tuning
from plugins._moe_common import GemmConfig

GEMM = GemmConfig(16, 32, 128, 4, 3, swap=True)
ENTRIES = {
    ("linear_fp8", 8, 14336, 5120): GEMM,
    ("linear_nvfp4", 2048, 40960, 5120, "bfloat16"): GemmConfig(128, 256, 64, 8, 3),
    ("moe_fp8", 64, 256, 2560, 5120): {"w13": None, "w2": GEMM},
    ("moe_nvfp4", 16384, 256, 2560, 5120, "bfloat16"): {"w13": GemmConfig(64, 128, 128, 4, 4),
                                                         "w2": GemmConfig(64, 64, 128, 4, 5)},
    tuning.decode_key(1, 4096, 48, 8, 128, torch.bfloat16, torch.float8_e4m3fn):
        {"BLOCK_N": 64, "BLOCK_N_SHORT": 64, "programs_per_sm_fp8": 4},
}


@pytest.fixture(autouse=True)
def _empty_table():
    tuning.clear()
    yield
    tuning.clear()


def test_table_round_trips_through_json_and_installs():
    doc = json.loads(json.dumps(tuning.to_json(ENTRIES)))
    assert tuning.from_json(doc) == ENTRIES
    assert tuning.install(doc) == len(ENTRIES) and tuning.installed() == ENTRIES
    assert [tuning.bucket(n) for n in (0, 1, 2, 3, 8, 9, 2048)] == [1, 1, 2, 4, 8, 16, 2048]
    tuning.clear()
    assert tuning.installed() == {} and tuning.lookup(("linear_fp8", 8, 14336, 5120)) is None


def test_hooks_look_up_what_the_launchers_run():
    q = torch.empty(1, 48, 128, dtype=torch.bfloat16)
    cache = torch.empty(2, 64, 8, 128, dtype=torch.float8_e4m3fn)
    index = torch.empty(1, 64, dtype=torch.int32)  # 64 blocks of 64: capacity 4096
    # empty table: every hook leaves the launcher's own choice (None / the caller's overrides)
    assert tuning.tuned_linear("linear_fp8", 5, 14336, 5120) is None
    assert tuning.tuned_moe("moe_fp8", 40, 256, 2560, 5120, None, None) == (None, None)
    assert tuning.tuned_decode(q, cache, index) is None
    tuning.install(tuning.to_json(ENTRIES))
    for m in (5, 8):  # one bucket: 5..8 tokens
        assert tuning.tuned_linear("linear_fp8", m, 14336, 5120) == GEMM
    assert tuning.tuned_linear("linear_fp8", 9, 14336, 5120) is None
    assert tuning.tuned_linear("linear_nvfp4", 2000, 40960, 5120, torch.bfloat16).block_n == 256
    assert tuning.tuned_linear("linear_nvfp4", 2000, 40960, 5120, torch.float32) is None
    assert tuning.tuned_moe("moe_fp8", 40, 256, 2560, 5120, None, None) == (None, GEMM)
    mine = GemmConfig(16, 64, 128, 4, 4, swap=True)  # a caller's explicit override wins
    assert tuning.tuned_moe("moe_fp8", 40, 256, 2560, 5120, mine, None) == (mine, None)
    assert tuning.tuned_decode(q, cache, index)["programs_per_sm_fp8"] == 4
    assert tuning.tuned_decode(q, cache.to(torch.bfloat16), index) is None


@pytest.mark.parametrize("entry, reason", [
    ({"key": ["gemm_fp16", 1, 2, 3], "config": {}}, "unknown op family 'gemm_fp16'"),
    ({"key": ["linear_fp8", 1, 64], "config": {}}, "a linear_fp8 key has 4 fields"),
    ({"key": ["linear_fp8", 1, 64, True], "config": {}}, "key fields are names and positive"),
    ({"key": ["linear_fp8", 1, 64, 64], "config": {"block_m": 16, "blockn": 3}}, "GemmConfig has fields"),
    ({"key": ["linear_fp8", 1, 64, 64], "config": {**vars(GEMM), "block_n": 48}},
     "block_n must be a power of two"),
    ({"key": ["moe_fp8", 1, 8, 32, 64], "config": {"w13": vars(GEMM), "w2": {**vars(GEMM), "block_m": 64}}},
     "share one token sort"),
    ({"key": ["moe_fp8", 1, 8, 32, 64],
      "config": {"w13": {**vars(GEMM), "block_m": 128, "tail_m": 64},
                 "w2": {**vars(GEMM), "block_m": 128}}},
     "share one token sort"),
    ({"key": list(next(iter(k for k in ENTRIES if k[0] == "attention_decode"))),
      "config": {"BLOCK_M": 64}}, "unknown attention_decode setting 'BLOCK_M'"),
    ({"key": list(next(iter(k for k in ENTRIES if k[0] == "attention_decode"))),
      "config": {"combine_block_d": 24}}, "combine_block_d must be a power of two"),
])
def test_bad_tables_are_refused_and_install_nothing(entry, reason):
    good = tuning.to_json(ENTRIES)["entries"]
    with pytest.raises(tuning.TuningError, match=f"entry {len(good)}: .*{reason}"):
        tuning.install({"entries": good + [entry]})
    assert tuning.installed() == {}


@pytest.mark.parametrize("tail_m", [24, 8, 128, True])
def test_tail_blocks_must_fit_the_row_blocks(tail_m):
    entry = {"key": ["moe_fp8", 1, 8, 32, 64],
             "config": {"w13": {**vars(GEMM), "block_m": 128, "tail_m": tail_m}, "w2": None}}
    with pytest.raises(tuning.TuningError, match="w13: tail_m must be 0 or a power of two"):
        tuning.install({"entries": [entry]})
    assert tuning.installed() == {}


# ---------------------------------------------------------------------------- selection
def _synthetic_case(outputs: dict) -> Case:
    """A problem whose 'launch shapes' are names: each returns a fixed tensor (or raises the
    OutOfResources a GPU compile raises for a tile that does not fit)."""
    def runner(data, params, size):
        def run(config):
            if config == "oor":
                raise triton.runtime.errors.OutOfResources(300_000, 232_448, "shared memory")
            if config == "ptxas":
                raise triton.runtime.errors.PTXASError("ptxas fatal: too many registers")
            return outputs[config]
        return run
    return Case("synthetic", "gemm", None, runner, lambda params, mode: [
        lambda best: [None, *sorted(k for k in outputs if k), "oor", "ptxas"]])


def test_search_keeps_the_fastest_candidate_that_agrees_and_fits():
    """Fastest of all is a shape that loses a row (rejected by the output check); two do not
    fit or compile (skipped); one within 3 % of the default does not count: the 60 µs one wins."""
    g = torch.Generator().manual_seed(0)
    ref = (torch.randn(64, 512, generator=g) * 3).to(torch.bfloat16)
    reordered = ref.clone()
    reordered.view(-1)[::97] = reordered.view(-1)[::97].float().nextafter(torch.tensor(1e9)).to(torch.bfloat16)
    lost_row = ref.clone()
    lost_row[17] = 0  # a shape that skips a row block: fast and wrong
    outputs = {None: ref, "fast-wrong": lost_row, "ok": reordered, "slow": ref, "barely": ref}
    times = {None: 100.0, "fast-wrong": 10.0, "ok": 60.0, "slow": 200.0, "barely": 99.0}
    s = Search(60.0, lambda fn, config: (fn(), times[config])[1], print)
    problem = Problem("synthetic", ("linear_fp8", 1, 2, 3), "synthetic", {"size": 1})
    case = _synthetic_case(outputs)
    CASES["synthetic"] = case
    try:
        row = tune_problem(problem, None, "auto", s)
    finally:
        del CASES["synthetic"]
    assert row["entry"] == "ok" and row["chosen_us"] == 60.0 and row["default_us"] == 100.0
    assert row["tried"] == 7 and len(row["rejected"]) == 3
    assert any(r.startswith("mismatch") and "outputs differ" in r for r in row["rejected"])
    assert any(r.startswith("out of resources") for r in row["rejected"])
    assert "does not compile (PTXAS error: ptxas fatal: too many registers)" in row["rejected"]


def test_select_needs_a_real_gain_and_a_default():
    d = Measurement(None, 100.0)
    assert select([d, Measurement("a", 98.0)]).config is None  # within timer noise
    assert select([d, Measurement("a", 90.0), Measurement("b", 80.0, "mismatch: x")]).config == "a"
    assert select([d, Measurement("a", None, "out of resources (x)")]) is d


@pytest.mark.parametrize("rule", sorted(AGREEMENT))
def test_agreement_accepts_reordered_sums_and_rejects_a_lost_tile(rule):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(16, 1024, generator=g), torch.randn(256, 1024, generator=g) / 32
    ref = (x @ w.T).to(torch.bfloat16)
    chunks = sum(x[:, c:c + 128] @ w[:, c:c + 128].T for c in reversed(range(0, 1024, 128)))
    assert disagreement(chunks.to(torch.bfloat16), ref, rule) is None
    lost = sum(x[:, c:c + 128] @ w[:, c:c + 128].T for c in range(128, 1024, 128))
    assert disagreement(lost.to(torch.bfloat16), ref, rule) is not None
    one_row = ref.clone()
    one_row[3] = -one_row[3]
    assert disagreement(one_row, ref, rule) is not None


# ---------------------------------------------------------------------------- the problems
def test_problems_of_beam_1_0_cover_its_layers():
    cfg = preset("beam-1.0-501b")
    opts = BuildOptions(target="sm90", max_batch=64, max_num_tokens=2048, max_seq_len=131072,
                        block_size=64, cuda_graph_batch_sizes=(1, 8, 48, 64), kv_dtype="fp8")
    # (64 SMs, given so that a GPU's own count does not change the list: nothing runs split)
    problems = engine_problems(cfg, recipe_plan(cfg, "nvfp4"), opts, "fp8", "cuda", 64)
    keys = {p.key for p in problems}
    assert len(keys) == len(problems)
    # FP8 GEMMs only where the Triton kernel runs (<= 16 tokens; _scaled_mm above): the packed
    # q/k/v/gate projection (2*48*128 + 2*8*128 = 14336 rows) and o_proj
    qkvg, o_proj = (cfg.qkv_gate_size, cfg.hidden_size), (cfg.hidden_size, cfg.q_size)
    assert qkvg == (14336, 5120) and o_proj == (5120, 6144)
    assert {k for k in keys if k[0] == "linear_fp8"} == {
        ("linear_fp8", m, n, k) for m in (1, 8) for n, k in (qkvg, o_proj)}
    # NVFP4 dense layers (the first three): gate/up 2 * 20480 rows, down 20480 channels
    assert {k for k in keys if k[0] == "linear_nvfp4"} == {
        ("linear_nvfp4", m, n, k, "bfloat16") for m in (1, 8, 64, 2048)
        for n, k in ((40960, 5120), (5120, 20480))}
    assert {k[1] for k in keys if k[0] == "moe_nvfp4"} == {8, 64, 512, 16384}
    decode = {(k[1], k[2]) for k in keys if k[0] == "attention_decode"}
    assert decode == {(b, cap) for b in (1, 8, 64) for cap in (131072, 512)}  # 48 -> bucket 64
    assert next(p for p in problems if p.family == "moe_nvfp4").uses == 49
    # on 132 SMs the engine runs o_proj split over K at 1 and 8 tokens (SPLIT_CONFIG's shape,
    # not a tuned one): nothing of its to tune. q/k/v/gate is not split there (its 224 tiles
    # fill the GPU: linear_fp8.decode_split_k), so its shapes stay. On 64 SMs neither splits.
    def fp8_keys(sm_count, plan=recipe_plan(cfg, "nvfp4")):
        return {p.key for p in engine_problems(cfg, plan, opts, "fp8", "cuda", sm_count)
                if p.family == "linear_fp8"}
    assert fp8_keys(132) == {("linear_fp8", m, *qkvg) for m in (1, 8)}
    assert keys - {("linear_fp8", m, *o_proj) for m in (1, 8)} == {
        p.key for p in engine_problems(cfg, recipe_plan(cfg, "nvfp4"), opts, "fp8", "cuda", 132)}
    # a q/k/v/gate of two FP8 segments is not split: its shapes stay
    two = {i: dict(layer, **{"self_attn.qkvg_proj": layer["self_attn.qkvg_proj"][:1] * 2})
           for i, layer in recipe_plan(cfg, "nvfp4").items()}
    assert fp8_keys(132, two) == {("linear_fp8", m, *qkvg) for m in (1, 8)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads a GPU's SM count")
def test_problems_on_a_gpu_follow_its_sm_count():
    from plugins._common import sm_count

    cfg = preset("beam-1.0-501b")
    opts = BuildOptions(target="sm90", max_batch=64, max_num_tokens=2048, max_seq_len=131072,
                        block_size=64, cuda_graph_batch_sizes=(1, 8), kv_dtype="fp8")
    plan = recipe_plan(cfg, "fp8")
    found = [p.key for p in engine_problems(cfg, plan, opts, "fp8", "cuda")]
    sms = sm_count(torch.device("cuda"))
    assert found == [p.key for p in engine_problems(cfg, plan, opts, "fp8", "cuda", sms)]


# ---------------------------------------------------------------------------- engine dirs
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the sm90 build tunes")
def test_gpu_target_built_without_gpu_leaves_tuning_to_first_load(tiny_dir, tmp_path, capsys):
    lines = []
    out = build_engine(tiny_dir, tmp_path / "e", BuildOptions(**TINY_OPTS, target="sm90"),
                       progress=lines.append)
    spec = json.loads((out / "engine.json").read_text())
    tune = spec["kernels"]["autotune"]
    assert tune["status"].startswith("left to first load: no GPU on the build machine")
    assert spec["options"]["autotune"] == "auto" and not (out / TUNED_FILE).exists()
    assert any(line.startswith("kernels: left to first load") for line in lines)
    off = build_engine(tiny_dir, tmp_path / "off", BuildOptions(**TINY_OPTS, target="sm90",
                                                               autotune="off"))
    assert json.loads((off / "engine.json").read_text())["kernels"]["autotune"]["status"].startswith("off")
    with pytest.raises(EngineError, match="--autotune must be auto, quick or off"):
        BuildOptions(autotune="always")


def _add_table(engine_dir, entries=ENTRIES, device=None) -> None:
    doc = {"format": TABLE_FORMAT, "version": 1, **tuning.to_json(entries),
           "device": device or {"name": "NVIDIA H200", "capability": "sm90"}}
    (engine_dir / TUNED_FILE).write_text(json.dumps(doc))
    spec = json.loads((engine_dir / "engine.json").read_text())
    spec["files"][TUNED_FILE] = {"bytes": (engine_dir / TUNED_FILE).stat().st_size,
                                 "sha256": sha256_file(engine_dir / TUNED_FILE)}
    (engine_dir / "engine.json").write_text(json.dumps(spec))


def test_engine_dir_verifies_its_tuned_table(tiny_engine_dir, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, copy)
    _add_table(copy)
    assert tuning.from_json(read_engine_dir(copy).tuned) == ENTRIES
    data = bytearray((copy / TUNED_FILE).read_bytes())
    data[40] ^= 0x01
    (copy / TUNED_FILE).write_bytes(bytes(data))
    with pytest.raises(EngineError, match=f"{TUNED_FILE} does not match its SHA-256"):
        Engine.from_dir(copy, device="cpu")
    bad = {**ENTRIES, ("linear_fp8", 3, 64, 64): GemmConfig(16, 48, 128, 4, 3)}  # hash updated
    _add_table(copy, bad)
    with pytest.raises(EngineError, match=f"{TUNED_FILE}: tuned-kernel table entry .* block_n must"):
        Engine.from_dir(copy, device="cpu")
    (copy / TUNED_FILE).unlink()
    with pytest.raises(EngineError, match=f"{TUNED_FILE} is missing"):
        Engine.from_dir(copy, device="cpu")
