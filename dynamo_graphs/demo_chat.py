"""`make demo`'s last step: `beam-trt serve GRAPH`, one chat request through the frontend, Ctrl-C.

    python -m dynamo_graphs.demo_chat dynamo_graphs/disagg.yaml --engine-dir out/demo/tiny-nvfp4-engine

Runs the real CLI in a child process, waits for its "ready: URL" line (bounded), streams one
chat completion with the `openai` client, then sends SIGINT as a user's Ctrl-C would and
checks that the graph stopped cleanly. Exits non-zero, with the serve log tail, on failure.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque

READY = re.compile(r"ready: (http://127\.0\.0\.1:\d+)/v1")


def start_serve(graph: str, engine_dir: str | None, extra: list[str]) -> subprocess.Popen:
    argv = [sys.executable, "-m", "beam_trtllm.cli", "serve", graph, "--port", "0", *extra]
    if engine_dir:
        argv += ["--engine-dir", engine_dir]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)


def wait_url(proc: subprocess.Popen, tail: deque, timeout_s: float,
             show: bool = True) -> str | None:
    """Read serve's output (echoing the launcher's own lines) until the ready line."""
    found: list[str] = []

    def pump():
        for line in proc.stdout:
            tail.append(line.rstrip())
            if show and line.startswith("[serve]"):
                print(line, end="", flush=True)
            m = READY.search(line)
            if m and not found:
                found.append(m.group(1))

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not found and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return found[0] if found else None


def chat(url: str, prompt: str, max_tokens: int) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    stream = client.chat.completions.create(
        model="beam", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True)
    text = ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("graph")
    p.add_argument("--engine-dir")
    p.add_argument("--prompt", default="Write a function that adds two numbers.")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--startup-s", type=float, default=300)
    args = p.parse_args(argv)
    tail: deque = deque(maxlen=60)
    proc = start_serve(args.graph, args.engine_dir, [])
    try:
        url = wait_url(proc, tail, args.startup_s)
        if url is None:
            print("demo: the graph did not become ready; serve output:\n" + "\n".join(tail),
                  file=sys.stderr)
            return 1
        print(f"demo: POST {url}/v1/chat/completions  user: {args.prompt}\nassistant: ", end="")
        text = chat(url, args.prompt, args.max_tokens)
        if not text:
            print("demo: empty answer", file=sys.stderr)
            return 1
    finally:
        code = stop_serve(proc, tail)
    print(f"demo: serve stopped on Ctrl-C with exit code {code}")
    return 0 if code == 0 else 1


def stop_serve(proc: subprocess.Popen, tail: deque, wait_s: float = 60) -> int:
    """Ctrl-C (SIGINT) as a user would -> serve's exit code. A serve still running after
    `wait_s` is a failure (-1): its last output is shown, then SIGTERM (or SIGKILL) ends it."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        print(f"demo: serve still running {wait_s:.0f} s after SIGINT; its last output:\n"
              + "\n".join(list(tail)[-20:]), file=sys.stderr)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return -1

if __name__ == "__main__":
    sys.exit(main())
