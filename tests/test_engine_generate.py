"""The engine (FP32 build) against transformers' BeamForCausalLM (FP32) on the tiny Beam, token
for token: single requests, ragged batches that join and leave mid-flight, prompts longer than
the sliding window, chunked prefill, prefix reuse with the sliding-layer restore, preemption,
and block accounting (engine_helpers says why FP32)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (  # noqa: F401  (fixtures)
    TINY_OPTS, drive, greedy, one_thread, prompts, ref_fp32, ref_greedy, tiny_fp32_engine_dir,
)

pytestmark = pytest.mark.usefixtures("one_thread")

from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.graphs import DecodeGraphs
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.types import EngineError, SamplingParams
from beam_trtllm.hf_model import logits
from conftest import tol


@pytest.fixture
def engine(tiny_fp32_engine_dir):
    return Engine.from_dir(tiny_fp32_engine_dir, device="cpu")


def assert_all_free(engine: Engine) -> None:
    engine.blocks.check()
    assert engine.kv_usage().used_blocks == 0
    free = sum(engine.blocks.ref_count(b) == 0 for b in range(engine.blocks.num_blocks))
    assert free == engine.blocks.num_blocks == engine.kv_plan.num_blocks
    assert engine.kv.free_rows == engine.kv.max_seqs
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting


def test_single_requests_match_reference(engine, ref_fp32):
    # 1 token; shorter than, equal to and longer than the window (8); many chunks of 24.
    for i, prompt in enumerate(prompts(1, [1, 7, 8, 9, 30, 61])):
        out = drive(engine, {0: [(f"r{i}", prompt, greedy(10))]})[f"r{i}"]
        assert out["tokens"] == ref_greedy(ref_fp32, prompt, 10), f"prompt of {len(prompt)}"
        assert out["finish_reason"] == "length"
    assert_all_free(engine)


def test_logprobs_match_reference(engine, ref_fp32):
    prompt = prompts(2, [37])[0]
    res = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4))[0]
    ids = torch.tensor([prompt + res["token_ids"]])
    ref_lp = logits(ref_fp32, ids)[0, len(prompt) - 1:-1].log_softmax(-1)
    got = torch.tensor([lp.logprob for lp in res["logprobs"]])
    want = ref_lp.gather(1, torch.tensor(res["token_ids"])[:, None])[:, 0]
    torch.testing.assert_close(got, want, **tol("engine-vs-model", torch.float32))
    for row, lp in enumerate(res["logprobs"]):
        top_ids = [t for t, _ in lp.top]
        assert top_ids == ref_lp[row].topk(4).indices.tolist()


def test_ragged_batch_joins_and_leaves(engine, ref_fp32):
    # 7 requests, at most 4 running: they arrive at different steps, finish at different
    # lengths, and share steps with other requests' prefill chunks (batch invariance).
    ps = prompts(3, [5, 33, 12, 70, 1, 19, 44])
    lengths = [9, 4, 14, 6, 11, 3, 7]
    arrivals = {0: [("a", ps[0], greedy(lengths[0])), ("b", ps[1], greedy(lengths[1]))],
                2: [("c", ps[2], greedy(lengths[2]))],
                3: [("d", ps[3], greedy(lengths[3])), ("e", ps[4], greedy(lengths[4]))],
                7: [("f", ps[5], greedy(lengths[5]))], 9: [("g", ps[6], greedy(lengths[6]))]}
    results = drive(engine, arrivals)
    for k, rid in enumerate("abcdefg"):
        assert results[rid]["tokens"] == ref_greedy(ref_fp32, ps[k], lengths[k]), rid
    assert_all_free(engine)


def test_prefix_reuse_restores_sliding_layers(engine, ref_fp32):
    first = prompts(4, [50])[0]
    a = drive(engine, {0: [("a", first, greedy(6))]})["a"]["tokens"]
    # multi-turn: the previous prompt and answer, then a new user turn
    follow = first + a + prompts(5, [9])[0]
    before, hits = engine.stats["restored_tokens"], engine.blocks.stats["hits"]
    res = engine.generate([follow], greedy(8))[0]
    assert res["token_ids"] == ref_greedy(ref_fp32, follow, 8)
    # every full block of the first turn's computed tokens (its last token was never fed)
    assert engine.blocks.stats["hits"] - hits == (len(first) + len(a) - 1) // 4
    # R = min(P, n_sliding * (window - 1)) = 3 * 7 = 21 positions recomputed
    assert engine.stats["restored_tokens"] - before == 21
    # a prefix shorter than R: everything before it is recomputed (hist_start 0)
    short = first[:12] + prompts(6, [5])[0]
    assert engine.generate([short], greedy(5))[0]["token_ids"] == ref_greedy(ref_fp32, short, 5)
    assert_all_free(engine)


def test_restore_is_needed(engine, ref_fp32):
    """Without recomputing the sliding layers' window the prefix hit changes the logits: the
    restore above is what makes them equal."""
    first = prompts(7, [48])[0]
    engine.generate([first], greedy(2))
    follow = first + prompts(8, [6])[0]
    engine.scheduler.restore_span = 0  # take the hit but leave the rings empty
    res = engine.generate([follow], SamplingParams(max_tokens=1, ignore_eos=True, logprobs=0))[0]
    want = logits(ref_fp32, torch.tensor([follow]))[0, -1].log_softmax(-1)[res["token_ids"][0]]
    assert abs(res["logprobs"][0].logprob - float(want)) > 1e-3


def test_preemption_recomputes_and_keeps_tokens(tiny_dir, tmp_path, ref_fp32):
    # 26 blocks of 4 tokens (FP32 KV): too few for the four running requests, so some are preempted
    opts = BuildOptions(**{**TINY_OPTS, "max_seq_len": 96, "kv_memory_gib": 1.04e-4,
                           "dtype": "float32"})
    engine = Engine.from_dir(build_engine(tiny_dir, tmp_path / "e", opts), device="cpu")
    assert engine.kv_plan.num_blocks == 26
    ps = prompts(9, [5, 9, 30, 77, 3, 50])
    lengths = [10, 6, 14, 8, 12, 9]
    arrivals = {2 * k: [(f"r{k}", p, greedy(n))] for k, (p, n) in enumerate(zip(ps, lengths))}
    results = drive(engine, arrivals)
    assert engine.stats["preemptions"] > 0
    for k, (p, n) in enumerate(zip(ps, lengths)):
        assert results[f"r{k}"]["tokens"] == ref_greedy(ref_fp32, p, n)
    assert_all_free(engine)


def test_every_block_free_after_finished_and_aborted(engine):
    ps = prompts(10, [40, 13, 66, 7, 25, 30])
    arrivals = {0: [(f"r{k}", p, greedy(5 + k)) for k, p in enumerate(ps[:5])],
                1: [("stop", ps[5], SamplingParams(max_tokens=50, stop_token_ids=tuple(range(512))))]}
    aborted = {}

    def on_step(step):
        if step == 1:  # r2 is mid-prefill (66 tokens, 24 per step), r4 still waiting
            aborted["r2"] = engine.abort("r2")
            aborted["r4"] = engine.abort("r4")
        if step == 5:
            aborted["r1"] = engine.abort("r1")  # decoding
    results = drive(engine, arrivals, on_step=on_step)
    assert aborted == {"r2": True, "r4": True, "r1": True}
    assert engine.abort("r1") is False and engine.abort("nope") is False
    assert results["r2"]["finish_reason"] == results["r4"]["finish_reason"] == "abort"
    assert results["stop"]["finish_reason"] == "stop" and len(results["stop"]["tokens"]) == 1
    assert results["r0"]["finish_reason"] == "length" and len(results["r0"]["tokens"]) == 5
    assert_all_free(engine)


def test_decode_graph_padding_matches_eager(tiny_fp32_engine_dir, ref_fp32):
    """The CUDA-graph decode path's static buffers and padding rows (run eagerly on the CPU)."""
    engine = Engine.from_dir(tiny_fp32_engine_dir, device="cpu")
    engine.graphs = DecodeGraphs(engine.model, engine.options, engine.kv_plan, engine.cfg,
                                 engine.device, capture=False, sizes=(1, 4))
    ps = prompts(11, [20, 3, 9])
    results = drive(engine, {0: [(f"r{k}", p, greedy(6 + k)) for k, p in enumerate(ps)]})
    assert engine.stats["graph_steps"] > 5
    for k, p in enumerate(ps):
        assert results[f"r{k}"]["tokens"] == ref_greedy(ref_fp32, p, 6 + k)
    assert_all_free(engine)


def test_requests_that_cannot_run_are_refused(engine):
    with pytest.raises(EngineError, match="prompt has 160 tokens, --max-seq-len is 160"):
        engine.add_request("long", [1] * 160)
    with pytest.raises(EngineError, match="empty"):
        engine.add_request("empty", [])
    with pytest.raises(EngineError, match="token id 512 is outside"):
        engine.add_request("bad", [1, 512])
    engine.add_request("dup", [1, 2, 3])
    with pytest.raises(EngineError, match="already in the engine"):
        engine.add_request("dup", [1, 2, 3])
    engine.abort("dup")
    engine.step()
    assert_all_free(engine)


def test_request_that_never_fits(tiny_fp32_engine_dir):
    """An engine whose KV plan is smaller than --max-seq-len (built in code; `beam-trt build`
    refuses such a plan) refuses a request that could never get its blocks."""
    from dataclasses import replace

    from beam_trtllm.engine.engine_dir import load_weights, read_engine_dir

    spec = read_engine_dir(tiny_fp32_engine_dir)
    plan = replace(spec.kv, num_blocks=10)
    engine = Engine(spec.cfg, load_weights(spec, torch.device("cpu")), spec.layer_plan,
                    spec.options, plan, "cpu")
    engine.add_request("fits", [1] * 30, greedy(11))  # 40 positions, the last never stored
    with pytest.raises(EngineError, match="need 11 KV blocks, the engine has 10; it can never fit"):
        engine.add_request("too-big", [1] * 30, greedy(12))


def test_stop_strings_and_seeded_sampling_through_the_engine(engine):
    prompt = engine.tokenizer.encode("def add(a, b):\n    return")
    full = engine.generate([prompt], greedy(24))[0]
    text = full["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    first = text.find(stop)
    out = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))[0]
    assert out["finish_reason"] == "stop" and out["text"] == text[:first]
    assert out["token_ids"] == full["token_ids"][:len(out["token_ids"])]
    # it ends on the token that completes the stop string, not one step later
    ends = next(n for n in range(1, 25)
                if stop in engine.tokenizer.decode(full["token_ids"][:n]))
    assert len(out["token_ids"]) == ends
    # a seeded request samples the same tokens alone and in a batch with other requests
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    alone = engine.generate([prompt], seeded)[0]["token_ids"]
    others = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    results = drive(engine, {0: [("x", prompts(12, [30])[0], others), ("s", prompt, seeded)],
                             1: [("y", prompts(13, [5])[0], others)]})
    assert results["s"]["tokens"] == alone and alone != full["token_ids"][:8]
    assert_all_free(engine)
