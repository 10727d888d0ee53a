"""KV offload tiers (dynamo_graphs/offload.py): exact bytes back, LRU order, budgets."""

import pytest
import torch

from dynamo_graphs.offload import KvTiers

# One block of the tiny Beam's full layers: [n_full=3, K/V, block_size=16, Hkv=2, D=16].
SHAPE = (3, 2, 16, 2, 16)


def _block(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(SHAPE, generator=g) * 3).to(dtype)


def _nbytes(dtype):
    return torch.empty(SHAPE, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_come_back_bit_exact_from_host_and_disk(tmp_path, dtype):
    per = _nbytes(dtype)
    tiers = KvTiers(host_bytes=2 * per, disk_bytes=3 * per, disk_dir=tmp_path / "kv")
    blocks = {h: _block(h, dtype) for h in range(100, 106)}
    for h, kv in blocks.items():
        tiers.offload(h, None, tuple(range(16)), kv)
    u = tiers.usage()
    # 6 offloaded: the 2 newest in host, the 3 before them on disk, the oldest dropped.
    assert (u["host_blocks"], u["disk_blocks"], u["dropped"]) == (2, 3, 1)
    assert [tiers.contains(h) for h in blocks] == [None, "disk", "disk", "disk", "host", "host"]
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == [
        f"{h:016x}.kv" for h in (101, 102, 103)]
    assert tiers.fetch(100) is None
    for h in (105, 101):  # a host hit, then a disk hit (promoted to host)
        got = tiers.fetch(h)
        assert got.dtype == dtype and got.shape == SHAPE
        assert torch.equal(got.view(torch.uint8), blocks[h].view(torch.uint8))
    assert tiers.contains(101) == "host"
    u = tiers.usage()
    assert (u["host_hits"], u["disk_hits"], u["misses"]) == (1, 1, 1)
    assert u["host_bytes"] == 2 * per and u["disk_bytes"] <= 3 * per


def test_lru_keeps_recently_fetched_blocks_and_budgets_hold(tmp_path):
    per = _nbytes(torch.bfloat16)
    tiers = KvTiers(host_bytes=3 * per)  # no disk tier: evicted host blocks are dropped
    for h in (1, 2, 3):
        tiers.offload(h, None, (), _block(h, torch.bfloat16))
    assert tiers.fetch(1) is not None  # 1 becomes most recent
    tiers.offload(4, None, (), _block(4, torch.bfloat16))
    assert [tiers.contains(h) for h in (1, 2, 3, 4)] == ["host", None, "host", "host"]
    assert tiers.usage()["dropped"] == 1 and tiers.usage()["host_bytes"] == 3 * per


def test_stale_disk_blocks_of_an_earlier_run_are_cleared(tmp_path):
    d = tmp_path / "kv"
    d.mkdir()
    (d / "00000000000000ff.kv").write_bytes(b"x" * 10)
    KvTiers(host_bytes=1, disk_bytes=1 << 20, disk_dir=d)
    assert list(d.iterdir()) == []
