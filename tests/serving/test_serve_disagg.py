"""Disaggregated serving through the real frontend: one prefill worker (with host and disk
KV tiers) and two decode workers, the KV handed over with NIXL. The last test kills a decode
worker (the launcher restarts it)."""

import asyncio
import os
import signal
import time

import pytest

from helpers.serving import (EXTRA, PROMPTS, client, expect, launch_graph, long_prompt,
                             status_when, wait_all_free, worker_status)

BLOCK = 16


@pytest.fixture(scope="module")
def disagg(request, tmp_path_factory, engine_dir):
    edits = {"workers.1.count": 2, "timeouts.kv_handoff_ttl_s": 5.0,
             # 8 blocks of host memory, then disk: a 12-block prefix spills to both tiers
             "offload.host_mib": 8 * 6144 / 2**20, "offload.disk_mib": 1.0}
    running = launch_graph("disagg_offload.yaml", edits, tmp_path_factory, engine_dir,
                           while_starting=lambda: request.getfixturevalue("reference"))
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def _all_kv_free_after_each_test(disagg):
    yield
    wait_all_free(disagg)


def _tokens(resp):
    return resp.model_extra["nvext"]["completion_token_ids"]


def _status(running, role):
    return [s for s in worker_status(running).values() if s["role"] == role]


def _prefill_tiers(running, ready):
    """The prefill worker's tier counters once `ready(tiers)` holds (bounded)."""
    def tiers(status):
        return next(s["tiers"] for s in status.values() if s["role"] == "prefill")

    return tiers(status_when(running, lambda st: ready(tiers(st))))


def test_disagg_greedy_output_is_the_engines(disagg, reference):
    c = client(disagg)
    for prompt in PROMPTS:
        resp = c.completions.create(model="beam", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body=EXTRA)
        assert _tokens(resp) == expect(reference, prompt, 12)[0]
        ids = resp.model_extra["nvext"]["worker_id"]
        assert ids["prefill_worker_id"] != ids["decode_worker_id"]
    # Every READ's completion notification released the prefill side's pin (none by TTL).
    # Status files are written asynchronously: poll (bounded) until the counts settle.
    deadline = time.monotonic() + 10
    while True:
        status = wait_all_free(disagg)
        prefill = next(s for s in status.values() if s["role"] == "prefill")["handoff"]
        pulled = sum(s["transfers"]["pulled"] for s in status.values() if s["role"] == "decode")
        counts = (prefill["released_done"], prefill["exported"], pulled)
        if len(set(counts)) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert counts[0] == counts[1] == counts[2] >= len(PROMPTS), (prefill, pulled)
    assert prefill["released_ttl"] == prefill["released_failed"] == 0


def test_an_offloaded_prefix_is_loaded_back_and_gives_identical_tokens(disagg, reference):
    c = client(disagg)
    prompt = long_prompt("alpha")
    first = c.completions.create(model="beam", prompt=prompt, max_tokens=8, temperature=0,
                                 extra_body=EXTRA)
    n_blocks = (first.usage.prompt_tokens - 1) // BLOCK
    assert 8 <= n_blocks <= 20
    # Other long prompts fill the prefill worker's 64 blocks and evict the prefix to the tiers.
    for i in range(7):
        c.completions.create(model="beam", prompt=long_prompt(f"fill{i}x"), max_tokens=1)
    tiers = _prefill_tiers(disagg, lambda t: t["offloaded"] >= n_blocks and t["spilled_to_disk"])
    assert tiers["offloaded"] >= n_blocks and tiers["spilled_to_disk"] > 0
    assert tiers["dropped"] == 0
    hits_before = tiers["host_hits"] + tiers["disk_hits"]
    again = c.completions.create(model="beam", prompt=prompt, max_tokens=8, temperature=0,
                                 extra_body=EXTRA)
    tiers = _prefill_tiers(disagg, lambda t: t["host_hits"] + t["disk_hits"] - hits_before
                           >= n_blocks)
    assert tiers["host_hits"] + tiers["disk_hits"] - hits_before == n_blocks
    assert again.usage.prompt_tokens_details.cached_tokens == n_blocks * BLOCK
    assert _tokens(again) == _tokens(first) == expect(reference, prompt, 8)[0]


def test_killing_a_decode_worker_under_load(disagg):
    """In-flight requests on the killed worker end with an error (bounded wait), the others
    complete, and the surviving decode worker keeps serving."""
    from openai import AsyncOpenAI

    victim = sorted(disagg.worker_names("decode"))[-1]
    victim_id = next(s["worker_id"] for n, s in worker_status(disagg).items() if n == victim)

    async def one(c, i, started):
        got = 0
        stream = await c.completions.create(
            model="beam", prompt=f"load {i}", max_tokens=40, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        reason = None
        async for ch in stream:
            if ch.choices:
                got += 1
                started.set()
                reason = ch.choices[0].finish_reason or reason
        return got, reason

    async def run():
        c = AsyncOpenAI(base_url=f"{disagg.url}/v1", api_key="unused", timeout=60, max_retries=0)
        started = asyncio.Event()
        tasks = [asyncio.create_task(one(c, i, started)) for i in range(16)]
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.sleep(0.5)
        os.kill(disagg.components[victim].proc.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 90)
        await c.close()
        return results

    t0 = time.monotonic()
    results = asyncio.run(run())
    assert time.monotonic() - t0 < 100
    done = [r for r in results if not isinstance(r, BaseException) and r[1] == "length"]
    failed = [r for r in results if r not in done]
    # Dynamo's request migration (frontend.migration_limit) re-sends the dead worker's
    # streams to the survivor; whatever could not move ended with an error, none hangs.
    assert done, results
    for r in failed:  # an exception, or a stream cut short without a finish reason
        assert isinstance(r, BaseException) or r[1] is None, r
    # The survivor serves new requests (bounded retries while the router drops the dead one).
    c = client(disagg, timeout=60)
    ok = 0
    deadline = time.monotonic() + 60
    while ok < 4 and time.monotonic() < deadline:
        try:
            resp = c.completions.create(model="beam", prompt=f"after {ok}", max_tokens=4,
                                        extra_body=EXTRA)
        except Exception:  # noqa: BLE001 - routed to the dead worker before it was dropped
            time.sleep(0.5)
            continue
        assert resp.model_extra["nvext"]["worker_id"]["decode_worker_id"] != victim_id
        ok += 1
    assert ok == 4
    # The launcher restarts the killed worker (restarts.backoff_s 1 s, then its start-up).
    deadline = time.monotonic() + 90
    while not disagg.supervisor.events and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [e["worker"] for e in disagg.supervisor.events] == [victim]
    assert disagg.supervisor.events[0]["back_s"] < 90 and disagg.failure is None
