"""Sampler and incremental detokenizer: greedy, temperature, top-k, top-p, per-request seeds,
logprobs, stop strings."""

from __future__ import annotations

import pytest
import torch

from beam_trtllm.engine.detok import IncrementalDetokenizer
from beam_trtllm.engine.sampler import filtered_probs, sample
from beam_trtllm.engine.types import EngineError, SamplingParams
from conftest import tol

LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.2, 1.1, -3.0])


def frequencies(params: SamplingParams, n: int = 4000) -> torch.Tensor:
    """Empirical distribution over n draws, each its own request (seed = row)."""
    rows = LOGITS.expand(n, -1).clone()
    ps = [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(n)]
    tokens, _ = sample(rows, ps, [0] * n)
    return torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).float() / n


def test_greedy_is_argmax_and_ties_take_the_lower_id():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 0.0]])
    tokens, lps = sample(logits, [SamplingParams(), SamplingParams()], [0, 0])
    assert tokens == [1, 0] and lps == [None, None]


def test_temperature_samples_the_softmax():
    got = frequencies(SamplingParams(temperature=0.7))
    torch.testing.assert_close(got, (LOGITS / 0.7).softmax(-1), **tol("sampling-frequency", torch.float32))


def test_top_k_and_top_p_restrict_the_support():
    got = frequencies(SamplingParams(temperature=1.0, top_k=2))
    want = torch.zeros(6)
    want[:2] = LOGITS[:2].softmax(-1)
    torch.testing.assert_close(got, want, **tol("sampling-frequency", torch.float32))
    # softmax = [.39, .24, .07, .04, .16, .00]: top_p 0.5 keeps the two tokens that reach it
    probs = filtered_probs(LOGITS, 1.0, 0, 0.5)
    assert (probs > 0).tolist() == [True, True, False, False, False, False]
    assert (filtered_probs(LOGITS, 1.0, 0, 0.3) > 0).sum() == 1  # the crossing token stays
    torch.testing.assert_close(filtered_probs(LOGITS, 2.0, 0, 1.0), (LOGITS / 2).softmax(-1),
                               **tol("fp32-reorder", torch.float32))


def test_seed_makes_a_request_independent_of_its_batch():
    p = SamplingParams(temperature=1.0, seed=1234)
    alone, _ = sample(LOGITS[None].clone(), [p], [3])
    other = SamplingParams(temperature=1.0)
    batch = torch.stack([LOGITS.flip(0), LOGITS, LOGITS * 2])
    together, _ = sample(batch, [other, p, other], [0, 3, 9], torch.Generator().manual_seed(5))
    assert together[1] == alone[0]
    draws = [sample(LOGITS[None].clone(), [p], [i])[0][0] for i in range(40)]
    assert len(set(draws)) > 2  # the token index moves the stream on


def test_logprobs_are_the_models_distribution():
    p = SamplingParams(temperature=0.5, top_k=2, seed=0, logprobs=3)
    tokens, lps = sample(LOGITS[None].clone(), [p], [0])
    want = LOGITS.log_softmax(-1)
    assert lps[0].token_id == tokens[0] and lps[0].logprob == pytest.approx(float(want[tokens[0]]))
    assert [t for t, _ in lps[0].top] == [0, 1, 4]
    assert [v for _, v in lps[0].top] == pytest.approx(want[[0, 1, 4]].tolist())


def test_bad_sampling_params_are_refused():
    for kwargs, field in [({"max_tokens": 0}, "max_tokens"), ({"top_p": 0.0}, "top_p"),
                          ({"temperature": -1.0}, "temperature"), ({"top_k": -2}, "top_k"),
                          ({"stop": ("",)}, "stop"), ({"logprobs": -1}, "logprobs")]:
        with pytest.raises(EngineError, match=field):
            SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from beam_trtllm.tokenizer import TextTokenizer

    return TextTokenizer(tiny_dir)


def test_incremental_detokenization_equals_full_decode(tok):
    text = "def add(a, b):\n    return a + b  # naïve ünïcode 漢字 ✓\n"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode("prompt: "))
    pieces = [d.add([t]) for t in ids] + [d.finish()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert "\ufffd" not in "".join(pieces)


def test_stop_strings_cut_and_hold_back(tok):
    text = "first line\nsecond STOP third"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], stop=("STOP", "never"))
    shown = []
    for t in ids:
        shown.append(d.add([t]))
        if d.stopped:
            break
    shown.append(d.finish())
    assert "".join(shown) == "first line\nsecond "
    assert all("S" not in s for s in shown)  # no partial stop string ever reached the client


class _WindowsOnly:
    """A decoder without `decode_stream`: the detokenizer decodes its two windows itself."""

    def __init__(self, tok):
        self.decode = tok.decode


@pytest.mark.parametrize("stop", [(), ("ünï", "never")])
def test_stream_and_window_detokenizers_show_the_same_pieces(tok, stop):
    """TextTokenizer's DecodeStream and the Python two-window decode give the same text piece
    by piece, one token at a time and several at once (a verify step's), with special tokens."""
    ids = tok.encode("x = '漢字' + \"naïve\"\n<|end|>  # ünïcode ✓ after") * 2
    prompt = tok.encode("prompt: 字")
    cuts = [0]
    while cuts[-1] < len(ids):  # consecutive groups of 1, 3, 1, 2, ... tokens
        cuts.append(min(len(ids), cuts[-1] + (1, 3, 1, 2)[len(cuts) % 4]))
    runs = []
    for decoder in (tok, _WindowsOnly(tok)):
        d = IncrementalDetokenizer(decoder, prompt, stop=stop)
        assert (d.stream is not None) == (decoder is tok)
        pieces = [d.add(ids[a:b]) for a, b in zip(cuts, cuts[1:]) if not d.stopped]
        runs.append(pieces + [d.finish()])
    assert runs[0] == runs[1]
    assert "".join(runs[0]) == (tok.decode(ids) if not stop else tok.decode(ids).split("ünï")[0])
