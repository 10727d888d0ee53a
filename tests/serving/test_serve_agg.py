"""The real Dynamo frontend over HTTP in front of two aggregated Beam workers (KV router)."""

import asyncio
import time

import openai
import pytest

from beam_trtllm.tokenizer import TextTokenizer

from helpers.serving import (CHAT, EXTRA, PROMPTS, client, expect, launch_graph, status_when,
                             wait_all_free, worker_status)


@pytest.fixture(scope="module")
def agg(request, tmp_path_factory, engine_dir):
    running = launch_graph("agg.yaml", {"workers.0.count": 2}, tmp_path_factory, engine_dir,
                           while_starting=lambda: request.getfixturevalue("reference"))
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def _all_kv_free_after_each_test(agg):
    yield
    wait_all_free(agg)


def _tokens(resp) -> list[int]:
    return resp.model_extra["nvext"]["completion_token_ids"]


def _worker(resp) -> int:
    return resp.model_extra["nvext"]["worker_id"]["decode_worker_id"]


def test_completions_greedy_output_is_the_engines(agg, reference, engine_dir):
    tok = TextTokenizer(engine_dir)
    c = client(agg)
    for prompt in PROMPTS:
        want, reason = expect(reference, prompt, 12)
        resp = c.completions.create(model="beam", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body=EXTRA)
        assert _tokens(resp) == want
        # The frontend detokenizes the same ids (a cut UTF-8 sequence at the end shows as
        # U+FFFD there, while the engine's own detokenizer holds it back).
        assert resp.choices[0].text == tok.decode(want)
        assert resp.choices[0].finish_reason == reason
        stream = c.completions.create(model="beam", prompt=prompt, max_tokens=12, temperature=0,
                                      stream=True)
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == resp.choices[0].text


def test_chat_greedy_output_is_the_engines_on_the_chat_template(agg, reference, engine_dir):
    tok = TextTokenizer(engine_dir)
    ids = tok.encode(tok.apply_chat_template(CHAT))
    want, _ = expect(reference, "chat", 10)
    c = client(agg)
    resp = c.chat.completions.create(model="beam", messages=CHAT, max_tokens=10,
                                     temperature=0, extra_body=EXTRA)
    assert resp.usage.prompt_tokens == len(ids)
    assert _tokens(resp) == want
    assert resp.choices[0].message.content == tok.decode(want)
    stream = c.chat.completions.create(model="beam", messages=CHAT, max_tokens=10,
                                       temperature=0, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == resp.choices[0].message.content


def test_max_tokens_and_stop_strings(agg, reference, engine_dir):
    c = client(agg)
    resp = c.completions.create(model="beam", prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"
    full = TextTokenizer(engine_dir).decode(expect(reference, PROMPTS[1], 16)[0])
    stop = full[5:9]  # a stop string in the middle of the greedy answer
    cut = full[:full.index(stop)]
    for stream in (False, True):
        resp = c.completions.create(model="beam", prompt=PROMPTS[1], max_tokens=16,
                                    temperature=0, stop=[stop], stream=stream)
        chunks = list(resp) if stream else [resp]
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
        assert text == cut and reasons[-1] == "stop"


def test_a_repeated_prefix_goes_to_the_worker_that_holds_it(agg):
    """Two long prefixes that landed on different workers; each continuation goes back to
    its holder (the router's decision, read from the response), and the holder's prefix
    cache serves it (its status counts the hit)."""
    c = client(agg)
    holder: dict[int, str] = {}
    for i in range(8):  # bounded: stop once each worker holds one prefix
        prefix = f"# module {i}\n" + " ".join(f"v{i}_{j} = {j * i}" for j in range(40))
        resp = c.completions.create(model="beam", prompt=prefix, max_tokens=1, extra_body=EXTRA)
        # keep each worker's NEWEST prefix: with 64 KV blocks a worker holds ~3 of these
        # prefixes, so an older one may already be (partly) evicted by LRU
        holder[_worker(resp)] = prefix
        if len(holder) == 2:
            break
    assert len(holder) == 2, "the router never used the second worker"
    before = {s["worker_id"]: s["prefix_hits"] for s in worker_status(agg).values()}
    for worker_id, prefix in holder.items():
        for suffix in ("\nprint(1)", "\nprint(2)"):
            resp = c.completions.create(model="beam", prompt=prefix + suffix, max_tokens=1,
                                        extra_body=EXTRA)
            assert _worker(resp) == worker_id
            assert resp.usage.prompt_tokens_details.cached_tokens >= 16 * 8
    def hits(status):
        return {s["worker_id"]: s["prefix_hits"] for s in status.values()}

    after = hits(status_when(agg, lambda st: all(hits(st)[w] > before[w] for w in holder)))
    assert all(after[w] > before[w] for w in holder), (before, after)


def test_200_concurrent_requests_all_complete(agg):
    from openai import AsyncOpenAI

    async def run():
        c = AsyncOpenAI(base_url=f"{agg.url}/v1", api_key="unused", timeout=240, max_retries=0)
        sem = asyncio.Semaphore(200)

        async def one(i):
            async with sem:
                return await c.completions.create(model="beam", prompt=f"request {i}: hello",
                                                  max_tokens=4, temperature=0,
                                                  extra_body={"ignore_eos": True, **EXTRA})
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 300)
        finally:
            await c.close()

    t0 = time.monotonic()
    results = asyncio.run(run())
    assert len(results) == 200
    assert all(r.usage.completion_tokens == 4 for r in results)
    assert len({_worker(r) for r in results}) == 2  # the load spread over both workers
    assert time.monotonic() - t0 < 300


@pytest.mark.parametrize("path, body, status", [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", {"model": "beam", "messages": "hello"}, 400),
    ("/v1/chat/completions", {"model": "beam"}, 400),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404),
    ("/v1/completions", {"model": "beam", "prompt": "hi", "max_tokens": -1}, 400),
    ("/v1/completions", {"model": "beam", "prompt": "hi", "temperature": "hot"}, 400),
    ("/v1/completions", {"model": "beam", "prompt": "a " * 1100, "max_tokens": 4}, 400),
    ("/v1/completions", {"model": "beam", "prompt": "hi", "max_tokens": 5000}, 400),
    ("/v1/chat/completions", {"model": "beam", "max_tokens": 4,
                              "messages": [{"role": "user", "content": "b " * 1100}]}, 400),
])
def test_malformed_and_overlong_requests_get_4xx(agg, path, body, status):
    import json
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(agg.url + path, data=data,
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    assert info.value.code == status
    assert json.loads(info.value.read()).get("message")


def test_openai_client_sees_a_bad_request_error(agg):
    with pytest.raises(openai.BadRequestError, match="context length"):
        client(agg).completions.create(model="beam", prompt="hi", max_tokens=5000)


def test_completions_echo_is_refused_with_a_400_naming_it(agg):
    """/v1/completions `echo` reaches the worker as prompt_logprobs (Dynamo's Rust path), which
    the engine does not compute: a 400 naming it, never a 200 without the prompt."""
    with pytest.raises(openai.BadRequestError, match="echo"):
        client(agg).completions.create(model="beam", prompt=PROMPTS[0], max_tokens=6,
                                       temperature=0, echo=True)
    resp = client(agg).completions.create(model="beam", prompt=PROMPTS[0], max_tokens=2,
                                          temperature=0)  # (the worker serves on)
    assert resp.choices[0].finish_reason == "length"
