"""`make demo`'s last step: `beam-trt serve GRAPH`, a coding request and a tool request
through the frontend's OpenAI API, Ctrl-C.

    python -m dynamo_graphs.demo_chat dynamo_graphs/disagg.yaml --engine-dir out/demo/tiny-nvfp4-engine

Runs the real CLI in a child process, waits for its "ready: URL" line (bounded), then with the
`openai` client: streams the answer to the coding request (its Python must parse), asks a
question that needs the `get_weather` tool (the returned call's arguments must validate
against the tool's JSON schema, with `jsonschema`), sends the tool's result back and prints
the answer; then sends SIGINT as a user's Ctrl-C would and checks that the graph stopped
cleanly. Exits non-zero, with the serve log tail, on failure.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque

READY = re.compile(r"ready: (http://127\.0\.0\.1:\d+)/v1")
TOOL_PROMPT = "What's the weather in Paris in celsius?"


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


def client_of(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def chat(url: str, prompt: str, max_tokens: int, messages: list[dict] | None = None) -> str:
    """Stream one chat completion (the user's `prompt`, or `messages`), printing its content."""
    stream = client_of(url).chat.completions.create(
        model="beam", messages=messages or [{"role": "user", "content": prompt}],
        max_tokens=max_tokens, temperature=0, stream=True)
    text = ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    return text


def ask_code(url: str, prompt: str, max_tokens: int) -> str | None:
    """The coding request, streamed; the answer's Python if it parses, else None."""
    from .demo_answers import code_messages, python_of

    messages = code_messages(prompt)
    print(f"demo: POST {url}/v1/chat/completions  system: {messages[0]['content']!r}  "
          f"user: {prompt!r}\nassistant: ", end="")
    code = python_of(chat(url, prompt, max_tokens, messages))
    print(f"demo: Python in the served answer parses (ast.parse): {'yes' if code else 'NO'}")
    return code


def weather_result(call) -> str:
    """A made-up result for a get_weather call, shaped as the training dialogues' results."""
    args = json.loads(call.function.arguments)
    return json.dumps({"city": args["city"], "temperature": 18, "unit": args["unit"],
                       "condition": "sunny"})


def ask_tool(url: str, max_tokens: int) -> bool:
    """A question that needs `get_weather`: the call (arguments validated against the tool's
    JSON schema), the tool's result sent back, the answer. True if a valid call came back."""
    import jsonschema

    from beam_trtllm.train.dialogues import TOOLS

    tool = TOOLS["get_weather"]
    messages = [{"role": "user", "content": TOOL_PROMPT}]
    print(f"demo: POST {url}/v1/chat/completions  user: {TOOL_PROMPT!r}  tools: [get_weather]")
    client = client_of(url)
    reply = client.chat.completions.create(model="beam", messages=messages, tools=[tool],
                                           max_tokens=max_tokens, temperature=0)
    msg = reply.choices[0].message
    print(f"demo: finish_reason {reply.choices[0].finish_reason}, reasoning: "
          f"{getattr(msg, 'reasoning_content', None)!r}")
    if not msg.tool_calls:
        print(f"demo: no tool call; content: {msg.content!r}", file=sys.stderr)
        return False
    for call in msg.tool_calls:
        try:
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        except (ValueError, jsonschema.ValidationError) as exc:  # JSONDecodeError is a ValueError
            print(f"demo: tool call {call.function.name}({call.function.arguments}) does not "
                  f"validate: {getattr(exc, 'message', exc)}", file=sys.stderr)
            return False
        print(f"demo: tool call {call.function.name}({call.function.arguments}): arguments "
              "validate against get_weather's JSON schema")
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                      "arguments": c.function.arguments}}
        for c in msg.tool_calls]})
    messages += [{"role": "tool", "tool_call_id": c.id, "content": weather_result(c)}
                 for c in msg.tool_calls]
    print(f"demo: the tool's result back -> {messages[-1]['content']}\nassistant: ", end="")
    final = client.chat.completions.create(model="beam", messages=messages, tools=[tool],
                                           max_tokens=max_tokens, temperature=0)
    print(final.choices[0].message.content)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("graph")
    p.add_argument("--engine-dir")
    p.add_argument("--prompt", default="Write a function that adds two numbers.")
    p.add_argument("--max-tokens", type=int, default=160)
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
        answered = ask_code(url, args.prompt, args.max_tokens) is not None
        called = ask_tool(url, args.max_tokens)
    finally:
        code = stop_serve(proc, tail)
    print(f"demo: serve stopped on Ctrl-C with exit code {code}")
    return 0 if code == 0 and answered and called else 1


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
