"""Grammar-constrained decoding inside the engine: a batch's masks filled and its tokens
accepted in one call each (chat/grammar.py MaskFiller), masks applied in place through reused
buffers (sampler.py). Constrained and unconstrained requests that join and leave a batch
mid-flight get the tokens each gets alone (the FP32 engine is batch invariant,
test_engine_generate.py); a token outside the grammar ends its request with the error; a
finished grammar ends its request under ignore_eos too."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_helpers import drive, prompts, tiny_fp32_engine_dir  # noqa: F401  (fixture)

from beam_trtllm.chat.grammar import GrammarCompiler, MaskFiller, turn_structural_tag
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.sampler import sample
from beam_trtllm.engine.types import SamplingParams

TOOLS = {"f": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                      "maximum": 9}}, "required": ["n"]}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "string",
                                                                    "maxLength": 6}},
    "required": ["a", "b"]}}}


def _requests() -> dict[str, SamplingParams]:
    call = turn_structural_tag(TOOLS, "required", None, False, parallel=False)
    as_json = turn_structural_tag({}, None, SCHEMA, False)
    thinking = turn_structural_tag({}, None, None, True, thinking_budget=6)
    return {
        "call": SamplingParams(max_tokens=70, structural_tag=call),
        "plain": SamplingParams(max_tokens=12, ignore_eos=True),
        "json": SamplingParams(max_tokens=30, structural_tag=as_json),
        "think": SamplingParams(max_tokens=18, structural_tag=thinking),
        "seeded": SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True),
        "penalized": SamplingParams(max_tokens=15, structural_tag=as_json, frequency_penalty=1.5,
                                    temperature=0.8, seed=3),
        "call2": SamplingParams(max_tokens=40, structural_tag=call, temperature=1.0, seed=11),
    }


@pytest.fixture
def engine(tiny_fp32_engine_dir):
    return Engine.from_dir(tiny_fp32_engine_dir, device="cpu")


def test_mixed_ragged_batch_matches_one_request_at_a_time(engine):
    params = _requests()
    ps = dict(zip(params, prompts(41, [9, 23, 5, 31, 14, 7, 18])))
    alone = {rid: drive(engine, {0: [(rid, ps[rid], p)]})[rid] for rid, p in params.items()}
    # at most 4 run at once (TINY_OPTS): requests join and leave, and a request ahead of the
    # others is aborted between steps, so constrained rows move
    victim = ("victim", prompts(45, [10])[0], params["json"])
    order = list(params)
    arrivals = {0: [victim] + [(r, ps[r], params[r]) for r in order[:2]],
                1: [(order[2], ps[order[2]], params[order[2]])],
                6: [(r, ps[r], params[r]) for r in order[3:]]}
    together = drive(engine, arrivals, on_step=lambda step: step == 3 and engine.abort("victim"))
    for rid in params:
        assert together[rid]["tokens"] == alone[rid]["tokens"], rid
        assert together[rid]["finish_reason"] == alone[rid]["finish_reason"], rid
    text = engine.tokenizer.decode(together["call"]["tokens"], skip_special_tokens=False)
    assert together["call"]["finish_reason"] == "stop" and text.endswith("<|call|>")


def test_a_finished_grammar_ends_its_request_under_ignore_eos(engine):
    p = replace(_requests()["call"], ignore_eos=True, max_tokens=80)
    out = engine.generate([prompts(42, [11])[0]], p)[0]
    text = engine.tokenizer.decode(out["token_ids"], skip_special_tokens=False)
    assert out["finish_reason"] == "stop" and text.endswith("<|call|>")
    assert len(out["token_ids"]) < 80


def test_a_token_outside_the_grammar_ends_the_request_with_the_error(engine):
    tag = turn_structural_tag({}, None, None, False)  # must open with <|channel|>
    prompt = prompts(43, [6])[0]
    handle = engine.kv_reserve("h", len(prompt))
    bad = 5  # a text token: the grammar's first token is the <|channel|> special token
    engine.add_request("h", prompt, SamplingParams(max_tokens=8, structural_tag=tag),
                       kv_reserved=replace(handle, first_token=bad))
    engine.add_request("ok", prompts(44, [8])[0], SamplingParams(max_tokens=4, structural_tag=tag))
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    last = outs["h"][-1]
    assert last.finished and last.finish_reason == "error"
    assert "token 5 is outside the request's grammar" in last.error
    assert outs["ok"][-1].finish_reason == "length"  # the batch goes on


def test_masks_apply_in_place_and_logprobs_stay_the_models():
    v = 70  # not a multiple of 32: the bitmask's last word is partial
    logits = torch.randn(2, v, generator=torch.Generator().manual_seed(5)) * 2
    raw = logits.clone()
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[1, 2] = 1 << 1  # row 1 may only emit token 65; row 0's mask is never applied
    tag = SamplingParams(structural_tag="{}", logprobs=2)
    toks, lps = sample(logits, [SamplingParams(), tag], [0, 0], bitmask=bitmask, mask_rows=[1])
    assert toks == [int(raw[0].argmax()), 65]
    want = raw[1].log_softmax(-1)
    assert lps[1].logprob == pytest.approx(float(want[65]), abs=1e-6)
    assert [t for t, _ in lps[1].top] == want.topk(2).indices.tolist()
    assert torch.equal(logits[0], raw[0])  # the unconstrained row: untouched
    assert torch.isinf(logits[1]).sum() == v - 1 and logits[1, 65] == raw[1, 65]  # in place
    # a row with a bias: every row is shaped on an fp32 copy, the caller's logits stay
    logits = raw.clone()
    toks, _ = sample(logits, [SamplingParams(logit_bias={3: 50.0}), tag], [0, 0],
                     bitmask=bitmask, mask_rows=[1])
    assert toks == [3, 65] and torch.equal(logits, raw)


def test_mask_filler_fills_and_accepts_a_batch_as_one_matcher_at_a_time(engine):
    import xgrammar as xgr

    tok = engine.tokenizer
    compiler = GrammarCompiler(tok.vocab, engine.cfg.vocab_size, sorted(engine.eos_token_ids))
    tags = [turn_structural_tag(TOOLS, "required", None, False, parallel=False),
            turn_structural_tag({}, None, SCHEMA, False),
            turn_structural_tag({}, None, None, True)]
    matchers = [compiler.matcher(t) for t in tags]
    channel = tok.encode("<|channel|>")[0]
    filler = MaskFiller()
    assert filler.accept(matchers[1:], [channel, channel]) == [True, True]
    assert filler.accept([matchers[0]], [channel]) == [False]  # a call opens with " to="
    want = xgr.allocate_token_bitmask(4, engine.cfg.vocab_size)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(want, i)
    got = torch.zeros_like(want)
    filler.fill(got, [matchers[2], matchers[0], matchers[1]], [3, 0, 1])  # rows in any order
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[3], want[2]) and not got[2].any()  # row 2: not asked for
    assert filler.accept(matchers, [channel] * 3) == [False, False, False]
    again = torch.zeros_like(want)
    filler.fill(again, matchers, [0, 1, 2])  # a refused token leaves its matcher as it was
    assert torch.equal(again[:3], want[:3])
