"""One side of a two-process NIXL KV transfer (run by tests/test_nixl_kv.py).

prefill: fill seeded cache tensors, write the handle of blocks/ring row to a file, wait for
         the decode side's notification, write what arrived ("done:<id>" / "fail:<id>").
decode:  wait for the handle file, READ it into other block ids, check every byte against the
         seeded data, write {"ok": ..., "seconds": ...} or the error.
"""

import json
import sys
import time
from pathlib import Path

import torch

from dynamo_graphs.nixl_kv import CacheTensor, KvTransferError, NixlKvTransport

# A cache with awkward sizes: 3 full layers' K and V (13 blocks of 5 tokens x 2 heads x 6),
# two sliding layers' K and V rings (4 rows of 7 slots x 2 x 6), bf16 like the engine's.
BLOCK_SHAPE, RING_SHAPE = (13, 5, 2, 6), (4, 7, 2, 6)


def make_tensors(seed: int | None) -> list[CacheTensor]:
    gen = torch.Generator().manual_seed(seed or 0)
    out = []
    for kind, shape, n in (("block", BLOCK_SHAPE, 6), ("ring", RING_SHAPE, 4)):
        for _ in range(n):
            t = torch.randn(shape, generator=gen).to(torch.bfloat16)
            out.append(CacheTensor(kind, t if seed is not None else torch.zeros_like(t)))
    return out


def prefill(workdir: Path, block_ids, ring_row, wait_s: float) -> None:
    transport = NixlKvTransport(f"prefill-test-{time.time_ns()}", make_tensors(seed=7))
    handle = transport.export("req-1", block_ids, ring_row)
    tmp = workdir / "handle.json.tmp"
    tmp.write_text(json.dumps(handle))
    tmp.rename(workdir / "handle.json")
    deadline = time.monotonic() + wait_s
    got = []
    while time.monotonic() < deadline and not got:
        got = transport.poll()
        time.sleep(0.01)
    (workdir / "prefill.json").write_text(json.dumps({"notifications": got}))
    transport.close()


def decode(workdir: Path, local_ids, local_row, timeout_s: float) -> None:
    tensors = make_tensors(seed=None)
    transport = NixlKvTransport(f"decode-test-{time.time_ns()}", tensors)
    path = workdir / "handle.json"
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    handle = json.loads(path.read_text())
    if (workdir / "kill-prefill-first").exists():
        while not (workdir / "prefill-dead").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    start = time.monotonic()
    try:
        seconds = transport.read(handle, local_ids, local_row, timeout_s)
    except KvTransferError as exc:
        result = {"ok": False, "error": str(exc), "seconds": time.monotonic() - start}
    else:
        expected = make_tensors(seed=7)
        mismatches = 0
        for mine, ref in zip(tensors, expected):
            src = handle["block_ids"] if mine.kind == "block" else [handle["ring_row"]]
            dst = local_ids if mine.kind == "block" else [local_row]
            for s, d in zip(src, dst):
                mismatches += int(not torch.equal(mine.tensor[d].view(torch.int16),
                                                  ref.tensor[s].view(torch.int16)))
            untouched = [u for u in range(mine.tensor.shape[0]) if u not in dst]
            mismatches += int(bool(mine.tensor[untouched].ne(0).any()))
        result = {"ok": mismatches == 0, "mismatches": mismatches, "seconds": seconds,
                  "nbytes": handle["nbytes"]}
    (workdir / "decode.json").write_text(json.dumps(result))
    transport.close()


if __name__ == "__main__":
    role, workdir = sys.argv[1], Path(sys.argv[2])
    ids = json.loads(sys.argv[3])
    row = json.loads(sys.argv[4])
    seconds = float(sys.argv[5])
    (prefill if role == "prefill" else decode)(workdir, ids, row, seconds)
