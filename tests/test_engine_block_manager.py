"""Block manager: exact accounting, LRU eviction, chained prefix hashes, KV events and the
secondary-tier hooks (checked exactly: data movement, not numerics)."""

from __future__ import annotations

import pytest
import torch

from beam_trtllm.engine.block_manager import BlockManager, block_hash, chain_hashes
from beam_trtllm.engine.types import EngineError, StoredBlock


def filled(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate blocks for `tokens` and register its full blocks, as a finished prefill does."""
    bs = bm.block_size
    ids = bm.allocate(-(-len(tokens) // bs))
    parent = None
    for b, h in enumerate(chain_hashes(tokens, bs)):
        bm.register(ids[b], h, parent, tokens[b * bs:(b + 1) * bs])
        parent = h
    return ids


def test_chain_hashes_depend_on_every_earlier_token():
    a = list(range(12))
    b = a.copy()
    b[1] = 99
    ha, hb = chain_hashes(a, 4), chain_hashes(b, 4)
    assert len(ha) == 3 and all(x != y for x, y in zip(ha, hb))
    assert ha[2] == block_hash(ha[1], a[8:12]) and ha[0] == block_hash(None, a[:4])
    assert chain_hashes(a[:11], 4) == ha[:2]  # partial blocks are never hashed
    assert all(0 <= h < 2**63 for h in ha)


def test_allocate_free_accounting_is_exact():
    bm = BlockManager(10, 4)
    x, y = bm.allocate(3), bm.allocate(7)
    assert bm.num_free == 0 and bm.num_used == 10 and sorted(x + y) == list(range(10))
    with pytest.raises(EngineError, match="1 blocks requested, 0 free"):
        bm.allocate(1)
    bm.free(x)
    assert bm.num_free == 3
    bm.free(y)
    assert bm.num_free == 10
    bm.check()
    with pytest.raises(EngineError, match="freed more often than allocated"):
        bm.free([x[0]])


def test_prefix_match_shares_blocks_and_counts_references():
    bm = BlockManager(16, 4)
    prompt = list(range(100, 111))  # 2 full blocks + 3 tokens
    a = filled(bm, prompt)
    assert bm.num_cached == 2
    hit = bm.match_prefix(prompt + [7, 8], max_blocks=3)
    assert hit == a[:2] and [bm.ref_count(b) for b in a] == [2, 2, 1]
    bm.free(a)
    assert bm.num_used == 2  # the sharer still holds the prefix
    bm.free(hit)
    assert bm.num_used == 0 and bm.num_cached == 2  # free, but still reusable
    assert bm.match_prefix(prompt, max_blocks=2) == a[:2]
    assert bm.match_prefix([1] + prompt[1:], max_blocks=2) == []  # first token differs
    bm.check()


def test_lru_eviction_takes_tails_first_and_reports_removals():
    bm = BlockManager(6, 2)
    a = filled(bm, [1, 2, 3, 4, 5, 6])
    bm.free(a)
    bm.drain_events()
    got = bm.allocate(3)  # the never-used blocks go first, then a's tail before its head
    assert set(got).isdisjoint(a)
    got += bm.allocate(1)
    assert got[-1] == a[2]
    hashes = chain_hashes([1, 2, 3, 4, 5, 6], 2)
    assert bm.drain_events() == [("removed", [hashes[2]])]
    assert bm.match_prefix([1, 2, 3, 4, 5, 6, 7], max_blocks=3) == a[:2]
    bm.check()


def test_stored_events_carry_real_token_ids_and_parent_links():
    bm = BlockManager(8, 3)
    tokens = [5, 6, 7, 8, 9, 10, 11]
    filled(bm, tokens)
    h = chain_hashes(tokens, 3)
    assert bm.drain_events() == [("stored", [StoredBlock(h[0], None, (5, 6, 7)),
                                             StoredBlock(h[1], h[0], (8, 9, 10))])]
    # the same prefix computed twice: the second copy stays private, no second event
    b = filled(bm, tokens)
    assert bm.drain_events() == [] and bm.num_cached == 2
    bm.free(b)
    assert bm.num_free == 8 - 3 and bm.hash_of(b[0]) is None


def test_offload_and_fetch_tier_round_trip():
    """A dict as the secondary tier: evicted blocks are offloaded with their KV and token ids;
    a later prefix miss fetches them back into fresh blocks, bit for bit."""
    store = torch.zeros(8, 2, 4)  # [block, K/V, 4 values]
    def read(b):
        return store[b].clone()

    def write(b, kv):
        store[b].copy_(kv)
    tier: dict[int, tuple] = {}
    bm = BlockManager(8, 2, read, write)
    bm.offload = lambda h, parent, tokens, kv: tier.__setitem__(h, (parent, tokens, kv))
    bm.fetch = lambda h: tier[h][2] if h in tier else None
    tokens = [1, 2, 3, 4, 5, 6, 7]
    a = filled(bm, tokens)
    for i, b in enumerate(a):
        store[b] = float(i + 1)
    bm.free(a)
    bm.allocate(8)  # evicts all three cached blocks
    h = chain_hashes(tokens, 2)
    assert sorted(tier) == sorted(h)
    assert tier[h[1]][:2] == (h[0], (3, 4)) and torch.equal(tier[h[2]][2], torch.full((2, 4), 3.0))
    bm.free(list(range(8)))
    bm.drain_events()
    got = bm.match_prefix(tokens, max_blocks=3)
    assert len(got) == 3 and bm.stats["fetched"] == 3
    assert [float(store[b][0, 0]) for b in got] == [1.0, 2.0, 3.0]
    events = bm.drain_events()
    assert events[-1][0] == "stored" and [s.block_hash for s in events[-1][1]] == h
    bm.check()
