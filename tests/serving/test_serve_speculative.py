"""The disaggregated graph with drafts on (the trained tiny Beam and its DFlash2 drafter,
`speculative: {tokens: 7}` in the graph YAML): the OpenAI client gets the drafts-off engine's
greedy tokens, the decode worker accepts drafts (its status), and the prefill worker's
drafter context reaches it with the KV (NIXL moves the drafter's blocks too)."""

import pytest

from helpers.serving import EXTRA, client, launch_graph, status_when, wait_all_free


@pytest.fixture(scope="module")
def spec_engine_dir(tmp_path_factory):
    from beam_trtllm.engine.build import build_engine
    from beam_trtllm.engine.plan import BuildOptions
    from beam_trtllm.tiny import init_trained_tiny

    ckpt = init_trained_tiny(tmp_path_factory.mktemp("trained") / "ckpt")
    opts = BuildOptions(max_batch=8, max_seq_len=1024, max_num_tokens=256, block_size=16)
    return build_engine(ckpt, tmp_path_factory.mktemp("engine") / "spec", opts,
                        draft=ckpt / "draft")


@pytest.fixture(scope="module")
def prompts():
    from beam_trtllm.train.dialogues import dialogues

    return [e.prompt for e in dialogues(3, 31)][:3]


@pytest.fixture(scope="module")
def reference(spec_engine_dir, prompts):
    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.types import SamplingParams

    engine = Engine.from_dir(spec_engine_dir, device="cpu", speculative=False)
    return [engine.generate([engine.tokenizer.encode(p)], SamplingParams(max_tokens=24))[0]
            ["token_ids"] for p in prompts]


@pytest.fixture(scope="module")
def disagg(request, tmp_path_factory, spec_engine_dir):
    running = launch_graph("disagg.yaml", {"speculative": {"tokens": 7}}, tmp_path_factory,
                           spec_engine_dir, while_starting=lambda: request.getfixturevalue("reference"))
    yield running
    running.stop()


def test_drafts_on_the_disaggregated_graph_give_the_targets_greedy_text(disagg, prompts,
                                                                        reference):
    c = client(disagg)
    for prompt, ref in zip(prompts, reference):  # one at a time: batch-1 steps, bit for bit
        resp = c.completions.create(model="beam", prompt=prompt, max_tokens=24, temperature=0,
                                    extra_body=EXTRA)
        assert resp.model_extra["nvext"]["completion_token_ids"] == ref
    status = status_when(disagg, lambda st: any(
        s.get("spec_accepted_tokens", 0) > 0 for s in st.values() if s["role"] == "decode"))
    decode = [s for s in status.values() if s["role"] == "decode"]
    assert decode and decode[0]["spec_verify_steps"] > 0 and decode[0]["spec_accepted_tokens"] > 0
    wait_all_free(disagg)
