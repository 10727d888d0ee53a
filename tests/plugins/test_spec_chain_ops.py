"""The chained speculative step's two index kernels (plugins/spec_accept.py,
plugins/verify_rows.py) in Triton's interpreter on the CPU (KERNEL_DEVICE on a GPU machine)
against their torch references, bit for bit: acceptance of every length 0..n (ties in the
argmax rows, the bonus row), strided input views, rows across block boundaries and ring
wraps, an ended request's rows turned to padding, and rows past B * q left alone."""

import pytest
import torch

import plugins  # noqa: F401

from kernel_cases import KERNEL_DEVICE
from plugins import spec_accept, verify_rows

pytestmark = pytest.mark.kernel


@pytest.mark.parametrize("b,q", [(1, 8), (5, 3), (9, 5), (3, 1)])
def test_spec_accept_matches_the_reference(b, q):
    g = torch.Generator().manual_seed(b * 10 + q)
    top = torch.randint(0, 50, (b * q + 4,), generator=g)  # rows past B * q: padding
    ids = torch.randint(0, 50, (b, q + 2), generator=g)[:, 1:q + 1]  # a strided view
    rows = top[:b * q].view(b, q)
    for i in range(b):  # sequence i accepts min(i, q - 1) drafts, then misses
        a = min(i, q - 1)
        ids[i, 1:1 + a] = rows[i, :a]
        if a < q - 1:
            ids[i, 1 + a] = rows[i, a] + 1
    start = torch.randint(0, 1000, (b * 2,), generator=g)[::2]
    live = torch.ones(b + 1, dtype=torch.int64)
    live[b // 2] = 0 if b > 2 else 1  # an ended request: the draft graph's padding start
    outs = {}
    for name, fn in (("ref", spec_accept.ref_spec_accept), ("op", torch.ops.beam.spec_accept)):
        dev = "cpu" if name == "ref" else KERNEL_DEVICE
        anchors = torch.full((b + 2,), -5, dtype=torch.int64, device=dev)
        nxt = torch.full((b + 2,), -5, dtype=torch.int64, device=dev)
        packed = torch.full((b + 1, q + 3), -5.0, dtype=torch.float64, device=dev)
        fn(top.to(dev), ids.to(dev), start.to(dev), live.to(dev), anchors, nxt, packed, -9)
        outs[name] = [t.cpu() for t in (anchors, nxt, packed)]
    for got, want in zip(outs["op"], outs["ref"]):
        assert torch.equal(got, want)
    accepted = outs["ref"][2][:b, q].long()
    assert accepted.tolist() == [min(i, q - 1) for i in range(b)]
    on = live[:b].bool().tolist()
    assert outs["ref"][0][:b].tolist() == [rows[i, min(i, q - 1)].item() if on[i] else 0
                                           for i in range(b)]
    assert outs["ref"][1][:b].tolist() == [start[i].item() + min(i, q - 1) + 1 if on[i] else -9
                                           for i in range(b)]
    assert (outs["ref"][0][b:] == -5).all() and (outs["ref"][2][b:] == -5).all()


@pytest.mark.parametrize("b,q,block_size,ring_len", [(1, 8, 16, 15), (4, 3, 4, 11), (7, 5, 8, 9)])
def test_verify_rows_matches_the_reference(b, q, block_size, ring_len):
    g = torch.Generator().manual_seed(b + q)
    rows, width = b * q + 3, 40
    table = torch.randint(0, 500, (rows, width), generator=g, dtype=torch.int32)
    ring = torch.randint(0, 6, (rows, 1), generator=g, dtype=torch.int32)
    anchors = torch.randint(0, 99, (b,), generator=g)
    start = torch.randint(0, width * block_size - q, (b,), generator=g)
    drafts = torch.randint(0, 99, (b, q + 1), generator=g)[:, 1:]  # strided
    live = torch.ones(b, dtype=torch.int64)
    live[-1] = 0 if b > 1 else 1  # an ended request's rows: padding rows
    outs = {}
    for name, fn in (("ref", verify_rows.ref_verify_rows), ("op", torch.ops.beam.verify_rows)):
        dev = "cpu" if name == "ref" else KERNEL_DEVICE
        bufs = [torch.full((rows,), -7, dtype=dt, device=dev)
                for dt in (torch.int64, torch.int64, torch.int32, torch.int64, torch.int64)]
        fn(anchors.to(dev), start.to(dev), drafts.to(dev), live.to(dev), table.to(dev),
           ring.to(dev), *bufs,
           q, block_size, ring_len)
        outs[name] = [t.cpu() for t in bufs]
    for got, want in zip(outs["op"], outs["ref"]):
        assert torch.equal(got, want)
    ids, pos, full = outs["ref"][0], outs["ref"][1], outs["ref"][3]
    on = live.bool().tolist()
    assert ids[:b * q].view(b, q)[:, 0].tolist() == [a if o else 0
                                                     for a, o in zip(anchors.tolist(), on)]
    assert pos[:b * q].view(b, q)[:, 0].tolist() == [s if o else 0
                                                     for s, o in zip(start.tolist(), on)]
    assert ((full[:b * q].view(b, q) >= 0).all(1) == live.bool()).all()  # dead rows: no writes
    assert (ids[b * q:] == -7).all()
