"""Tensor, expert and attention-data parallel engines on the CPU (gloo, 2 and 4 ranks) against
the single-rank engine, on the tiny canonical Beam in FP32 (tests/engine_helpers.py says why
FP32: token equality is asserted where only summation order differs).

Layouts (docs/ENGINE.md "Parallelism"; world = tp, the MoE in ep groups of tp / ep ranks):
TP2 (tp 2), TP4 (tp 4: the tiny's 2 KV heads replicated on 2 ranks each), EP2 (tp 2 ep 2),
EP4 (tp 4 ep 4), TP2xEP2 (tp 4 ep 2: 2 expert groups, each expert split 2 ways),
DP2+EP2 (tp 2 ep 2 attention-dp). One launch per world size runs all its layouts.

With moe_tp = 1 (the EP layouts) every sum a rank takes part in is either an FP32 partial of a
split GEMM rounded once (as the unsplit GEMM's BLAS sum is here) or a per-slot expert output
held by one rank, so a BF16 EP2 engine is also held to the single-rank BF16 engine bit for
bit (EP2-bf16)."""

from __future__ import annotations

import pytest
import torch

from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.parallel import ParallelMapping
from beam_trtllm.engine.parallel.launch import launch
from beam_trtllm.engine.plan import BuildOptions
from conftest import tol
from engine_helpers import TINY_OPTS, all_logits, drive, greedy, prompts

import parallel_ranks

N_NEW = 6
# The tiny engines' small blocks, with room for 8 sequences and 96 tokens a step: the 20
# prompts take few steps (each step costs every rank a dozen collectives).
OPTS = {dtype: BuildOptions(**{**TINY_OPTS, "max_batch": 8, "max_num_tokens": 96}, dtype=dtype)
        for dtype in ("float32", "bfloat16")}
LAYOUTS = {2: {"TP2": (2, 1, False, "float32"), "EP2": (2, 2, False, "float32"),
               "DP2+EP2": (2, 2, True, "float32"), "EP2-bf16": (2, 2, False, "bfloat16")},
           4: {"TP4": (4, 1, False, "float32"), "EP4": (4, 4, False, "float32"),
               "TP2xEP2": (4, 2, False, "float32")}}


def _scenario():
    """Continuous batching: arrivals over several steps, an abort mid-flight, a prompt that
    shares A's first 16 tokens while A runs, and A's whole prompt again after A finished
    (prefix reuse). Owners place A, D, E on one attention-DP rank so that they share a cache."""
    a, b, c = prompts(71, (20, 9, 15))
    d = a[:16] + prompts(72, (5,))[0]
    arrivals = {0: [("A", a, 8, 0), ("B", b, 12, 1)], 2: [("C", c, 6, 1), ("D", d, 5, 0)],
                9: [("E", list(a), 4, 0)]}
    return {"arrivals": arrivals, "aborts": {3: ["B"]}}


def _single(engine: Engine, scenario) -> dict:
    arrivals = {s: [(rid, p, greedy(n)) for rid, p, n, _ in reqs]
                for s, reqs in scenario["arrivals"].items()}
    aborted = {rid for rids in scenario["aborts"].values() for rid in rids}
    return {rid: r for rid, r in drive(engine, arrivals).items() if rid not in aborted}


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory):
    """The single-rank engine's logits, tokens and scenario outcome, per dtype."""
    lengths = torch.randint(3, 40, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    batch = prompts(70, [21] + lengths[1:])  # the first (logits checked row by row) in 1 chunk
    out = {"prompts": batch}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny's ops are too small to split (engine_helpers.one_thread)
    try:
        for dtype, opts in OPTS.items():
            out[dtype] = _reference(tiny_dir, tmp_path_factory, dtype, opts, batch)
    finally:
        torch.set_num_threads(threads)
    return out


def _reference(tiny_dir, tmp_path_factory, dtype, opts, batch):
    engine = Engine.from_dir(build_engine(tiny_dir, tmp_path_factory.mktemp(dtype) / "e", opts))
    logits, _ = all_logits(engine, batch[0], N_NEW)
    tokens = [r["token_ids"] for r in engine.generate(batch, greedy(N_NEW))]
    return {"logits": logits, "tokens": tokens, "scenario": _single(engine, _scenario())}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layouts_equal_the_single_rank_engine(world, tiny_dir, reference, tmp_path):
    dirs = []
    for name, (tp, ep, dp, dtype) in LAYOUTS[world].items():
        dirs.append(str(build_engine(tiny_dir, tmp_path / name, OPTS[dtype],
                                     parallel=ParallelMapping(tp, ep, dp))))
    per_rank = launch(world, parallel_ranks.run_layouts, dirs, reference["prompts"], N_NEW,
                      _scenario(), timeout_s=240)
    for k, (name, (_, _, dp, dtype)) in enumerate(LAYOUTS[world].items()):
        ranks, want = [r[k] for r in per_rank], reference[dtype]
        if dtype == "float32":
            torch.testing.assert_close(ranks[0]["logits"], want["logits"],
                                       **tol("parallel-vs-single", torch.float32), msg=name)
        else:  # moe_tp = 1: bit for bit (module docstring)
            assert torch.equal(ranks[0]["logits"], want["logits"]), name
        tokens = {i: t for r in ranks for i, t in r["tokens"].items()}
        assert [tokens[i] for i in range(20)] == want["tokens"], name
        _check_scenario(name, ranks, want["scenario"], dp)


def _check_scenario(name, ranks, want, attention_dp: bool):
    got = {}
    for r in ranks:
        for rid, res in r["scenario"].items():
            if attention_dp or rid not in got:
                got[rid] = res
            else:  # TP: every rank ran every request, with the same tokens
                assert res == got[rid], (name, rid)
    assert got.pop("B")["finish_reason"] == "abort", name
    assert {rid: (r["tokens"], r["finish_reason"]) for rid, r in got.items()} == \
        {rid: (r["tokens"], r["finish_reason"]) for rid, r in want.items()}, name
    assert ranks[0]["prefix_hits"] > 0, name  # D and E hit A's blocks (rank 0 under DP)
    for r in ranks:  # every rank's KV blocks and ring rows free again, nothing left queued
        assert (r["used_blocks"], r["free_rows"], r["requests_left"]) == (0, r["max_seqs"], 0), name
