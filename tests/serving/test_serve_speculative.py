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


@pytest.fixture(scope="module")
def fp32_engine_dir(tmp_path_factory):
    """FP32: on the CPU the BF16 experts' reference groups a step's tokens by expert, so a BF16
    row's last bits depend on its batch there even at one step shape (docs/ENGINE.md)."""
    from beam_trtllm.engine.build import build_engine
    from beam_trtllm.engine.plan import BuildOptions
    from beam_trtllm.tiny import init_trained_tiny

    ckpt = init_trained_tiny(tmp_path_factory.mktemp("trained32") / "ckpt")
    opts = BuildOptions(max_batch=4, max_seq_len=1024, max_num_tokens=256, block_size=16,
                        dtype="float32")
    return build_engine(ckpt, tmp_path_factory.mktemp("engine") / "spec32", opts,
                        draft=ckpt / "draft")


def test_batch_invariant_graph_with_drafts_gives_the_drafts_off_text(tmp_path_factory,
                                                                     fp32_engine_dir, prompts):
    """`batch_invariant: true` reaches the worker: three concurrent requests through the agg
    graph with drafts on get the tokens the batch-invariant engine gives with drafts off."""
    from concurrent.futures import ThreadPoolExecutor

    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.types import SamplingParams

    ref = {}

    def reference():
        eng = Engine.from_dir(fp32_engine_dir, device="cpu", speculative=False,
                              batch_invariant=True)
        out = eng.generate([eng.tokenizer.encode(p) for p in prompts],
                           SamplingParams(max_tokens=20))
        ref.update({p: r["token_ids"] for p, r in zip(prompts, out)})
    running = launch_graph("agg.yaml", {"speculative": {"tokens": 7}, "batch_invariant": True},
                           tmp_path_factory, fp32_engine_dir, while_starting=reference)
    try:
        c = client(running)

        def ask(prompt):
            resp = c.completions.create(model="beam", prompt=prompt, max_tokens=20, temperature=0,
                                        extra_body=EXTRA)
            return resp.model_extra["nvext"]["completion_token_ids"]
        with ThreadPoolExecutor(3) as pool:
            got = dict(zip(prompts, pool.map(ask, prompts)))
        assert got == ref
        status = status_when(running, lambda st: any(s.get("spec_accepted_tokens", 0) > 0
                                                     for s in st.values()))
        assert any(s.get("spec_verify_steps", 0) > 0 for s in status.values())
        # the worker's engine runs every decode and verify step at 4 x (1 + 7) rows
        assert {s["batch_invariant_rows"] for s in status.values()} == {32}
    finally:
        running.stop()
