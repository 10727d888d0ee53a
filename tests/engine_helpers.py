"""Shared pieces of the engine tests: a tiny engine dir built once per session, the BF16
reference model, memoized reference generations, and a driver for ragged schedules."""

from __future__ import annotations

import pytest
import torch

from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.types import SamplingParams

# Small blocks and budgets so a few dozen tokens already span many blocks, several chunks and
# more than the tiny's sliding window of 8.
TINY_OPTS = dict(max_batch=4, max_seq_len=160, max_num_tokens=24, block_size=4)


@pytest.fixture(scope="session")
def tiny_engine_dir(tiny_dir, tmp_path_factory):
    return build_engine(tiny_dir, tmp_path_factory.mktemp("engines") / "tiny-bf16",
                        BuildOptions(**TINY_OPTS))


@pytest.fixture(scope="session")
def ref_bf16(tiny_dir):
    from beam_trtllm.reference import BeamForCausalLM

    return BeamForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def prompts(seed: int, lengths, vocab: int = 508) -> list[list[int]]:
    """Random prompts over the learned vocabulary (the 4 special tokens are the last ids)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


_REF_CACHE: dict = {}


def ref_greedy(model, prompt: list[int], n: int) -> list[int]:
    key = (id(model), tuple(prompt), n)
    if key not in _REF_CACHE:
        out = model.generate(torch.tensor([prompt]), n)
        _REF_CACHE[key] = out[0, len(prompt):].tolist()
    return _REF_CACHE[key]


def drive(engine: Engine, arrivals: dict[int, list[tuple]], max_steps: int = 10_000,
          on_step=None) -> dict[str, dict]:
    """Add requests at the given step numbers ({step: [(id, prompt, sampling), ...]}), step
    until everything finished; returns {id: {"tokens", "finish_reason", "text"}}."""
    results: dict[str, dict] = {}
    step = 0
    while step <= max(arrivals, default=0) or engine.has_unfinished():
        for rid, prompt, sampling in arrivals.get(step, []):
            engine.add_request(rid, prompt, sampling)
            results[rid] = {"tokens": [], "finish_reason": None, "text": ""}
        for out in engine.step():
            res = results[out.request_id]
            res["tokens"] += out.new_token_ids
            res["text"] += out.text
            if out.finished:
                res["finish_reason"] = out.finish_reason
        if on_step is not None:
            on_step(step)
        step += 1
        assert step < max_steps, "engine did not finish"
    return results


@pytest.fixture(autouse=False)
def one_thread():
    """The tiny model's ops are far too small to split across threads: with two threads
    (and other tests sharing the two cores) each op pays OpenMP hand-offs, 10-20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
