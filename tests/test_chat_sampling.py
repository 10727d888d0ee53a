"""Sampling parameters the chat API exposes: penalties, logit bias, min-p, grammar masks."""

import pytest
import torch

from beam_trtllm.engine.sampler import sample
from beam_trtllm.engine.types import EngineError, SamplingParams

V = 37  # awkward vocabulary size (not a multiple of 32: the bitmask's last word is partial)


def _logits(seed=0):
    return (torch.randn(1, V, generator=torch.Generator().manual_seed(seed)) * 2.0)


def test_logit_bias_forces_a_token_and_logprobs_stay_the_models():
    logits = _logits()
    tok, lps = sample(logits.clone(), [SamplingParams(logit_bias={5: 100}, logprobs=0)], [0])
    assert tok == [5]
    assert lps[0].logprob == pytest.approx(float(logits[0].log_softmax(-1)[5]), abs=1e-6)


def test_penalties_follow_vllm():
    from beam_trtllm.engine.sampler import shape_logits

    logits = _logits()
    prompt, output = [3, 4], [4, 5, 5, 5]
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.5)
    got = shape_logits(logits, [p], [(prompt, output)], None, [])[0]
    want = logits[0].clone()
    for t in (3, 4, 5):  # repetition: prompt and output tokens
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    for t, n in ((4, 1), (5, 3)):  # frequency per occurrence, presence once: output only
        want[t] -= 0.5 * n + 0.25
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # exact formula, fp32 rounding
    top = int(logits.argmax())
    assert sample(logits.clone(), [SamplingParams(frequency_penalty=2.0)], [1],
                  histories=[([], [top] * 50)])[0] != [top]


def test_min_p_drops_unlikely_tokens():
    ll = torch.full((1, V), -30.0)
    ll[0, 7] = 0.0
    ll[0, 9] = -3.0  # p ratio e^-3 ~ 0.05
    draws = {sample(ll.clone(), [SamplingParams(temperature=1.0, seed=s, min_p=0.1)], [0])[0][0]
             for s in range(60)}
    assert draws == {7}
    draws = {sample(ll.clone(), [SamplingParams(temperature=1.0, seed=s, min_p=0.01)], [0])[0][0]
             for s in range(60)}
    assert draws == {7, 9}


def test_unshaped_rows_are_untouched_and_others_shaped():
    logits = torch.cat([_logits(1), _logits(2)])
    plain = sample(logits.clone(), [SamplingParams(), SamplingParams()], [0, 0])[0]
    mixed = sample(logits.clone(), [SamplingParams(), SamplingParams(logit_bias={0: 100})], [0, 0])[0]
    assert mixed == [plain[0], 0]


def test_grammar_bitmask_masks_only_its_rows():
    import xgrammar as xgr

    logits = torch.cat([_logits(3), _logits(3)])
    bitmask = torch.zeros(2, xgr.get_bitmask_shape(2, V)[1], dtype=torch.int32)
    bitmask[1, 0] = 1 << 11  # row 1 may only emit token 11
    p = SamplingParams(structural_tag="{}")
    toks = sample(logits.clone(), [SamplingParams(), p], [0, 0], bitmask=bitmask, mask_rows=[1])[0]
    assert toks == [int(logits[0].argmax()), 11]


@pytest.mark.parametrize("kw", [{"min_p": 1.5}, {"frequency_penalty": 3}, {"presence_penalty": -3},
                                {"repetition_penalty": 0}, {"logit_bias": {1: 101}}])
def test_out_of_range_parameters_are_refused(kw):
    with pytest.raises(EngineError, match=next(iter(kw))):
        SamplingParams(**kw)


@pytest.fixture(scope="module")
def engine_cpu(tiny_dir, tmp_path_factory):
    from beam_trtllm.engine.build import build_engine
    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.plan import BuildOptions

    out = build_engine(tiny_dir, tmp_path_factory.mktemp("chat-engine") / "engine",
                       BuildOptions(max_batch=4, max_seq_len=256, max_num_tokens=128))
    return Engine.from_dir(out, device="cpu")


def test_engine_follows_the_turn_grammar(engine_cpu):
    from beam_trtllm.chat.grammar import turn_structural_tag
    from beam_trtllm.chat.parser import parse_text

    tools = {"f": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                          "maximum": 9}}, "required": ["n"]}}
    tag = turn_structural_tag(tools, "required", None, False, parallel=False)
    tok = engine_cpu.tokenizer
    ids = tok.chat_ids([{"role": "user", "content": "go"}])
    out = engine_cpu.generate([ids], SamplingParams(max_tokens=60, structural_tag=tag))[0]
    text = tok.decode(out["token_ids"], skip_special_tokens=False)
    assert out["finish_reason"] == "stop" and text.endswith("<|call|>")
    calls = parse_text(text, tools)["tool_calls"]
    assert len(calls) == 1 and calls[0].name == "f" and 1 <= calls[0].arguments["n"] <= 9
