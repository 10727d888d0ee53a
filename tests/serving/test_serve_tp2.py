"""The agg graph with one worker whose engine is a TP2 rank group on the CPU (gloo): the
worker is rank 0 and starts rank 1 itself (beam_trtllm/engine/parallel/group.py). Its greedy
text through the real Dynamo frontend and the `openai` client is the single-rank engine's.

Layout `--tp 2 --ep 2` (attention heads split, 8 of the 16 experts a rank, moe_tp 1): bit for
bit the single-rank BF16 engine (docs/ENGINE.md "Parallelism"), so the same greedy tokens."""

import pytest

from beam_trtllm.tokenizer import TextTokenizer

from helpers.serving import EXTRA, PROMPTS, client, expect, launch_graph, wait_all_free


@pytest.fixture(scope="module")
def tp2_engine_dir(tiny_dir, engine_dir, tmp_path_factory):
    import json

    from beam_trtllm.engine.build import build_engine
    from beam_trtllm.engine.parallel import ParallelMapping
    from beam_trtllm.engine.plan import BuildOptions

    raw = json.loads((engine_dir / "engine.json").read_text())["options"]
    opts = BuildOptions(**{**raw, "cuda_graph_batch_sizes": tuple(raw["cuda_graph_batch_sizes"])})
    return build_engine(tiny_dir, tmp_path_factory.mktemp("tp2") / "engine", opts,
                        parallel=ParallelMapping(2, 2))


@pytest.fixture(scope="module")
def agg_tp2(request, tmp_path_factory, tp2_engine_dir):
    running = launch_graph("agg.yaml", {"workers.0.count": 1}, tmp_path_factory, tp2_engine_dir,
                           while_starting=lambda: request.getfixturevalue("reference"))
    yield running
    running.stop()


@pytest.mark.slow
def test_a_tp2_worker_answers_with_the_single_rank_greedy_text(agg_tp2, reference, engine_dir):
    tok = TextTokenizer(engine_dir)
    c = client(agg_tp2)
    for prompt in PROMPTS:
        want, reason = expect(reference, prompt, 12)
        resp = c.completions.create(model="beam", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body=EXTRA)
        assert resp.model_extra["nvext"]["completion_token_ids"] == want
        assert resp.choices[0].text == tok.decode(want)
        assert resp.choices[0].finish_reason == reason
    status = wait_all_free(agg_tp2)
    assert len(status) == 1 and all(s["kv_used_blocks"] == 0 for s in status.values())
