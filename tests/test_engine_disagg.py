"""Serving hooks of the engine: KV events with real token ids, exact usage counts, the
prefill -> decode handoff through exported/reserved KV (a plain tensor copy stands in for
NIXL), freeing pins and reservations on timeout/abort, and the offload tier hooks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_helpers import (  # noqa: F401  (fixtures)
    TINY_OPTS, drive, greedy, one_thread, prompts, ref_fp32, ref_greedy, tiny_engine_dir,
    tiny_fp32_engine_dir,
)

from beam_trtllm.engine.block_manager import chain_hashes
from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.types import EngineError, KVCapacityError, KVHandle

pytestmark = pytest.mark.usefixtures("one_thread")


class Sink:
    def __init__(self):
        self.events = []

    def stored(self, blocks):
        self.events.append(("stored", list(blocks)))

    def removed(self, hashes):
        self.events.append(("removed", list(hashes)))


def transport(src: KVHandle, dst: KVHandle) -> None:
    """What NIXL does in the Dynamo worker: copy block rows and the ring row, layer by layer."""
    assert src.block_size == dst.block_size and src.kv_dtype == dst.kv_dtype
    assert len(src.block_ids) == len(dst.block_ids)
    s_idx, d_idx = torch.tensor(src.block_ids), torch.tensor(dst.block_ids)
    for s, d in zip(src.layers, dst.layers):
        if s.kind == "full":
            d.k[d_idx], d.v[d_idx] = s.k[s_idx], s.v[s_idx]
        else:
            d.k[dst.ring_row], d.v[dst.ring_row] = s.k[src.ring_row], s.v[src.ring_row]


def assert_all_free(engine: Engine) -> None:
    engine.blocks.check()
    assert engine.kv_usage().used_blocks == 0 and engine.kv.free_rows == engine.kv.max_seqs
    assert not engine.requests


def test_kv_events_carry_the_real_token_ids(tiny_engine_dir):
    engine = Engine.from_dir(tiny_engine_dir, device="cpu")
    sink = Sink()
    engine.set_kv_event_sink(sink)
    prompt = prompts(20, [30])[0]
    out = drive(engine, {0: [("a", prompt, greedy(6))]})["a"]["tokens"]
    seq = prompt + out
    stored = [b for kind, blocks in sink.events if kind == "stored" for b in blocks]
    # every block whose 4 positions were computed: the last sampled token is never fed
    n = (len(seq) - 1) // 4
    hashes = chain_hashes(seq, 4)[:n]
    assert [b.token_ids for b in stored] == [tuple(seq[4 * i:4 * i + 4]) for i in range(n)]
    assert [b.block_hash for b in stored] == hashes
    assert [b.parent_hash for b in stored] == [None] + hashes[:-1]
    assert not [e for e in sink.events if e[0] == "removed"]


def test_kv_usage_counts_blocks_exactly(tiny_engine_dir):
    engine = Engine.from_dir(tiny_engine_dir, device="cpu")
    shared = prompts(21, [16])[0]
    engine.generate([shared], greedy(1))  # 4 full blocks of `shared` cached
    seen = []

    def on_step(step):
        held = set()
        for r in engine.scheduler.running:
            held.update(r.block_ids)
        seen.append(engine.kv_usage().used_blocks)
        assert engine.kv_usage().used_blocks == len(held)
    ps = [shared + p for p in prompts(22, [3, 9, 14])]
    drive(engine, {0: [(f"r{k}", p, greedy(5)) for k, p in enumerate(ps)]}, on_step=on_step)
    # the three requests share the 4 cached blocks, so they hold fewer than 3 separate tables
    assert max(seen) < sum(-(-(len(p) + 4) // 4) for p in ps)
    snap = engine.load_snapshot()
    assert snap["kv_used_blocks"] == 0 and snap["kv_total_blocks"] == 160
    assert snap["kv_cached_blocks"] > 0 and snap["prefix_hits"] >= 12


def test_prefill_decode_handoff_matches_one_engine(tiny_fp32_engine_dir, ref_fp32):
    prefill = Engine.from_dir(tiny_fp32_engine_dir, device="cpu")
    decode = Engine.from_dir(tiny_fp32_engine_dir, device="cpu")
    decode.generate(prompts(23, [40]), greedy(3))  # decode engine not empty: other block ids
    ps = prompts(24, [27, 6, 61])
    for k, p in enumerate(ps):
        prefill.add_request(f"r{k}", p, greedy(1), prefill_only=True)
    firsts = {}
    while prefill.has_unfinished():
        for out in prefill.step():
            assert out.finished and out.finish_reason == "length"
            firsts[out.request_id] = out.new_token_ids[0]
    assert prefill.kv_usage().used_blocks == sum(-(-len(p) // 4) for p in ps)  # pinned
    arrivals = {}
    for k, p in enumerate(ps):
        rid = f"r{k}"
        src = prefill.kv_export(rid)
        assert src.first_token == firsts[rid] and src.num_tokens == len(p)
        dst = decode.kv_reserve(rid, src.num_tokens)
        transport(src, dst)
        assert prefill.release(rid) is True
        decode.add_request(rid, p, greedy(8), kv_reserved=replace(dst, first_token=src.first_token))
    assert_all_free(prefill)
    for out in [o for _ in range(12) for o in decode.step()]:
        arrivals.setdefault(out.request_id, []).extend(out.new_token_ids)
    for k, p in enumerate(ps):
        assert arrivals[f"r{k}"] == ref_greedy(ref_fp32, p, 8)
    assert_all_free(decode)


def test_pins_and_reservations_are_freed_on_timeout_or_abort(tiny_engine_dir):
    engine = Engine.from_dir(tiny_engine_dir, device="cpu")
    engine.add_request("p", prompts(25, [21])[0], greedy(1), prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_usage().used_blocks == 6 and engine.kv.free_rows == 3
    r = engine.kv_reserve("d", 33)
    assert len(r.block_ids) == 9 and engine.kv_usage().used_blocks == 15
    with pytest.raises(EngineError, match="the request id is in use"):
        engine.kv_reserve("d", 3)
    with pytest.raises(EngineError, match="kv_reserved.first_token is not set"):
        engine.add_request("d", [1] * 33, greedy(2), kv_reserved=r)
    with pytest.raises(EngineError, match="only a finished prefill_only request"):
        engine.kv_export("d")
    assert engine.abort("d") is True  # a decode request that timed out before its KV arrived
    assert engine.release("p") is True and engine.release("p") is False
    engine.add_request("run", [1, 2, 3], greedy(3))
    engine.step()
    with pytest.raises(EngineError, match="still running; abort it"):
        engine.release("run")
    engine.abort("run")
    engine.step()
    assert_all_free(engine)
    for k in range(4):
        engine.kv_reserve(f"x{k}", 2)
    with pytest.raises(KVCapacityError, match="needs 1 blocks and a ring row; 156 blocks and 0 rows"):
        engine.kv_reserve("x4", 2)
    for k in range(4):
        engine.release(f"x{k}")
    held = engine.blocks.allocate(130)  # memory pressure from elsewhere
    with pytest.raises(KVCapacityError, match="needs 40 blocks and a ring row; 30 blocks"):
        engine.kv_reserve("y", 159)
    engine.blocks.free(held)
    assert_all_free(engine)


def test_offload_tier_serves_evicted_prefixes(tiny_dir, tmp_path, ref_fp32):
    """A dict as the host tier: blocks evicted under memory pressure are offloaded with their
    KV, and a later request with that prefix fetches them back: same tokens, fewer computed
    (FP32 engine: 26 blocks of FP32 KV, token-exact against the model)."""
    opts = BuildOptions(**{**TINY_OPTS, "max_seq_len": 96, "kv_memory_gib": 1.04e-4,
                           "dtype": "float32"})
    engine = Engine.from_dir(build_engine(tiny_dir, tmp_path / "e", opts), device="cpu")
    tier: dict[int, torch.Tensor] = {}
    engine.set_kv_tier(offload=lambda h, parent, tokens, kv: tier.__setitem__(h, kv.clone()),
                       fetch=tier.get)
    sink = Sink()
    engine.set_kv_event_sink(sink)
    first = prompts(26, [60])[0]
    engine.generate([first], greedy(2))
    for p in prompts(27, [80, 80]):  # push `first` out of the 26 blocks
        engine.generate([p], greedy(2))
    assert all(h in tier for h in chain_hashes(first, 4))
    removed = {h for kind, hs in sink.events if kind == "removed" for h in hs}
    assert set(chain_hashes(first, 4)) <= removed == set(tier)  # every eviction reported
    before = engine.blocks.stats["fetched"]
    follow = first + prompts(28, [5])[0]
    assert engine.generate([follow], greedy(6))[0]["token_ids"] == ref_greedy(ref_fp32, follow, 6)
    assert engine.blocks.stats["fetched"] - before == 15
    assert_all_free(engine)
