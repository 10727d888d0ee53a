"""Serving under abuse, bounded and on 127.0.0.1: over-long requests are refused before they
cost anything (and free the prefill worker's KV at once), every way a request ends leaves
nothing behind, and all of it is counted through each worker's Prometheus `/metrics` (the
Dynamo system endpoint), not private files. The long versions are in bench/serve_bench.py
(`--faults`)."""

import asyncio
import json
import re
import time
import urllib.error
import urllib.request

import pytest

from helpers.serving import EXTRA, launch_graph

STOP_PROMPT = "def add(a, b):"

SAMPLE = re.compile(r'^(beam_[a-z_]+)(?:\{(.*)\})? ([0-9.e+-]+)$')


def scrape(running) -> dict[str, dict]:
    """worker -> {'name{label=value,...}': value} of every beam_ metric on its /metrics."""
    out = {}
    for name in running.worker_names():
        with urllib.request.urlopen(running.metrics_url(name), timeout=10) as resp:
            text = resp.read().decode()
        samples = {}
        for line in text.splitlines():
            m = SAMPLE.match(line)
            if m:
                labels = ",".join(p for p in (m.group(2) or "").split(",")
                                  if p.split("=")[0] in ("state", "how", "outcome", "tier"))
                samples[f"{m.group(1)}{{{labels}}}" if labels else m.group(1)] = float(m.group(3))
        out[name] = samples
    return out


def settled(running, timeout_s=20.0) -> dict[str, dict]:
    """Poll /metrics until every worker holds nothing: requests, KV blocks, pins, rows."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(running)
        held = {n: {k: v for k, v in m.items() if v and k in HELD} for n, m in metrics.items()}
        if not any(held.values()):
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"still held after {timeout_s} s: {held}")
        time.sleep(0.2)


HELD = ('beam_requests_in_flight', 'beam_requests_running', 'beam_requests_queued',
        'beam_kv_blocks{state="used"}', 'beam_kv_blocks{state="pinned"}',
        'beam_kv_blocks{state="reserved"}', 'beam_ring_rows{state="used"}',
        'beam_handoffs_in_flight')


@pytest.fixture(scope="module")
def disagg(tmp_path_factory, engine_dir):
    running = launch_graph("disagg.yaml", {}, tmp_path_factory, engine_dir)
    yield running
    running.stop()


def _post(running, body, timeout=30, path="/v1/completions"):
    req = urllib.request.Request(f"{running.url}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            code = resp.status
            resp.read()
    except urllib.error.HTTPError as exc:
        code = exc.code
    return code, time.monotonic() - t0


def _context(engine_dir) -> int:
    return json.loads((engine_dir / "engine.json").read_text())["options"]["max_seq_len"]


def test_overlong_burst_is_refused_at_once_and_pins_nothing(disagg, engine_dir):
    ctx = _context(engine_dir)
    valid = {"model": "beam", "prompt": "def add(a, b):", "max_tokens": 8, "ignore_eos": True}
    _post(disagg, valid)
    unloaded = min(_post(disagg, valid)[1] for _ in range(3))
    before = scrape(disagg)
    # prompt + max_tokens over the context (prefill would have run), and a prompt over it
    bodies = [{"model": "beam", "prompt": f"word{i} " * 40, "max_tokens": ctx} for i in range(16)]
    bodies += [{"model": "beam", "prompt": "x " * ctx, "max_tokens": 4} for _ in range(4)]

    async def burst():
        return await asyncio.gather(*(asyncio.to_thread(_post, disagg, b) for b in bodies))

    results = asyncio.run(burst())
    assert all(code == 400 for code, _ in results), results
    assert max(t for _, t in results) < 1.0, results
    code, after = _post(disagg, valid)
    assert code == 200 and after < 2 * unloaded + 0.25, (after, unloaded)
    metrics = settled(disagg)  # no pinned blocks, no ring row, no handoff left
    prefill = next(m for n, m in metrics.items() if n.startswith("prefill"))
    key = 'beam_handoffs_total{outcome="declined"}'
    assert prefill[key] - before["prefill-0"][key] == 16  # freed at once, not by TTL
    assert prefill['beam_handoffs_total{outcome="timed_out"}'] == 0


async def _one(session, url, body, how):
    """One request ended the way `how` says; returns 'ok', 'refused' or 'cut'."""
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return "refused"
        n = 0
        async for raw in resp.content:
            n += raw.startswith(b"data: ")
            if how == "disconnect" and n >= 2:
                return "cut"  # leaving the block closes the connection mid-stream
    return "ok"


def test_every_way_a_request_ends_leaves_nothing_behind(disagg, engine_dir):
    import aiohttp

    # a stop id the greedy answer to STOP_PROMPT meets at its 3rd token (the frontend then
    # cancels the stream: the path that leaked a request entry per stop)
    resp = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"{disagg.url}/v1/completions", headers={"content-type": "application/json"},
        data=json.dumps({"model": "beam", "prompt": STOP_PROMPT, "max_tokens": 3,
                         "temperature": 0, **EXTRA}).encode()), timeout=30).read())
    stop_id = resp["nvext"]["completion_token_ids"][2]
    kinds = {
        "finish": ({"max_tokens": 6, "ignore_eos": True}, "ok"),
        "disconnect": ({"max_tokens": 200, "ignore_eos": True, "stream": True}, "cut"),
        "stop_token": ({"max_tokens": 50, "stream": True, "temperature": 0,
                        "stop_token_ids": [stop_id]}, "ok"),
        "overlong": ({"max_tokens": _context(engine_dir)}, "refused"),
    }
    seen_busy = []

    async def run():
        sem = asyncio.Semaphore(16)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async def one(i):
                kind = list(kinds)[i % len(kinds)]
                extra, want = kinds[kind]
                async with sem:
                    prompt = STOP_PROMPT if kind == "stop_token" else f"req {i}:"
                    got = await _one(session, disagg.url, {"model": "beam",
                                                           "prompt": prompt, **extra},
                                     "disconnect" if kind == "disconnect" else kind)
                return kind, got, want

            async def watch():
                while True:
                    m = await asyncio.to_thread(scrape, disagg)
                    seen_busy.append(max(w["beam_requests_in_flight"] for w in m.values()))
                    await asyncio.sleep(0.2)

            watcher = asyncio.create_task(watch())
            try:
                return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(80))), 120)
            finally:
                watcher.cancel()

    results = asyncio.run(run())
    assert [r for r in results if r[1] != r[2]] == []
    assert max(seen_busy) > 0  # the gauges moved under load ...
    metrics = settled(disagg)  # ... and settled after: nothing in flight, every block free
    ended = {n: {k: v for k, v in m.items() if k.startswith("beam_requests_ended")}
             for n, m in metrics.items()}
    assert ended["decode-0"]['beam_requests_ended_total{how="cancelled"}'] >= 20, ended
    assert all(m['beam_kv_blocks{state="free"}'] == m['beam_kv_blocks{state="total"}']
               for m in metrics.values())


def test_overlong_chat_burst_is_refused_by_the_processor_before_routing(disagg, engine_dir):
    """Chat requests are tokenized in the frontend's processor: prompt + max_tokens over the
    context, or a prompt over it, get a 400 there, so no prefill runs and nothing is pinned."""
    ctx = _context(engine_dir)
    before = scrape(disagg)
    words = [{"model": "beam", "max_tokens": ctx,
              "messages": [{"role": "user", "content": f"word{i} " * 40}]} for i in range(46)]
    long = [{"model": "beam", "max_tokens": 4,
             "messages": [{"role": "user", "content": "x " * ctx}]} for _ in range(4)]

    async def burst():
        return await asyncio.gather(*(asyncio.to_thread(_post, disagg, b, 30,
                                                        "/v1/chat/completions")
                                      for b in words + long))

    results = asyncio.run(burst())
    assert all(code == 400 for code, _ in results), results
    assert max(t for _, t in results) < 1.0, results
    after = settled(disagg)
    for name, m in after.items():  # no worker saw any of them
        assert {k: v for k, v in m.items() if k.startswith(("beam_requests_ended",
                                                           "beam_handoffs_total"))} == \
            {k: v for k, v in before[name].items() if k.startswith(("beam_requests_ended",
                                                                    "beam_handoffs_total"))}


def _raw(running, body: bytes, path="/v1/chat/completions") -> tuple[int, str, float]:
    """POST raw bytes (no client library re-encoding them) on 127.0.0.1."""
    import http.client

    host, port = running.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    t0 = time.monotonic()
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace"), time.monotonic() - t0
    finally:
        conn.close()


def test_bad_bodies_are_refused_before_tokenizing(disagg, engine_dir):
    from dynamo_graphs.commands import body_limit_mib

    def chat(content: str) -> bytes:
        return json.dumps({"model": "beam", "max_tokens": 2,
                           "messages": [{"role": "user", "content": content}]}).encode()

    # invalid UTF-8: Dynamo's HTTP layer turns each bad byte into U+FFFD; the processor refuses
    code, text, _ = _raw(disagg, chat("ab").replace(b"ab", b"a\xff\xfeb"))
    assert code == 400 and "messages[0].content contains U+FFFD" in text, text
    # text that cannot fit the context whatever it tokenizes to: refused by length
    code, text, took = _raw(disagg, chat("x " * 200_000))
    assert code == 400 and "characters; a prompt of at most" in text and took < 1.0, text
    # a body over the launcher's DYN_HTTP_BODY_LIMIT_MB: Dynamo refuses it before parsing
    limit = body_limit_mib(_context(engine_dir)) * 2**20
    code, text, took = _raw(disagg, chat("x" * (limit + 1024)))
    assert code == 413 and "DYN_HTTP_BODY_LIMIT_MB" in text and took < 1.0, text


def test_health_reports_the_device_each_worker_runs_on(disagg):
    """Dynamo records each instance's device_type from the worker's environment; a CPU worker
    must not be listed as `cuda` (the frontend's `/health`, and its device-aware router)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with urllib.request.urlopen(f"{disagg.url}/health", timeout=10) as resp:
        health = json.load(resp)
    instances = [i for i in health["instances"] if i["endpoint"] == "generate"]
    assert sorted(i["component"] for i in instances) == ["decode", "prefill"], health
    assert {i["device_type"] for i in health["instances"]} == {device}, health
    for name in disagg.worker_names():  # each worker's own system endpoint, and its log
        with urllib.request.urlopen(disagg.metrics_url(name).replace("/metrics", "/health"),
                                    timeout=10) as resp:
            assert json.load(resp)["status"] == "ready"
        assert re.search(rf"\) on {device}(:\d+)? ready in", disagg.log_text(name)), name
