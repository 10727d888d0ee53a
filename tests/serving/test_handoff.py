"""The prefill -> decode KV handoff between two real engines and two NIXL agents, in-process:
exact continuation, and every failure path frees the KV on both sides (counted)."""

import argparse
import asyncio
import copy
import threading
import time

import pytest

from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.types import SamplingParams
from dynamo_graphs.disagg import DecodeSide, PrefillSide, cache_tensors
from dynamo_graphs.graph import Timeouts
from dynamo_graphs.nixl_kv import KvTransferError, NixlKvTransport

PROMPT = [7, 300, 41, 99, 5, 250, 18, 77, 402, 3, 64, 128, 200, 11, 9, 310, 45, 60, 6, 1]


@pytest.fixture(scope="module")
def pair(engine_dir):
    prefill_engine = Engine.from_dir(engine_dir, device="cpu")
    decode_engine = Engine.from_dir(engine_dir, device="cpu")
    a = NixlKvTransport("handoff-test-prefill", cache_tensors(prefill_engine))
    b = NixlKvTransport("handoff-test-decode", cache_tensors(decode_engine))
    yield prefill_engine, decode_engine, a, b
    a.close()
    b.close()


@pytest.fixture
def polled():
    """PrefillSides whose notifications are polled every 2 ms, as the worker's poller does
    (without NIXL's progress thread the prefill agent serves READs only while polled)."""
    sides, stop = [], threading.Event()

    def loop():
        while not stop.is_set():
            for side in list(sides):
                side.poll()
            time.sleep(0.002)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield sides.append
    stop.set()
    thread.join(timeout=5)


def _run(engine, rid):
    tokens, reason = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                reason = out.finish_reason or reason
    return tokens, reason


def _prefill(engine, side, rid):
    engine.add_request(rid, PROMPT, SamplingParams(max_tokens=1), prefill_only=True)
    _run(engine, rid)
    return side.export(rid)


def _drain(prefill, timeout_s=5.0, decode=None):
    """Poll the prefill side's notifications until no pin is left (bounded); with `decode`,
    progress its transport too, as the worker's run_progress does after a decline (a
    notification to an agent met moments ago may still sit in its UCX queue)."""
    deadline = time.monotonic() + timeout_s
    while prefill.pinned and time.monotonic() < deadline:
        prefill.poll()
        if decode is not None:
            decode.transport.progress()
        time.sleep(0.01)


def _assert_free(*engines):
    for e in engines:
        snap = e.load_snapshot()
        assert e.kv_usage().used_blocks == 0 and snap["num_pinned"] == snap["num_reserved"] == 0
        assert snap["ring_rows_free"] == snap["ring_rows_total"]


def test_handoff_continues_exactly_and_the_notification_frees_the_prefill_side(pair, polled):
    pe, de, a, b = pair
    want = Engine.generate(pe, [PROMPT], SamplingParams(max_tokens=10))[0]["token_ids"]
    prefill, decode = PrefillSide(pe, a, ttl_s=30), DecodeSide(de, b, Timeouts())
    polled(prefill)
    handle = _prefill(pe, prefill, "ok-1")
    assert handle["first_token"] == want[0] and handle["num_tokens"] == len(PROMPT)
    reserved = asyncio.run(decode.pull("ok-1", PROMPT, handle))
    de.add_request("ok-1", PROMPT, SamplingParams(max_tokens=10), kv_reserved=reserved)
    tokens, _ = _run(de, "ok-1")
    assert tokens == want
    _drain(prefill)  # the READ's notification arrives asynchronously
    assert prefill.stats["released_done"] == 1 and not prefill.pinned
    _assert_free(pe, de)


def test_a_failed_read_frees_both_sides(pair):
    pe, de, a, b = pair
    prefill, decode = PrefillSide(pe, a, ttl_s=30), DecodeSide(de, b, Timeouts())
    handle = _prefill(pe, prefill, "bad-1")
    broken = copy.deepcopy(handle)
    broken["bases"] = [x + (1 << 40) for x in broken["bases"]]  # outside registered memory
    with pytest.raises(KvTransferError, match="KV handle bad-1"):
        asyncio.run(decode.pull("bad-1", PROMPT, broken))
    assert decode.stats["failed"] == 1
    _drain(prefill)  # the decode side's `fail:` notification releases the pin
    assert prefill.stats["released_failed"] == 1
    _assert_free(pe, de)


def test_an_unclaimed_handoff_is_released_after_its_ttl(pair):
    pe, de, a, b = pair
    prefill = PrefillSide(pe, a, ttl_s=0.2)
    _prefill(pe, prefill, "ttl-1")
    assert pe.kv_usage().used_blocks > 0
    asyncio.run(asyncio.sleep(0.3))
    prefill.poll()
    assert prefill.stats["released_ttl"] == 1
    _assert_free(pe)


def test_a_mismatched_prompt_is_refused_before_reserving(pair):
    pe, de, a, b = pair
    prefill, decode = PrefillSide(pe, a, ttl_s=30), DecodeSide(de, b, Timeouts())
    handle = _prefill(pe, prefill, "len-1")
    with pytest.raises(KvTransferError, match="holds 20 tokens, the prompt has 19"):
        asyncio.run(decode.pull("len-1", PROMPT[:-1], handle))
    _drain(prefill, decode=decode)  # the refusal declined the handle: its pin is freed now
    assert prefill.stats["released_failed"] == 1
    _assert_free(pe, de)


@pytest.mark.parametrize("policy", ["error", "recompute"])
def test_decode_worker_failure_policy(pair, engine_dir, policy):
    """`on_transfer_failure`: a clear error, or the decode worker computes the prompt. The
    error is Dynamo's `Disconnected`: the frontend migrates it (a fresh prefill), where its
    WorkerUnavailable reached the client as a 500."""
    from dynamo.llm.exceptions import Disconnected

    from dynamo_graphs.worker import BeamWorker, RequestSlot, parse_args

    pe, de, a, b = pair
    worker = BeamWorker(parse_args(["--engine-dir", str(engine_dir), "--role", "decode",
                                    "--on-transfer-failure", policy]))
    worker.engine, worker.decode = de, DecodeSide(de, b, Timeouts())
    prefill = PrefillSide(pe, a, ttl_s=30)
    handle = _prefill(pe, prefill, f"policy-{policy}")
    handle["bases"] = [x + (1 << 40) for x in handle["bases"]]
    request = {"token_ids": PROMPT, "prefill_result": {"disaggregated_params": handle}}
    handle = worker._incoming_handle(request)
    sampling = SamplingParams(max_tokens=6)
    if policy == "error":
        with pytest.raises(Disconnected, match="KV handoff from the prefill worker failed"):
            asyncio.run(worker._admission(RequestSlot("p-1", False), PROMPT, sampling, handle))
    else:
        add, cached = asyncio.run(worker._admission(RequestSlot("p-1", False), PROMPT, sampling, handle))
        assert cached is None
        add()
        tokens, _ = _run(de, "p-1")
        want = Engine.generate(pe, [PROMPT], SamplingParams(max_tokens=6))[0]["token_ids"]
        assert tokens == want
    _drain(prefill, decode=worker.decode)
    _assert_free(pe, de)


@pytest.mark.parametrize("policy", ["error", "recompute"])
def test_a_malformed_handle_is_not_retried(pair, engine_dir, policy):
    """A handle missing a field (a prefill worker of another version): under `error` a
    non-retryable Unknown naming it (a migration would prefill again and fail the same way);
    under `recompute` the decode worker computes the prompt."""
    from dynamo.llm.exceptions import Unknown

    from dynamo_graphs.worker import BeamWorker, RequestSlot, parse_args

    pe, de, a, b = pair
    worker = BeamWorker(parse_args(["--engine-dir", str(engine_dir), "--role", "decode",
                                    "--on-transfer-failure", policy]))
    worker.engine, worker.decode = de, DecodeSide(de, b, Timeouts())
    prefill = PrefillSide(pe, a, ttl_s=30)
    handle = dict(_prefill(pe, prefill, f"bad-{policy}"))
    del handle["nbytes"]
    sampling = SamplingParams(max_tokens=6)
    if policy == "error":
        with pytest.raises(Unknown, match="KV handle from the prefill worker is malformed"):
            asyncio.run(worker._admission(RequestSlot("b-1", False), PROMPT, sampling, handle))
    else:
        add, cached = asyncio.run(worker._admission(RequestSlot("b-1", False), PROMPT, sampling,
                                                    handle))
        assert cached is None
        add()
        tokens, _ = _run(de, "b-1")
        assert tokens == Engine.generate(pe, [PROMPT], SamplingParams(max_tokens=6))[0]["token_ids"]
    _drain(prefill, decode=worker.decode)
    _assert_free(pe, de)


def test_a_health_probe_on_a_prefill_worker_pins_nothing(pair, engine_dir):
    """Dynamo's canary probes bypass the prefill/decode split: no KV stays pinned."""
    from dynamo.common.backend.health_check import build_health_check_payload, is_probe

    from dynamo_graphs.worker import BeamWorker, RequestSlot, parse_args

    pe, de, a, b = pair
    worker = BeamWorker(parse_args(["--engine-dir", str(engine_dir), "--role", "prefill"]))
    worker.engine = pe
    probe = build_health_check_payload(bos_token_id=1)
    assert is_probe(probe)
    add, cached = asyncio.run(worker._admission(RequestSlot("probe-1", True), probe["token_ids"],
                                                SamplingParams(max_tokens=1), None))
    add()
    tokens, reason = _run(pe, "probe-1")
    assert len(tokens) == 1 and reason == "length"
    _assert_free(pe)
