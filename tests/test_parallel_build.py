"""Parallel engine dirs: layouts refused naming the field, the converter's rank files (of the
same layout: built; of another: refused), per-rank KV plans and `beam-trt info`, loading
refused outside a launch, and a world of one rank in this process (gloo) against the
single-rank engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from beam_trtllm.config import PRESETS
from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.parallel import ParallelMapping
from beam_trtllm.engine.parallel.launch import free_port, generate
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.types import EngineError
from engine_helpers import TINY_OPTS, greedy, one_thread, prompts  # noqa: F401  (fixture)

TINY = PRESETS["tiny"]


def _spec(engine_dir) -> dict:
    return json.loads((engine_dir / "engine.json").read_text())


@pytest.mark.parametrize("cfg, tp, ep, message", [
    (TINY, 3, 1, r"--tp 3 does not divide num_attention_heads \(4\)"),
    (TINY, 2, 4, r"--ep 4 must divide --tp 2"),
    (TINY.replace(num_experts=6, n_group=3), 4, 4, r"--ep 4 does not divide num_experts \(6\)"),
    (TINY.replace(num_attention_heads=12, num_key_value_heads=4), 3, 1,
     r"--tp 3: num_key_value_heads \(4\) can be neither split evenly nor replicated"),
    (TINY.replace(moe_intermediate_size=30), 4, 1,
     r"moe_tp 4 does not divide moe_intermediate_size"),
])
def test_a_layout_the_shapes_cannot_take_is_refused_naming_the_field(cfg, tp, ep, message):
    with pytest.raises(EngineError, match=message):
        ParallelMapping(tp, ep).check(cfg)


def test_build_refuses_a_bad_layout_before_writing(tiny_dir, tmp_path):
    with pytest.raises(EngineError, match=r"--tp 3 does not divide num_attention_heads"):
        build_engine(tiny_dir, tmp_path / "e", BuildOptions(**TINY_OPTS),
                     parallel=ParallelMapping(3, 1))
    assert not (tmp_path / "e").exists()


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_dir, tmp_path_factory):
    """The tiny Beam converted with the fp8 recipe twice: hf format and --format trtllm
    --tp 2 --ep 2 rank files (same calibration, so the same tensors)."""
    from convert.pipeline import ConvertOptions, convert

    out = tmp_path_factory.mktemp("fp8")
    calib = dict(calib_samples=2, calib_seq_len=16, workers=1)
    convert(tiny_dir, out / "hf", ConvertOptions("fp8", **calib))
    convert(tiny_dir, out / "ranks", ConvertOptions("fp8", fmt="trtllm", tp=2, ep=2, **calib))
    return out / "hf", out / "ranks"


def test_rank_files_of_the_layout_build_the_same_rank_dirs(fp8_checkpoints, tmp_path):
    hf, ranks = fp8_checkpoints
    layout = ParallelMapping(2, 2)
    from_hf = build_engine(hf, tmp_path / "hf", BuildOptions(**TINY_OPTS), parallel=layout)
    from_ranks = build_engine(ranks, tmp_path / "ranks", BuildOptions(**TINY_OPTS), parallel=layout)
    from safetensors.torch import load_file

    for r in range(2):
        a, b = (_spec(d / f"rank{r}") for d in (from_hf, from_ranks))
        assert a["parallel"] == b["parallel"] == layout.at(r).to_json()
        assert a["quantization"]["layers"] == b["quantization"]["layers"]
        for name in sorted(n for n in a["files"] if n.startswith("weights-")):
            x, y = (load_file(d / f"rank{r}" / name) for d in (from_hf, from_ranks))
            assert sorted(x) == sorted(y)
            for key in x:  # bit for bit (FP8 codes compared as bytes)
                assert torch.equal(x[key].view(torch.uint8) if x[key].dtype == torch.float8_e4m3fn
                                   else x[key], y[key].view(torch.uint8)
                                   if y[key].dtype == torch.float8_e4m3fn else y[key]), key


@pytest.mark.parametrize("tp, ep, field", [(2, 1, "mapping.moe_ep_size is 2"),
                                           (4, 2, "mapping.tp_size is 2")])
def test_rank_files_of_another_layout_are_refused_naming_the_field(fp8_checkpoints, tmp_path,
                                                                   tp, ep, field):
    with pytest.raises(EngineError, match=f"{field}.*rank files of another layout"):
        build_engine(fp8_checkpoints[1], tmp_path / "e", BuildOptions(**TINY_OPTS),
                     parallel=ParallelMapping(tp, ep))


def test_each_rank_plans_its_own_kv_cache_and_info_shows_it(tiny_dir, tmp_path):
    opts = BuildOptions(**{**TINY_OPTS, "kv_memory_gib": 0.001})
    single = _spec(build_engine(tiny_dir, tmp_path / "one", opts))
    tp2 = build_engine(tiny_dir, tmp_path / "tp2", opts, parallel=ParallelMapping(2, 2))
    plans = [_spec(tp2 / f"rank{r}")["kv_plan"] for r in range(2)]
    for plan in plans:  # one of the tiny's 2 KV heads a rank: half the bytes a block
        assert plan["bytes_per_block"] * 2 == single["kv_plan"]["bytes_per_block"]
        assert plan["num_blocks"] > single["kv_plan"]["num_blocks"]
    run = subprocess.run([sys.executable, "-m", "beam_trtllm.cli", "info", str(tp2)],
                         capture_output=True, text=True, check=True)
    assert "tp 2 ep 2 (moe_tp 1), 2 ranks" in run.stdout
    assert "rank 1: q heads 2-3, kv heads 1-1, experts 8-15 (slice 0)" in run.stdout
    assert f"KV {plans[1]['num_blocks']} blocks" in run.stdout


def test_a_parallel_dir_loads_only_inside_a_launch(tiny_dir, tmp_path):
    eng = build_engine(tiny_dir, tmp_path / "tp2", BuildOptions(**TINY_OPTS),
                       parallel=ParallelMapping(2, 1))
    with pytest.raises(EngineError, match="is a parallel engine"):
        Engine.from_dir(eng)
    with pytest.raises(EngineError, match="needs torch.distributed initialized"):
        Engine.from_dir(eng / "rank1")
    with _world_of_one():
        with pytest.raises(EngineError, match="rank 1 of 2 .* loaded by rank 0 of a world of 1"):
            Engine.from_dir(eng / "rank1")


@pytest.mark.parametrize("attention_dp", [False, True])
@pytest.mark.parametrize("per_slot", [True, False], ids=["per-slot", "fp32-sums"])
def test_a_world_of_one_rank_runs_the_parallel_path_like_the_single_engine(
        tiny_dir, tmp_path, attention_dp, per_slot, one_thread, monkeypatch):
    """World size 1 on gloo (the CPU twin of the NCCL check, tests/test_parallel_nccl.py): the
    MoE goes through the pair dispatch and the collectives, and equals the plain engine; also
    with the exchange of FP32 weighted sums that steps of >= 1,024 tokens take (forced here,
    and the single-rank engine then combines in the MoE op)."""
    if not per_slot:
        import plugins.add_rmsnorm

        monkeypatch.setattr(plugins.add_rmsnorm, "adds_partials", lambda t: False)
    opts = BuildOptions(**TINY_OPTS, dtype="float32")
    batch = prompts(5, (7, 19, 12, 30))
    want = [r["token_ids"] for r in Engine.from_dir(build_engine(tiny_dir, tmp_path / "one", opts))
            .generate(batch, greedy(5))]
    par = build_engine(tiny_dir, tmp_path / "par", opts,
                       parallel=ParallelMapping(1, 1, attention_dp))
    with _world_of_one():
        engine = Engine.from_dir(par / "rank0")
        got = generate(engine, batch, greedy(5))
        assert [got[i]["token_ids"] for i in range(len(batch))] == want
        assert engine.blocks.num_used == 0


class _world_of_one:
    def __enter__(self):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)

    def __exit__(self, *exc):
        dist.destroy_process_group()
