"""Overlapped decode steps (engine/overlap.py): the next step launched before this one's
tokens reach the host gives the step-by-step engine's tokens, texts and finish reasons, under
ragged arrivals, stops, length limits, sampling, aborts and rows that cannot overlap, and
frees every block. (On the CPU nothing runs concurrently; the bookkeeping is the same.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import (  # noqa: F401  (fixtures)
    TINY_OPTS, drive, greedy, one_thread, prompts, tiny_fp32_engine_dir,
)
from test_engine_generate import assert_all_free

from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def engines(path):
    return (Engine.from_dir(path, device="cpu", overlap=False),
            Engine.from_dir(path, device="cpu", overlap=True))


def both(path, arrivals, on_step=None):
    plain, ahead = engines(path)
    want = drive(plain, arrivals, on_step=on_step and (lambda s: on_step(plain, s)))
    got = drive(ahead, arrivals, on_step=on_step and (lambda s: on_step(ahead, s)))
    assert plain.stats["overlapped_steps"] == 0
    return want, got, plain, ahead


def test_ragged_greedy_with_stops_matches_step_by_step(tiny_fp32_engine_dir):
    ps = prompts(11, [5, 17, 9, 30, 3, 12])
    reference = drive(Engine.from_dir(tiny_fp32_engine_dir, device="cpu", overlap=False),
                      {0: [("probe", ps[0], greedy(12))]})["probe"]["tokens"]
    stop_on = reference[6]  # a token this prompt really produces: it stops there
    arrivals = {
        0: [("a", ps[0], SamplingParams(max_tokens=12, stop_token_ids=(stop_on,))),
            ("b", ps[1], greedy(9))],
        2: [("c", ps[2], greedy(1)), ("d", ps[3], greedy(14))],
        7: [("e", ps[4], greedy(5))],
        11: [("f", ps[5], greedy(3))],
    }
    want, got, _, ahead = both(tiny_fp32_engine_dir, arrivals)
    assert got == want
    assert want["a"]["finish_reason"] == "stop" and len(want["a"]["tokens"]) <= 7
    assert ahead.stats["overlapped_steps"] >= 5
    assert_all_free(ahead)


def test_sampled_rows_match_step_by_step(tiny_fp32_engine_dir):
    ps = prompts(12, [7, 21, 4])
    arrivals = {0: [
        ("seeded", ps[0], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=5,
                                         ignore_eos=True)),
        ("unseeded", ps[1], SamplingParams(max_tokens=16, temperature=1.1, top_k=20,
                                           ignore_eos=True)),
        ("min_p", ps[2], SamplingParams(max_tokens=10, temperature=0.7, min_p=0.05,
                                        ignore_eos=True)),
    ]}
    want, got, _, ahead = both(tiny_fp32_engine_dir, arrivals)
    assert got == want  # the engine's generator draws in the same order
    assert ahead.stats["overlapped_steps"] > 5
    assert_all_free(ahead)


def test_stop_strings_and_rows_that_cannot_overlap(tiny_fp32_engine_dir):
    ps = prompts(13, [9, 14, 6])
    plain, _ = engines(tiny_fp32_engine_dir)
    text = plain.generate([ps[0]], greedy(20))[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    arrivals = {0: [("stop", ps[0], SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,))),
                    ("lp", ps[1], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2))],
                3: [("pen", ps[2], SamplingParams(max_tokens=8, ignore_eos=True,
                                                  repetition_penalty=1.3))]}
    want, got, _, ahead = both(tiny_fp32_engine_dir, arrivals)
    assert got == want and want["stop"]["finish_reason"] == "stop"
    assert stop not in want["stop"]["text"]
    assert_all_free(ahead)


def test_grammar_rows_match_step_by_step(tiny_fp32_engine_dir):
    """Grammar rows overlap too: the next step's forward is launched before this step's tokens
    land, its sampling once their matchers have taken them and filled the masks. A tool call
    (its grammar ends the request), JSON, a thinking budget, sampled and plain rows; a
    penalized grammar row joins later (it cannot overlap: those steps run one at a time)."""
    from test_grammar_engine import _requests
    params = _requests()
    names = ["call", "json", "plain", "think", "call2", "seeded", "penalized"]
    ps = dict(zip(names, prompts(17, [9, 23, 5, 31, 14, 7, 18])))
    arrivals = {0: [(r, ps[r], params[r]) for r in ("call", "json", "think")],
                12: [(r, ps[r], params[r]) for r in ("plain", "call2", "seeded")],
                30: [("penalized", ps["penalized"], params["penalized"])]}
    grammar_only = {}  # overlapped steps by step 11, while every row has a grammar

    def note(engine, step):
        if step == 11:
            grammar_only[engine.overlap] = engine.stats["overlapped_steps"]
    want, got, _, ahead = both(tiny_fp32_engine_dir, arrivals, on_step=note)
    assert got == want and want["call"]["finish_reason"] == "stop"
    assert grammar_only[True] >= 8 and ahead.stats["overlapped_steps"] > grammar_only[True]
    assert_all_free(ahead)


def test_abort_while_a_step_is_in_flight(tiny_fp32_engine_dir):
    ps = prompts(14, [8, 10])
    arrivals = {0: [("x", ps[0], greedy(30)), ("y", ps[1], greedy(30))]}

    def abort_x(engine, step):
        if step == 6:
            assert engine.overlap is False or engine._inflight is not None
            engine.abort("x")

    want, got, _, ahead = both(tiny_fp32_engine_dir, arrivals, on_step=abort_x)
    assert got == want
    assert len(want["x"]["tokens"]) < 30 and len(want["y"]["tokens"]) == 30
    ahead.requests.clear()
    assert_all_free(ahead)


def test_off_by_default_on_the_cpu(tiny_fp32_engine_dir):
    engine = Engine.from_dir(tiny_fp32_engine_dir, device="cpu")
    assert engine.overlap is False
    engine.generate([prompts(15, [5])[0]], greedy(6))
    assert engine.stats["overlapped_steps"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA graphs, streams)")
def test_cuda_graph_steps_match_step_by_step(tiny_dir, tmp_path):
    """On the GPU the next step really runs while the host lands this one. Every request
    arrives at step 0 and ends by length, so both engines run the same steps: on the GPU a
    step's shape picks its kernels (a decode row computed in a step with a prefill chunk sums
    in another order: docs/ENGINE.md "Cache invariance"), and a ragged arrival or a stop the
    host learns late (the overlapped engine's one extra in-flight row) changes the steps, not
    the overlap's tokens. The CPU tests above cover those schedules."""
    path = build_engine(tiny_dir, tmp_path / "e", BuildOptions(**TINY_OPTS, target="sm90",
                                                               autotune="off"))
    from test_grammar_engine import _requests
    json_row = dataclasses.replace(_requests()["json"], max_tokens=8)  # ends before its grammar
    ps = prompts(16, [6, 19, 11, 9])
    arrivals = {0: [("g0", ps[0], greedy(40)), ("g1", ps[1], greedy(33)),
                    ("s", ps[2], SamplingParams(max_tokens=25, temperature=0.8, seed=3,
                                                ignore_eos=True)),
                    ("json", ps[3], json_row)]}  # a grammar row (masked sampling)
    plain = Engine.from_dir(path, device="cuda", overlap=False)
    ahead = Engine.from_dir(path, device="cuda")
    assert ahead.overlap and ahead.graphs is not None
    want = drive(plain, arrivals)
    assert all(r["finish_reason"] == "length" for r in want.values()), want
    assert drive(ahead, arrivals) == want
    assert ahead.stats["overlapped_steps"] > 20 and ahead.stats["graph_steps"] > 20
    assert_all_free(ahead)
