"""Chained speculative steps (beam_trtllm/engine/spec_chain.py): the device-side verify rows
are the host fill's, and a chain gives the step-by-step tokens through arrivals, aborts, stop
tokens and strings and length limits, freeing every block; on the GPU with CUDA graphs too."""

from __future__ import annotations

import pytest
import torch

from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.graphs import DecodeGraphs
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.request import Chunk, Request, State
from beam_trtllm.engine.speculative import SpecConfig
from beam_trtllm.engine.types import SamplingParams
from tests.engine_helpers import drive
from tests.test_engine_disagg import assert_all_free
from tests.test_engine_speculative import OPTS, chat_prompts, greedy, trained_dir  # noqa: F401

SIZES = (1, 4, 8)


@pytest.fixture(scope="module")
def fp32_dir(trained_dir, tmp_path_factory):  # noqa: F811
    return build_engine(trained_dir, tmp_path_factory.mktemp("engines") / "chain32",
                        BuildOptions(**OPTS, dtype="float32"), draft=trained_dir / "draft")


def eager_graphs(eng: Engine, sizes=SIZES, draft_sizes=SIZES) -> Engine:
    """The CUDA-graph steps' buffers and padding, run eagerly (the CPU has no graphs)."""
    kw = dict(capture=False, sizes=sizes, capture_layers=eng.capture, ring_len=eng.kv.ring_len,
              after=eng.spec.in_graph)
    eng.graphs = DecodeGraphs(eng.model, eng.options, eng.kv_plan, eng.cfg, eng.device, **kw)
    eng.verify_graphs = {n: DecodeGraphs(eng.model, eng.options, eng.kv_plan, eng.cfg,
                                         eng.device, tokens_per_seq=1 + n, **kw)
                         for n in eng.spec.verify_counts}
    eng.spec.graphs = eng.spec.make_graphs(draft_sizes, capture=False)
    return eng


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_device_fill_writes_the_host_fills_rows(fp32_dir):
    """fill_device(anchors, start, drafts) writes the verify rows that the host's fill writes for full
    verify chunks: ids, positions, q starts, full-layer slots across block boundaries and ring
    slots past the ring's wrap."""
    eng = Engine.from_dir(fp32_dir, device="cpu")
    q, bs = 1 + eng.spec.num_tokens, eng.kv_plan.block_size
    g = DecodeGraphs(eng.model, eng.options, eng.kv_plan, eng.cfg, eng.device, capture=False,
                     sizes=SIZES, ring_len=eng.kv.ring_len, tokens_per_seq=q)
    gen = torch.Generator().manual_seed(3)
    chunks = []
    for i, start in enumerate((13, 97, 300)):  # mid-block, just before a wrap, far along
        req = Request(f"r{i}", list(range(start + 1)), greedy(64), i, start + 80)
        req.block_ids = torch.randperm(200, generator=gen)[:cdiv(start + q, bs)].tolist()
        req.ring_row, req.hist_start, req.num_computed = 2 * i + 1, 5 * i, start
        req.state = State.RUNNING
        drafts = tuple(torch.randint(0, 500, (q - 1,), generator=gen).tolist())
        chunks.append(Chunk(req, start, q, drafts))
    g._fill(chunks, g.size_for(len(chunks)))
    host = {k: t.clone() for k, t in g.buf.items()}
    rows = len(chunks) * q
    ids = g.buf["input_ids"][:rows].view(-1, q).clone()
    start = g.buf["positions"][:rows:q].clone()
    for k in ("input_ids", "positions", "q_start", "slot_full", "slot_sliding"):
        g.buf[k][:rows].fill_(-7)
    g.fill_device(ids[:, 0].clone(), start, ids[:, 1:].clone(),
                  torch.ones(len(chunks), dtype=torch.int64))
    for k, t in host.items():
        assert torch.equal(g.buf[k], t), k


def test_take_rows_copies_the_host_fills_tables_rings_and_sliding_starts(fp32_dir):
    """A chain's other draft counts take the block tables, rings and sliding starts of their
    sequences from the started count's rows on the device: what their own host fill writes."""
    eng = Engine.from_dir(fp32_dir, device="cpu")
    kw = dict(capture=False, sizes=SIZES, ring_len=eng.kv.ring_len)
    src, dst = (DecodeGraphs(eng.model, eng.options, eng.kv_plan, eng.cfg, eng.device,
                             tokens_per_seq=q, **kw) for q in (8, 3))
    gen = torch.Generator().manual_seed(5)
    reqs = []
    for i, start in enumerate((40, 211, 7)):
        req = Request(f"r{i}", list(range(start + 1)), greedy(64), i, start + 80)
        req.block_ids = torch.randperm(300, generator=gen)[:cdiv(start + 8, 16) + 1].tolist()
        req.ring_row, req.hist_start, req.num_computed = 3 * i + 2, 9 * i + 1, start
        req.state = State.RUNNING
        reqs.append(req)
    src._fill([Chunk(r, r.num_computed, 8, (1,) * 7) for r in reqs], 4)
    dst._fill([Chunk(r, r.num_computed, 3, (2,) * 2) for r in reqs], 4)
    want = {k: dst.buf[k].clone() for k in ("block_table", "ring_index", "hist_sliding")}
    for t in want:
        dst.buf[t].fill_(-3)
    dst.take_rows(src, len(reqs))
    for k, t in want.items():
        assert torch.equal(dst.buf[k][:3 * len(reqs)], t[:3 * len(reqs)]), k


def test_chained_steps_give_the_step_by_step_tokens(fp32_dir):
    """Three long greedy requests chain; a fourth arrives mid-chain, one is aborted, one
    stops at a stop string and one at its length limit: every request's tokens are those of
    the engine with drafts off, and every block is free at the end."""
    off = Engine.from_dir(fp32_dir, device="cpu", speculative=False)
    torch.set_num_threads(1)
    ps = chat_prompts(off, 4, seed=31)
    text = off.generate([ps[2]], greedy(120))[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 6]  # a string its output reaches mid-way
    params = {"a": greedy(140), "b": greedy(140), "c": SamplingParams(max_tokens=140,
              ignore_eos=True, stop=[stop]), "d": SamplingParams(max_tokens=90)}
    plan = {0: [("a", ps[0], params["a"]), ("b", ps[1], params["b"]), ("c", ps[2], params["c"])],
            20: [("d", ps[3], params["d"])]}
    ref = {rid: off.generate([p], params[rid])[0]
           for rid, p in zip("abcd", ps)}
    on = eager_graphs(Engine.from_dir(fp32_dir, device="cpu", overlap=True))
    chained = []

    def on_step(step):
        chained.append(on.stats["spec_chained_steps"])
        if step == 40:
            on.abort("b")
    got = drive(on, plan, on_step=on_step)
    for rid in "acd":
        assert got[rid]["tokens"] == ref[rid]["token_ids"], rid
        assert got[rid]["finish_reason"] == ref[rid]["finish_reason"], rid
    assert got["c"]["finish_reason"] == "stop" and len(got["c"]["tokens"]) < 140
    assert got["b"]["finish_reason"] == "abort"
    assert got["b"]["tokens"] == ref["b"]["token_ids"][:len(got["b"]["tokens"])]
    assert chained[19] > 3 and chained[-1] > chained[25] > chained[19]  # chains, then again
    assert_all_free(on)


@pytest.mark.parametrize("sizes", [(SIZES, SIZES), ((8,), (1, 4))], ids=["same", "verify-wider"])
def test_a_chain_outlives_its_requests_ending(fp32_dir, sizes):
    """Three requests of different lengths start together: one chain carries all of them to
    the end (an ended request's rows turn to padding rows, the others go on), with the
    drafts-off tokens and every block free at the end; also where the verify graph is wider
    than the largest draft graph (batch-invariant mode: one verify size, max_batch)."""
    off = Engine.from_dir(fp32_dir, device="cpu", speculative=False)
    torch.set_num_threads(1)
    on = eager_graphs(Engine.from_dir(fp32_dir, device="cpu", overlap=True), *sizes)
    starts, start = [], on._chain_start

    def count(chunks):
        starts.append(len(chunks))
        return start(chunks)
    on._chain_start = count
    ps = chat_prompts(off, 3, seed=51)
    params = [greedy(n) for n in (70, 110, 150)]
    ref = [off.generate([p], sp)[0]["token_ids"] for p, sp in zip(ps, params)]
    plan = {0: [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]}
    got = drive(on, plan)
    assert [got[f"r{i}"]["tokens"] for i in range(3)] == ref
    assert starts == [3] and on.stats["spec_chained_steps"] > 15, starts
    assert_all_free(on)


def test_adaptive_chain_picks_counts_and_stays_lossless(fp32_dir):
    """Adaptive verification on chained steps: the budget (here with step costs that grow
    with the draft count, as a GPU-bound step's do) picks among the captured counts from the
    step before's scores, the estimator keeps learning, and the tokens are the drafts-off
    engine's."""
    from beam_trtllm.spec.adaptive import GraphBudget

    off = Engine.from_dir(fp32_dir, device="cpu", speculative=False)
    torch.set_num_threads(1)
    eng = Engine.from_dir(fp32_dir, device="cpu", overlap=True,
                          speculative=SpecConfig(adaptive=True))
    eng = eager_graphs(eng)
    eng.spec.graphs = eng.spec.make_graphs(SIZES, capture=False)  # with the features
    counts = eng.spec.verify_counts
    eng.spec.graph_budget = GraphBudget({b: 1e-3 for b in SIZES},
                                        {(b, n): 1e-3 * (1 + n) for b in SIZES for n in counts})
    chosen, pick = [], eng._chain_count

    def record(step):
        chosen.append(pick(step))
        return chosen[-1]
    eng._chain_count = record
    observed, observe = [0], eng.spec._observe

    def count_rows(feats, num, accepted):
        observed[0] += len(num)
        observe(feats, num, accepted)
    eng.spec._observe = count_rows
    ps = chat_prompts(off, 3, seed=41)
    ref = [r["token_ids"] for r in off.generate(ps, greedy(120))]
    assert [r["token_ids"] for r in eng.generate(ps, greedy(120))] == ref
    assert eng.stats["spec_chained_steps"] > 10 and len(set(chosen)) >= 2, chosen
    assert observed[0] == eng.spec.stats["spec_verify_steps"]  # every landed step, chained too
    assert_all_free(eng)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA graphs")
def test_chained_steps_on_the_gpu_give_the_step_by_step_tokens(trained_dir, tmp_path):  # noqa: F811
    """BF16, CUDA graphs, every kernel: the chained engine's tokens are the step-by-step
    speculative engine's (the same graphs replay the same rows), 8 requests at a time."""
    path = build_engine(trained_dir, tmp_path / "e", BuildOptions(
        **OPTS, target="sm90", autotune="off", cuda_graph_batch_sizes=(1, 8)),
        draft=trained_dir / "draft")
    step = Engine.from_dir(path, device="cuda", overlap=False)
    chain = Engine.from_dir(path, device="cuda")
    ps = chat_prompts(step, 16, seed=8)
    for batch in (ps[:8], ps[8:9]):
        ref = [r["token_ids"] for r in step.generate(batch, greedy(96))]
        assert [r["token_ids"] for r in chain.generate(batch, greedy(96))] == ref
    assert chain.stats["spec_chained_steps"] > 10 and step.stats["spec_chained_steps"] == 0
