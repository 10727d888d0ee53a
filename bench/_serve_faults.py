"""Fault scenarios of bench/serve_bench.py (`--faults`), on one launched graph each:

1. burst: N over-long chat requests at once (prompt + max_tokens over the context), which
   the chat processor refuses before routing; each one's time to its 400, then a valid request's latency against its unloaded latency, and the
   pinned KV blocks left (from every worker's /metrics).
2. mixed: M requests, up to C in flight, cycling finish / disconnect mid-stream /
   stop-token / abort before the first token / over-long (a ~3-token /v1/completions
   stream with max_tokens = the context: refused in band, asserted); hung = no end within
   `--hang-s`; after: in-flight and used KV blocks on every worker (from /metrics).
3. kill: S concurrent streams; kill -9 one worker of the first group, then (once it is
   back) one of the second; meanwhile new requests every 0.25 s (their p50 latency and
   errors during the outage); each stream must complete or end with a retryable error (HTTP
   429 / 502 / 503 / 504, in band or not) and none may hang (kill_verdict); every error's
   code and message are counted, and the frontend's request migrations (its /metrics);
   seconds until the launcher had the worker back.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import time
import urllib.request
from collections import Counter

SAMPLE = re.compile(r'^(beam_[a-z_]+)(?:\{(.*)\})? ([0-9.e+-]+)$')


def scrape_sum(running, metric: str) -> float:
    """Sum of one beam_ sample (e.g. 'beam_kv_blocks{state="used"}') over all workers."""
    name, _, want = metric.partition("{")
    total = 0.0
    for worker in running.worker_names():
        with urllib.request.urlopen(running.metrics_url(worker), timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                m = SAMPLE.match(line)
                if m and m.group(1) == name and (not want or want.rstrip("}") in (m.group(2) or "")):
                    total += float(m.group(3))
    return total


def settle(running, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        held = {k: scrape_sum(running, k) for k in (
            "beam_requests_in_flight", 'beam_kv_blocks{state="used"}',
            'beam_kv_blocks{state="pinned"}', 'beam_ring_rows{state="used"}')}
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


async def request(session, url, body, how="finish", hang_s=60.0,
                  path="/v1/completions") -> tuple[str, float, str | None]:
    """One request; returns (outcome, seconds, error): outcome ok, refused, retryable, error,
    cut or hung; error names what ended a refused / retryable / error one.

    A refused stream is HTTP 200: Dynamo 1.6.1 sends the SSE headers before the engine
    answers, so a 400 from the processor or a worker arrives in band as
    `data: {"error": {..., "code": 400}}`, followed by `data: [DONE]`; so does a 503."""
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(hang_s):
            async with session.post(f"{url}{path}", json=body) as resp:
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")
                    return _by_code(resp.status), time.perf_counter() - t0, \
                        _error_key(resp.status, text)
                if how == "abort":
                    return "cut", time.perf_counter() - t0, None
                outcome, error = await _read_stream(resp, how)
                return outcome, time.perf_counter() - t0, error
    except TimeoutError:
        return "hung", time.perf_counter() - t0, None
    except Exception as exc:  # noqa: BLE001 - a connection cut by a dying worker counts as an error
        return "error", time.perf_counter() - t0, f"client: {type(exc).__name__}: {exc}"[:160]


# HTTP codes a client retries (the request was not served: no worker, overloaded, timed out)
RETRYABLE = {429, 502, 503, 504}
REQUEST_ID = re.compile(r"[0-9a-f]{8,}(?:-[0-9a-f]+)*|\b\d{4,}\b")


def _by_code(code) -> str:
    return "refused" if code == 400 else "retryable" if code in RETRYABLE else "error"


def _error_key(code, message: str) -> str:
    """An error's code and message with request ids and numbers blanked (so they group)."""
    return f"{code}: {REQUEST_ID.sub('#', str(message))}"[:200]


async def _read_stream(resp, how: str) -> tuple[str, str | None]:
    n = 0
    event_error = False
    async for raw in resp.content:
        if raw.startswith(b"data: [DONE]"):
            return ("error", "event: error without data") if event_error else ("ok", None)
        if raw.startswith(b"event: error"):
            event_error = True  # its data line follows
            continue
        if not raw.startswith(b"data: "):
            continue
        n += 1
        if event_error or b'"error"' in raw:  # in band: the first error decides
            return _in_band_error(raw[6:])
        if how == "disconnect" and n >= 2:
            return "cut", None
    return "error", "stream ended without [DONE]"


def _in_band_error(data: bytes) -> tuple[str, str]:
    try:
        err = json.loads(data)
    except ValueError:
        return "error", _error_key("?", data.decode(errors="replace"))
    err = err.get("error", err) if isinstance(err, dict) else err
    if not isinstance(err, dict):
        return "error", _error_key("?", err)
    code = err.get("code")
    return _by_code(code), _error_key(code, err.get("message", err))


def _stream_body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": "beam", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, **extra}


async def burst(url, n: int, context: int) -> dict:
    """Over-long chat requests (prompt + max_tokens over the context): the chat processor
    refuses them after tokenizing, before routing (no prefill runs)."""
    import aiohttp

    async with aiohttp.ClientSession() as s:
        valid = _stream_body("def add(a, b):", 8)
        await request(s, url, valid)
        unloaded = min([(await request(s, url, valid))[1] for _ in range(3)])
        bad = [{"model": "beam", "max_tokens": context,
                "messages": [{"role": "user", "content": f"word{i} " * 40}]} for i in range(n)]
        results = await asyncio.gather(*(request(s, url, b, path="/v1/chat/completions")
                                         for b in bad))
        after = (await request(s, url, valid))[1]
    return {"refused": sum(r[0] == "refused" for r in results), "n": n,
            "max_400_s": max(r[1] for r in results), "unloaded_s": unloaded, "after_s": after}


async def mixed(url, n: int, concurrency: int, context: int, stop_id: int, hang_s: float):
    import aiohttp

    kinds = [("finish", _stream_body("req", 8)),
             ("disconnect", _stream_body("req", 200)),
             ("stop", {**_stream_body("def add(a, b):", 50, temperature=0),
                       "ignore_eos": False, "stop_token_ids": [stop_id]}),
             ("abort", _stream_body("req", 100)),
             ("overlong", _stream_body("req", context))]  # ~3 tokens + context
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as s:
        async def one(i):
            how, body = kinds[i % len(kinds)]
            async with sem:
                return how, (await request(s, url, {**body, "prompt": f"{body['prompt']} {i}"}
                                           if how != "stop" else body, how, hang_s))[0]
        results = await asyncio.gather(*(one(i) for i in range(n)))
    outcomes: dict[str, int] = {}
    for how, got in results:
        outcomes[f"{how}:{got}"] = outcomes.get(f"{how}:{got}", 0) + 1
    return outcomes


async def kill(running, groups: list[str], streams: int, max_tokens: int, hang_s: float):
    import aiohttp

    out = {}
    async with aiohttp.ClientSession() as s:
        for k, group in enumerate(groups):
            victim = sorted(n for n in running.worker_names() if n.startswith(group + "-"))[-1]
            tasks = [asyncio.create_task(request(s, running.url, _stream_body(
                f"kill {group} {i}", max_tokens), hang_s=hang_s)) for i in range(streams)]
            await asyncio.sleep(1.0)
            n_events = len(running.supervisor.events)
            moved = migrations(running.url)
            os.kill(running.components[victim].proc.pid, signal.SIGKILL)
            t_kill = time.monotonic()
            during = []  # a new request every 0.25 s until the worker is back, not awaited
            while len(running.supervisor.events) == n_events and time.monotonic() - t_kill < 120:
                during.append(asyncio.create_task(request(s, running.url, _stream_body(
                    f"during {k} {len(during)}", 4), hang_s=hang_s)))
                await asyncio.sleep(0.25)
            results = await asyncio.gather(*tasks)
            during = await asyncio.gather(*during)
            moved = {key: n - moved.get(key, 0) for key, n in migrations(running.url).items()
                     if n > moved.get(key, 0)}
            ok = [t for o, t, _ in during if o == "ok"]
            out[f"{k + 1}: {victim}"] = {
                **{f"streams_{o}": sum(r[0] == o for r in results)
                   for o in ("ok", "retryable", "error", "hung")},
                "stream_errors": dict(Counter(e for _, _, e in results if e)),
                "during_n": len(during), "during_ok": len(ok),
                "during_p50_ms": 1e3 * statistics.median(ok) if ok else float("nan"),
                "during_errors": dict(Counter(e for _, _, e in during if e)),
                "migrations": moved,
                "back_s": (running.supervisor.events[-1]["back_s"]
                           if len(running.supervisor.events) > n_events else float("nan"))}
            await asyncio.sleep(1.0)
    return out


MIGRATION = re.compile(r'^dynamo_frontend_model_migration_total\{(.*)\} ([0-9.e+]+)$')


def migrations(url: str) -> dict[str, int]:
    """The frontend's request migrations so far, by type and outcome (its /metrics)."""
    out: dict[str, int] = {}
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            m = MIGRATION.match(line)
            if m:
                labels = dict(kv.split("=", 1) for kv in m.group(1).split(","))
                key = "/".join(v for v in (labels.get(k, "").strip('"')
                                           for k in ("migration_type", "outcome")) if v)
                out[key] = out.get(key, 0) + int(float(m.group(2)))
    return out


def stop_token(url: str) -> int:
    """The 3rd greedy token of the 'stop' prompt (so a stop-token request stops early)."""
    body = {"model": "beam", "prompt": "def add(a, b):", "max_tokens": 3, "temperature": 0,
            "nvext": {"extra_fields": ["completion_token_ids"]}}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)["nvext"]["completion_token_ids"][2]


def run_faults(running, groups: list[str], args, context: int) -> dict:
    url, res = running.url, {}
    if "burst" in args.fault_scenarios:
        res["burst"] = asyncio.run(burst(url, args.burst, context))
        res["burst"]["pinned_after"] = settle(running)['beam_kv_blocks{state="pinned"}']
    if "mixed" in args.fault_scenarios:
        res["mixed"] = asyncio.run(mixed(url, args.mixed, args.mixed_concurrency, context,
                                         stop_token(url), args.hang_s))
        res["mixed_after"] = settle(running)
        expected = {"finish": "ok", "disconnect": "cut", "stop": "ok", "abort": "cut",
                    "overlong": "refused"}
        wrong = {k: v for k, v in res["mixed"].items()
                 if k.split(":")[1] != expected[k.split(":")[0]]}
        if wrong:  # e.g. an over-long stream that was served (200 + tokens) instead of refused
            raise AssertionError(f"mixed: unexpected outcomes {wrong} (all: {res['mixed']})")
    if "kill" in args.fault_scenarios:
        res["kill"] = asyncio.run(kill(running, groups, args.kill_streams, args.kill_tokens,
                                       args.hang_s))
        res["kill_after"] = settle(running, 60)
    return res


def kill_verdict(res: dict, back_bound_s: float) -> list[str]:
    """What breaks 'every in-flight stream completes or ends with a retryable error, none
    hangs, the worker is back within back_bound_s' in one graph's kill results (empty: held)."""
    bad = []
    for victim, r in res.get("kill", {}).items():
        if r["streams_error"] or r["streams_hung"]:
            bad.append(f"{victim}: {r['streams_error']} non-retryable errors, "
                       f"{r['streams_hung']} hung: {r['stream_errors']}")
        if not r["back_s"] <= back_bound_s:  # NaN too: not back within the bench's 120 s
            bad.append(f"{victim}: back after {r['back_s']:.1f} s, bound {back_bound_s:.0f} s")
    return bad
