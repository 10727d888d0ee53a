"""NIXL KV transport between two real processes over UCX on loopback (dynamo_graphs/nixl_kv.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl._api")

from dynamo_graphs.launch import loopback_env  # noqa: E402
from dynamo_graphs.nixl_kv import CacheTensor, KvTransferError, NixlKvTransport  # noqa: E402

PEER = Path(__file__).parent / "helpers" / "nixl_peer.py"
ROOT = Path(__file__).resolve().parents[1]


def _peer(role, workdir, ids, row, seconds):
    env = loopback_env(workdir)
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen([sys.executable, str(PEER), role, str(workdir), json.dumps(ids),
                             json.dumps(row), str(seconds)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out


def test_read_moves_exactly_the_requested_blocks_and_ring_row(tmp_path):
    # Remote blocks in an irregular order into different local ids; ring row 2 -> row 0.
    prefill = _peer("prefill", tmp_path, [11, 3, 7, 0], 2, 30)
    decode = _peer("decode", tmp_path, [1, 12, 4, 9], 0, 10)
    _finish(decode, 60)
    _finish(prefill, 60)
    result = json.loads((tmp_path / "decode.json").read_text())
    assert result["ok"], result
    # 6 block tensors x 4 blocks x (5*2*6 bf16) + 4 ring tensors x 1 row x (7*2*6 bf16)
    assert result["nbytes"] == 6 * 4 * 120 + 4 * 168
    # The READ's notification reached the prefill side, which then frees the request's KV.
    assert json.loads((tmp_path / "prefill.json").read_text())["notifications"] == [[True, "req-1"]]


def test_read_from_a_dead_prefill_process_fails_within_its_timeout(tmp_path):
    (tmp_path / "kill-prefill-first").touch()
    prefill = _peer("prefill", tmp_path, [0, 1, 2], 1, 120)
    decode = _peer("decode", tmp_path, [3, 4, 5], 3, 2.0)
    deadline = time.monotonic() + 60
    while not (tmp_path / "handle.json").exists():
        assert time.monotonic() < deadline and prefill.poll() is None
        time.sleep(0.05)
    prefill.send_signal(signal.SIGKILL)
    prefill.wait(timeout=10)
    (tmp_path / "prefill-dead").touch()
    _finish(decode, 60)
    result = json.loads((tmp_path / "decode.json").read_text())
    assert not result["ok"]
    # UCX notices the dead peer either when its metadata is loaded or during the READ.
    assert result["error"].startswith("KV handle req-1:"), result
    assert result["seconds"] < 2.0 + 1.0


def _tensors(block_shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return [CacheTensor("block", torch.randn(block_shape, generator=gen)),
            CacheTensor("ring", torch.randn((3, 4, 2), generator=gen))]


def test_layout_mismatch_is_refused_before_any_transfer():
    a = NixlKvTransport(f"a-{os.getpid()}", _tensors((8, 4, 2, 2), 0))
    b = NixlKvTransport(f"b-{os.getpid()}", _tensors((8, 4, 2, 3), 1))
    try:
        handle = a.export("req-x", [1, 2], 0)
        with pytest.raises(KvTransferError, match="req-x.*layout"):
            b.read(handle, [3, 4], 1, timeout_s=1.0)
        with pytest.raises(KvTransferError, match="2 blocks to read but 1 reserved"):
            a.read(a.export("req-y", [1, 2], 0), [5], 1, timeout_s=1.0)
    finally:
        a.close()
        b.close()
