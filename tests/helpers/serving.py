"""Helpers of the serving tests (graphs from the shipped YAMLs, status files, clients)."""

import json
import time
from pathlib import Path

import yaml

from dynamo_graphs.graph import load_graph
from dynamo_graphs.launch import launch

GRAPHS = Path(__file__).resolve().parents[2] / "dynamo_graphs"
EXTRA = {"nvext": {"extra_fields": ["worker_id", "completion_token_ids"]}}
PROMPTS = ["def add(a, b):", "The quick brown fox", "x" * 7 + " = [1, 2, 3]\nfor i in x:"]
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]
REF_TOKENS = 16  # greedy reference length; tests compare prefixes of it


def long_prompt(tag: str, n_words: int = 26) -> str:
    """~180 tokens of the tiny tokenizer (about 11 KV blocks of 16)."""
    return f"# {tag}\n" + " ".join(f"{tag}{j}" for j in range(n_words))


def reference_prompts(tokenizer) -> dict:
    """Every prompt whose greedy continuation the serving tests compare against."""
    out = {p: tokenizer.encode(p) for p in PROMPTS + [long_prompt("alpha")]}
    out["chat"] = tokenizer.encode(tokenizer.apply_chat_template(CHAT))
    return out


def expect(reference, key, max_tokens):
    """(token ids, finish reason) the engine gives for `key` with `max_tokens`."""
    ids, reason = reference[key]
    if len(ids) >= max_tokens:
        return ids[:max_tokens], "length"
    return ids, reason


def graph_from(name, tmp_path, engine_dir, **edits):
    raw = yaml.safe_load((GRAPHS / name).read_text())
    for key, value in edits.items():
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        node[leaf] = value
    raw["frontend"]["http_port"] = 0
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return load_graph(path, engine_dir=engine_dir)


def launch_graph(name, edits, tmp_path_factory, engine_dir, while_starting=None):
    """Launch a shipped graph (with `edits` as dotted-path: value) on a free port; run
    `while_starting()` (e.g. the in-process reference) while its processes boot."""
    tmp = tmp_path_factory.mktemp(name.split(".")[0])
    running = launch(graph_from(name, tmp, engine_dir, **edits), tmp / "run", echo=None,
                     wait=False)
    try:
        if while_starting is not None:
            while_starting()
        running.wait_ready()
    except BaseException:
        running.stop()
        raise
    return running


def client(running, timeout=120):
    from openai import OpenAI

    return OpenAI(base_url=f"{running.url}/v1", api_key="unused", timeout=timeout, max_retries=0)


def worker_status(running) -> dict[str, dict]:
    out = {}
    for name in running.worker_names():
        comp = running.components[name]
        path = running.run_dir / "status" / f"{name}.json"
        if comp.proc.poll() is None and path.exists():
            out[name] = json.loads(path.read_text())
    return out


def status_when(running, ready, timeout_s=5.0) -> dict[str, dict]:
    """The workers' status once `ready(status)` holds, or as it is after timeout_s: a worker
    writes its status after the step that answered, so a read right after a response may be
    a step behind."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = worker_status(running)
        if ready(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def wait_all_free(running, timeout_s=20.0) -> dict[str, dict]:
    """Poll until every live worker holds no KV (blocks, pins, reservations, requests)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = worker_status(running)
        held = {n: {k: s.get(k) for k in ("kv_used_blocks", "num_running", "num_waiting",
                                          "num_pinned", "num_reserved", "in_flight")}
                for n, s in status.items()
                if s["kv_used_blocks"] or s["num_running"] or s["num_waiting"]
                or s["num_pinned"] or s["num_reserved"] or s["in_flight"]}
        if not held and status:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"KV still held after {timeout_s} s: {held}")
        time.sleep(0.1)


