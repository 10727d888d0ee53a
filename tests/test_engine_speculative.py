"""Speculative decoding in the engine (beam_trtllm/engine/speculative.py) on the trained tiny
Beam and its shipped DFlash2 drafter: lossless greedy output under every scheduling feature,
the target's distribution at temperature 1, the verify graphs' padding, disaggregated handoff
with the drafter's context, and a drafter that does not fit refused by field."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.graphs import DecodeGraphs
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.speculative import SpecConfig
from beam_trtllm.engine.types import EngineError, SamplingParams
from tests.engine_helpers import drive
from tests.test_engine_disagg import assert_all_free, transport  # noqa: F401

OPTS = dict(max_batch=8, max_seq_len=512, max_num_tokens=96, block_size=16)


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    from beam_trtllm.tiny import init_trained_tiny

    return init_trained_tiny(tmp_path_factory.mktemp("trained") / "ckpt")


@pytest.fixture(scope="module")
def spec_engine_dir(trained_dir, tmp_path_factory):
    return build_engine(trained_dir, tmp_path_factory.mktemp("engines") / "spec",
                        BuildOptions(**OPTS), draft=trained_dir / "draft")


@pytest.fixture(scope="module")
def spec_fp32_engine_dir(trained_dir, tmp_path_factory):
    return build_engine(trained_dir, tmp_path_factory.mktemp("engines") / "spec32",
                        BuildOptions(**OPTS, dtype="float32"), draft=trained_dir / "draft")


@pytest.fixture(scope="module")
def engines(spec_engine_dir):
    torch.set_num_threads(1)  # tiny ops: threads only add hand-offs (engine_helpers.one_thread)
    return {m: Engine.from_dir(spec_engine_dir, device="cpu", speculative=s)
            for m, s in (("off", False), ("fixed", None), ("adaptive", SpecConfig(adaptive=True)))}


def chat_prompts(engine, n: int, seed: int = 99) -> list[list[int]]:
    from beam_trtllm.train.dialogues import dialogues

    return [engine.tokenizer.encode(e.prompt) for e in dialogues(n, seed)][:n]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_greedy_output_is_the_targets_bit_for_bit(engines):
    """One request at a time (BF16 engine): drafts on (fixed and adaptive) give the drafts-off
    tokens and the same logprobs bit for bit, since each verify row attends as the decode step
    at its position would (batch.py) and every other op is row-wise. Drafts are accepted."""
    prompts = chat_prompts(engines["off"], 6)
    sp = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)
    ref = [engines["off"].generate([p], sp)[0] for p in prompts]
    for mode in ("fixed", "adaptive"):
        eng = engines[mode]
        before = dict(eng.spec.stats)
        for p, r in zip(prompts, ref):
            got = eng.generate([p], sp)[0]
            assert got["token_ids"] == r["token_ids"], mode
            assert [x.logprob for x in got["logprobs"]] == [x.logprob for x in r["logprobs"]]
        steps = eng.spec.stats["spec_verify_steps"] - before["spec_verify_steps"]
        acc = eng.spec.stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        assert steps > 0 and (acc + steps) / steps > 1.5, (mode, steps, acc)


def test_batched_greedy_output_is_the_targets(spec_fp32_engine_dir):
    """Twelve requests at once (FP32 engine: the experts' BF16 GEMMs group a step's tokens by
    expert, so in BF16 a row's last bits depend on its batch, with or without drafts)."""
    off = Engine.from_dir(spec_fp32_engine_dir, device="cpu", speculative=False)
    on = Engine.from_dir(spec_fp32_engine_dir, device="cpu", speculative=SpecConfig(adaptive=True))
    prompts = chat_prompts(off, 12)
    ref = [r["token_ids"] for r in off.generate(prompts, greedy(40))]
    assert [r["token_ids"] for r in on.generate(prompts, greedy(40))] == ref
    assert on.spec.stats["spec_accepted_tokens"] > 0


def test_batching_chunks_prefix_hits_and_abort(engines):
    """Ragged arrivals, chunked prompts (max_num_tokens 96), a repeated prompt (prefix hit) and
    an abort mid-decode: each request's tokens are those of the drafts-off engine."""
    prompts = chat_prompts(engines["off"], 5, seed=7)
    long = prompts[0] * 2  # > one step's budget: chunked prefill
    plan = {0: [("a", long, greedy(30)), ("b", prompts[1], greedy(24))],
            3: [("c", prompts[2], greedy(20)), ("a2", long, greedy(30))],
            6: [("d", prompts[3], SamplingParams(max_tokens=25, ignore_eos=True,
                                                 temperature=0.8, seed=5))]}
    out = {}
    for mode in ("off", "fixed"):
        eng = engines[mode]

        def on_step(step, eng=eng):
            if step == 8:
                eng.abort("b")
        out[mode] = drive(eng, plan, on_step=on_step)
        assert_all_free(eng)
    for rid in ("a", "a2", "c"):
        assert out["fixed"][rid]["tokens"] == out["off"][rid]["tokens"], rid
    assert out["fixed"]["b"]["finish_reason"] == "abort"
    assert engines["fixed"].blocks.stats["hits"] > 0
    # a seeded sampled request is lossless in distribution, not token for token: its own check
    assert len(out["fixed"]["d"]["tokens"]) == 25


def test_verify_graph_padding_matches_eager(spec_engine_dir, engines):
    """The CUDA-graph paths' static buffers and padding, run eagerly on the CPU: decode, verify
    (q = 1 + N tokens per sequence, fewer drafts padded) and the draft step (padding rows at
    negative positions): the same tokens as the unpadded steps."""
    eng = Engine.from_dir(spec_engine_dir, device="cpu")
    n = eng.spec.num_tokens
    kw = dict(capture=False, sizes=(1, 4), capture_layers=eng.capture, ring_len=eng.kv.ring_len,
              after=eng.spec.in_graph)  # the drafter context inside the graph, as on CUDA
    eng.graphs = DecodeGraphs(eng.model, eng.options, eng.kv_plan, eng.cfg, eng.device, **kw)
    eng.verify_graphs = {n: DecodeGraphs(eng.model, eng.options, eng.kv_plan, eng.cfg,
                                         eng.device, tokens_per_seq=1 + n, **kw)}
    eng.spec.graphs = eng.spec.make_graphs((1, 4), capture=False)  # the draft step's
    prompts = chat_prompts(eng, 3, seed=3)
    got = [r["token_ids"] for r in eng.generate(prompts, greedy(30))]
    ref = [r["token_ids"] for r in engines["off"].generate(prompts, greedy(30))]
    assert got == ref
    assert eng.stats["graph_steps"] > 5


def test_draft_graph_packs_the_estimators_features(spec_fp32_engine_dir):
    """Adaptive: the draft graph computes the estimator's features and packs them after the
    drafts (one host read, no launches after the replay): the same numbers as packing them
    eagerly, and the adaptive engine's tokens through that path are the drafts-off ones (FP32:
    the counts follow measured step costs, and in BF16 a row's bits follow its batch)."""
    off = Engine.from_dir(spec_fp32_engine_dir, device="cpu", speculative=False)
    eng = Engine.from_dir(spec_fp32_engine_dir, device="cpu",
                          speculative=SpecConfig(adaptive=True))
    spec = eng.spec
    spec.graphs = spec.make_graphs((1, 4), capture=False)
    seen = []
    admit = spec._admit

    def check(out, temps, rooms, packed=None):
        assert packed is not None and packed.shape == (len(rooms), spec.block + spec.num_tokens)
        eager = torch.cat([out.tokens.double(), spec._features(out.cand_scores, temps).double()], 1)
        assert torch.equal(packed, eager)
        seen.append(len(rooms))
        return admit(out, temps, rooms, packed)
    spec._admit = check
    prompts = chat_prompts(eng, 3, seed=4)
    got = [r["token_ids"] for r in eng.generate(prompts, greedy(24))]
    assert got == [r["token_ids"] for r in off.generate(prompts, greedy(24))]
    assert len(seen) > 3 and spec.stats["spec_accepted_tokens"] > 0


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """p-value of Pearson's chi-square (dof = bins - 1; the bins cover all outcomes)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_temperature_one_samples_the_targets_distribution(engines):
    """At temperature 1 the second token is produced by verification (the first comes from the
    prefill). Given the first token t*, its distribution must be the target's p(. | ctx, t*):
    chi-square over the tokens the target gives >= 5 expected samples, plus the rest."""
    from beam_trtllm.train.data import is_heldout, read_source, stdlib_files, stdlib_root

    eng, off = engines["fixed"], engines["off"]
    root = stdlib_root()
    text = next(t for rel in stdlib_files(root) if is_heldout(rel)
                and (t := read_source(root, rel)) and len(t) > 2000)
    ctx = off.tokenizer.encode(text[1000:1300])
    first = off.generate([ctx], greedy(1))[0]["token_ids"][0]
    probs = off.generate([ctx + [first]], SamplingParams(max_tokens=1, logprobs=20))[0]
    top = dict(probs["logprobs"][0].top)
    n, seconds = 0, []
    before = dict(eng.spec.stats)
    for base in range(0, 720, 12):
        batch = [SamplingParams(max_tokens=3, temperature=1.0, seed=base + i, ignore_eos=True)
                 for i in range(12)]
        for i, sp in enumerate(batch):
            eng.add_request(f"t{base + i}", ctx, sp)
        res = {}
        while eng.has_unfinished():
            for out in eng.step():
                res.setdefault(out.request_id, []).extend(out.new_token_ids)
        for toks in res.values():
            if toks[0] == first:
                seconds.append(toks[1])
    assert eng.spec.stats["spec_verify_steps"] > before["spec_verify_steps"]
    n = len(seconds)
    assert n >= 150, f"only {n} samples began with the most likely token"
    bins = [t for t, lp in top.items() if math.exp(lp) * n >= 5]
    expected = [math.exp(top[t]) * n for t in bins]
    observed = [seconds.count(t) for t in bins]
    rest_e, rest_o = n - sum(expected), n - sum(observed)
    if rest_e >= 5:
        expected.append(rest_e)
        observed.append(rest_o)
    else:  # too rare for a bin of its own: merged into the last one
        expected[-1] += rest_e
        observed[-1] += rest_o
    p = chi_square_p(observed, expected)
    assert p > 1e-3, (p, bins, observed, expected)


def test_drafter_that_does_not_fit_is_refused(trained_dir, tmp_path):
    bad = tmp_path / "draft"
    shutil.copytree(trained_dir / "draft", bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["vocab_size"] += 1
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(EngineError, match="vocab_size"):
        build_engine(trained_dir, tmp_path / "e", BuildOptions(**OPTS), draft=bad)
    with pytest.raises(EngineError, match="no drafter"):
        Engine.from_dir(build_engine(trained_dir, tmp_path / "plain", BuildOptions(**OPTS)),
                        device="cpu", speculative=True)


def test_disaggregated_handoff_carries_the_drafters_context(spec_engine_dir, engines):
    """Prefill engine -> decode engine, drafts on both: the handoff moves the drafter's paged
    K/V of the prompt with the target's (kv_layers), and the decode side's greedy output is
    the drafts-off engine's."""
    from dataclasses import replace

    prefill = Engine.from_dir(spec_engine_dir, device="cpu")
    decode = Engine.from_dir(spec_engine_dir, device="cpu")
    decode.generate(chat_prompts(decode, 1, seed=5), greedy(3))  # other block ids there
    ps = chat_prompts(prefill, 3, seed=21)
    for k, p in enumerate(ps):
        prefill.add_request(f"r{k}", p, greedy(1), prefill_only=True)
    while prefill.has_unfinished():
        prefill.step()
    nl = prefill.cfg.num_hidden_layers
    for k, p in enumerate(ps):
        src = prefill.kv_export(f"r{k}")
        assert len(src.layers) == nl + prefill.spec.kv.cache.shape[0]
        dst = decode.kv_reserve(f"r{k}", src.num_tokens)
        transport(src, dst)
        s_idx, d_idx = torch.tensor(src.block_ids), torch.tensor(dst.block_ids)
        assert torch.equal(decode.spec.kv.cache[:, :, d_idx], prefill.spec.kv.cache[:, :, s_idx])
        prefill.release(f"r{k}")
        decode.add_request(f"r{k}", p, greedy(30),
                           kv_reserved=replace(dst, first_token=src.first_token))
    got = {}
    while decode.has_unfinished():
        for out in decode.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    ref = engines["off"].generate(ps, greedy(30))
    assert [got[f"r{k}"] for k in range(3)] == [r["token_ids"] for r in ref]
    assert decode.spec.stats["spec_accepted_tokens"] > 0
    assert_all_free(prefill)
    assert_all_free(decode)


def record_steps(eng) -> list[list]:
    """[chunk kinds, rows] of each target forward (kinds: "decode" for decode and verify chunks,
    "prefill"); rows: the forward's token rows, padding included."""
    steps, forward, model_forward = [], eng._forward, eng.model.forward

    def on_forward(chunks, input_ids=None):
        steps.append([{"decode" if c.n == 1 + len(c.drafts) and c.start >= c.request.full_cached
                       else "prefill" for c in chunks}, None])
        return forward(chunks, input_ids)

    def on_model_forward(s, *args, **kw):
        if steps and steps[-1][1] is None:
            steps[-1][1] = int(s.input_ids.shape[0])
        return model_forward(s, *args, **kw)
    eng._forward, eng.model.forward = on_forward, on_model_forward
    return steps


def test_batch_invariant_steps_run_one_shape_and_stay_lossless(spec_fp32_engine_dir):
    """Batch-invariant mode, ragged arrivals and a chunked prompt (FP32 engine, as above): every
    decode and verify step runs max_batch x (1 + the drafter's draft tokens) rows with or
    without drafts, none shares a step with a prefill chunk, and drafts on give the drafts-off
    tokens. The default mode mixes the two kinds in this plan, and its tokens are the same."""
    base = Engine.from_dir(spec_fp32_engine_dir, device="cpu", speculative=False)
    prompts = chat_prompts(base, 4, seed=11)
    plan = {0: [("a", prompts[0] * 2, greedy(24)), ("b", prompts[1], greedy(20))],
            2: [("c", prompts[2], greedy(20))], 5: [("d", prompts[3], greedy(16))]}
    out, steps = {}, {}
    for mode, spec, inv in (("default", False, False), ("off", False, True),
                            ("on", SpecConfig(), True)):
        eng = base if mode == "default" else Engine.from_dir(
            spec_fp32_engine_dir, device="cpu", speculative=spec, batch_invariant=inv)
        steps[mode] = record_steps(eng)
        out[mode] = drive(eng, plan)
        assert_all_free(eng)
    assert any(len(kinds) == 2 for kinds, _ in steps["default"])
    rows = OPTS["max_batch"] * (1 + eng.spec.num_tokens)
    for mode in ("off", "on"):
        assert all(len(kinds) == 1 for kinds, _ in steps[mode]), mode
        assert {r for kinds, r in steps[mode] if kinds == {"decode"}} == {rows}, mode
        assert any(kinds == {"prefill"} for kinds, _ in steps[mode])
    for rid in "abcd":
        assert out["on"][rid]["tokens"] == out["off"][rid]["tokens"] == \
            out["default"][rid]["tokens"], rid


def test_batch_invariant_rows_must_hold_every_verify_row(spec_engine_dir):
    """An explicit row count below max_batch x (1 + drafts) is refused, naming both."""
    with pytest.raises(EngineError, match=r"batch_invariant=16 rows: max_batch 8 x \(1 \+ 7 "
                                          r"drafts\) = 64 rows do not fit"):
        Engine.from_dir(spec_engine_dir, device="cpu", batch_invariant=16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: its kernels pick launch "
                    "shapes by size, which is what the mode pins")
def test_batch_invariant_drafts_on_give_the_drafts_off_tokens_on_the_gpu(trained_dir, tmp_path):
    """BF16 on the GPU, CUDA graphs and every kernel: in batch-invariant mode 24 prompts 8 at a
    time give the drafts-off tokens with drafts on (fixed and adaptive), where the default
    mode's verify steps (more rows than a decode step) may flip near-ties."""
    path = build_engine(trained_dir, tmp_path / "e", BuildOptions(
        **OPTS, target="sm90", autotune="off", cuda_graph_batch_sizes=(1, 8)),
        draft=trained_dir / "draft")
    engines = {m: Engine.from_dir(path, device="cuda", speculative=s, batch_invariant=True)
               for m, s in (("off", False), ("fixed", SpecConfig(compile=False)),
                            ("adaptive", SpecConfig(adaptive=True, compile=False)))}
    prompts = chat_prompts(engines["off"], 24, seed=5)
    batches = [prompts[i:i + 8] for i in range(0, 24, 8)]
    ref = [r["token_ids"] for b in batches for r in engines["off"].generate(b, greedy(48))]
    for mode in ("fixed", "adaptive"):
        got = [r["token_ids"] for b in batches for r in engines[mode].generate(b, greedy(48))]
        assert got == ref, mode
        assert engines[mode].spec.stats["spec_accepted_tokens"] > 0
        assert engines[mode].stats["graph_steps"] > 10
        assert engines[mode].stats["spec_chained_steps"] > 10  # (spec_chain.py)
