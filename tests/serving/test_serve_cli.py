"""`beam-trt serve` as a user runs it: ready line with the URL, a chat answer, Ctrl-C stops
everything; a component that dies stops the whole graph with an error naming it."""

import os
import signal
import subprocess
import time
from collections import deque
from pathlib import Path

import pytest

from dynamo_graphs.demo_chat import chat, start_serve, wait_url
from helpers.serving import GRAPHS, graph_from


def _graph_processes(run_dir: Path) -> list[int]:
    """PIDs of live processes started for this run (they all carry its discovery folder)."""
    marker = f"DYN_FILE_KV={run_dir / 'discovery'}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def _end(proc: subprocess.Popen) -> None:
    """Stop a `beam-trt serve` whatever state the test left it in (its children die with it:
    PR_SET_PDEATHSIG), so that a failed test leaves no graph running."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _start(tmp_path, engine_dir, **edits):
    graph = graph_from("agg.yaml", tmp_path, engine_dir, **edits)
    run_dir = tmp_path / "run"
    proc = start_serve(str(graph.path), str(engine_dir), ["--run-dir", str(run_dir)])
    tail = deque(maxlen=200)
    try:
        url = wait_url(proc, tail, 300, show=False)
        assert url is not None, "\n".join(tail)
    except BaseException:
        _end(proc)
        raise
    return proc, run_dir, url, tail


def _serve(tmp_path, engine_dir):
    proc, run_dir, url, tail = _start(tmp_path, engine_dir)
    if len(_graph_processes(run_dir)) != 2:  # frontend + one worker
        _end(proc)
        raise AssertionError(f"expected 2 graph processes: {_graph_processes(run_dir)}")
    return proc, run_dir, url, tail


@pytest.mark.parametrize("stop,background", [(signal.SIGINT, False), (signal.SIGTERM, False),
                                             (signal.SIGINT, True)],
                         ids=["sigint", "sigterm", "sigint-background-job"])
def test_serve_answers_and_stops_cleanly_on_ctrl_c_or_sigterm(tmp_path, engine_dir, stop,
                                                              background):
    """background: serve inherits SIGINT ignored, as a background job of a non-interactive
    shell does (`make demo &` in a script); `kill -INT` must stop it all the same."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if background else None
    try:
        proc, run_dir, url, tail = _serve(tmp_path, engine_dir)
    finally:
        if background:
            signal.signal(signal.SIGINT, old)
    try:
        assert chat(url, "hello", 6)
        assert any(line.startswith("[frontend] ") for line in tail)
        assert any(line.startswith("[backend-0] ") for line in tail)
    finally:
        proc.send_signal(stop)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # did not stop: end it, leave no graph behind
            proc.terminate()
            proc.wait(timeout=30)
            raise
    assert code == 0
    assert _graph_processes(run_dir) == []


def test_a_killed_launcher_takes_its_graph_with_it(tmp_path, engine_dir):
    proc, run_dir, url, tail = _serve(tmp_path, engine_dir)
    proc.kill()  # SIGKILL: no cleanup code runs in the launcher
    proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while _graph_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _graph_processes(run_dir) == []


def test_serve_restarts_a_dead_worker_and_keeps_serving(tmp_path, engine_dir):
    proc, run_dir, url, tail = _serve(tmp_path, engine_dir)
    import json

    try:
        worker_pid = json.loads((run_dir / "status" / "backend-0.json").read_text())["pid"]
        os.kill(worker_pid, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not any("backend-0 is back" in l for l in tail):
            time.sleep(0.2)
        assert any("worker backend-0 exited with code -9; restart 1/3 in 1.0 s" in line
                   for line in tail), list(tail)
        assert any("worker backend-0 is back after" in line for line in tail), list(tail)
        assert chat(url, "hello again", 4)
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    assert code == 0 and _graph_processes(run_dir) == []


@pytest.mark.parametrize("victim", ["frontend", "worker-out-of-restarts"])
def test_serve_stops_the_graph_when_it_cannot_go_on(tmp_path, engine_dir, victim):
    """The frontend is not restarted; a worker past restarts.max is not either: the graph says
    which and why, exits 1 within a bound, and leaves no process behind."""
    proc, run_dir, url, tail = _start(tmp_path, engine_dir, **{"restarts.max": 0})
    try:
        import json

        name = "frontend" if victim == "frontend" else "backend-0"
        port = url.split(":")[-1].split("/")[0].encode()
        pid = (_frontend_pid(port) if name == "frontend"
               else json.loads((run_dir / "status" / "backend-0.json").read_text())["pid"])
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=30)
        stopped_s = time.monotonic() - t_kill
    finally:
        _end(proc)
    deadline = time.monotonic() + 10
    while _graph_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    why = "the frontend is not restarted" if name == "frontend" else "restarts.max 0"
    assert code == 1 and stopped_s < 15, (code, stopped_s)
    assert any(f"component {name} exited with code -9" in line and why in line
               for line in tail), list(tail)
    assert _graph_processes(run_dir) == []


def _frontend_pid(port: bytes) -> int:
    """The `python -m beam_trtllm.chat.frontend --http-port PORT` process of this graph."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"beam_trtllm.chat.frontend" in argv and port in argv:
            return int(entry.name)
    raise AssertionError(f"no frontend process on port {port!r}")


def test_shipped_graphs_point_at_the_demo_engine():
    assert (GRAPHS / "disagg.yaml").read_text().count("engine_dir: ../out/demo/tiny-nvfp4-engine") == 1


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_serve_a_checkpoint_saved_by_transformers(tmp_path, hf_checkpoints, kind):
    """transformers' own checkpoint (FP32 or BF16) -> convert NVFP4 -> build -> serve: the
    frontend's greedy answer is the engine's own, token for token."""
    from beam_trtllm.engine.build import build_engine
    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.plan import BuildOptions
    from beam_trtllm.engine.types import SamplingParams
    from convert import ConvertOptions, convert

    ckpt = convert(hf_checkpoints[kind], tmp_path / "nvfp4",
                   ConvertOptions("nvfp4", calib_samples=2, calib_seq_len=32, workers=1))
    engine_dir = build_engine(ckpt, tmp_path / "engine",
                              BuildOptions(max_batch=4, max_seq_len=256, max_num_tokens=128))
    engine = Engine.from_dir(engine_dir, device="cpu")
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    want = engine.generate([engine.tokenizer.encode(prompt)],
                           SamplingParams(max_tokens=6, ignore_eos=True))[0]
    proc, run_dir, url, tail = _serve(tmp_path, engine_dir)
    try:
        got = chat(url, "hello", 6)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert got == want["text"] or (want["finish_reason"] == "stop" and want["text"].startswith(got))
