"""The launcher behind `beam-trt serve GRAPH.yaml`: processes, environment, readiness, logs.

No serving logic lives here. It starts the frontend (`python -m beam_trtllm.chat.frontend`,
Dynamo's frontend with Beam's chat processor) and every worker of the graph on loopback only
(environment and command lines: commands.py), waits until the model is listed, every worker instance is
registered and, for a disaggregated graph, the frontend's prefill router is active; then it
streams the logs with component prefixes and stops everything on Ctrl-C or when any one
component exits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from .commands import (LOOPBACK, LaunchError, body_limit_mib, check_engine_limits,
                       check_port_free, count_instances, free_port, free_system_port,
                       frontend_argv, loopback_env, signal_group, worker_argv)
from .graph import Graph

__all__ = ["LaunchError", "RunningGraph", "check_engine_limits", "count_instances", "launch",
           "loopback_env", "serve_forever", "stop_on_signals", "worker_argv"]
PREFILL_ROUTER_ACTIVE = "Prefill router target activated"
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # colour and cursor codes


@dataclass
class Component:
    name: str  # log prefix, e.g. "decode-1"
    proc: subprocess.Popen
    log_path: Path
    argv: list[str] = field(default_factory=list)
    system_port: int | None = None  # the worker's Dynamo system endpoint (/metrics, /health)
    tail: deque = field(default_factory=lambda: deque(maxlen=40))
    reader: threading.Thread | None = None


class RunningGraph:
    """A launched graph: `url`, `components`, `logs(name)`, `stop()`; also a context manager."""

    def __init__(self, graph: Graph, run_dir: Path, echo: TextIO | None, owned: bool = False):
        self.graph, self.run_dir, self.echo = graph, run_dir, echo
        self.owned_run_dir = owned  # made by launch(): removed by stop()
        self.supervisor = None  # supervise.Supervisor, once the graph is ready
        self.components: dict[str, Component] = {}
        self.port = graph.frontend.http_port or free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self._echo_lock = threading.Lock()
        self._stopped = False
        self.failure: LaunchError | None = None
        self.env = loopback_env(run_dir)

    # ------------------------------------------------------------------ processes
    def start_component(self, name: str, argv: list[str],
                        system_port: int | None = None) -> Component:
        """Start (or restart, under the same name, port and log) one process of the graph."""
        log_path = self.run_dir / "logs" / f"{name}.log"
        env = dict(self.env)
        if system_port is not None:
            env["DYN_SYSTEM_PORT"] = str(system_port)
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=self.run_dir, start_new_session=True, text=True,
                                errors="replace", bufsize=1, preexec_fn=_die_with_parent)
        comp = Component(name, proc, log_path, list(argv), system_port)
        comp.reader = threading.Thread(target=self._pump, args=(comp,), daemon=True,
                                       name=f"log-{name}")
        comp.reader.start()
        self.components[name] = comp
        return comp

    def _pump(self, comp: Component) -> None:
        with open(comp.log_path, "a") as log:  # a restarted worker appends to its log
            for line in comp.proc.stdout:
                line = ANSI.sub("", line)  # Dynamo colours some lines even with NO_COLOR
                log.write(line)
                log.flush()
                comp.tail.append(line.rstrip("\n"))
                if self.echo is not None:
                    with self._echo_lock:
                        self.echo.write(f"[{comp.name}] {line}")
                        self.echo.flush()

    def log_text(self, name: str) -> str:
        path = self.components[name].log_path
        return path.read_text(errors="replace") if path.exists() else ""

    def worker_names(self, role: str | None = None) -> list[str]:
        return [n for n, c in self.components.items() if n != "frontend"
                and (role is None or n.rsplit("-", 1)[0] in
                     {w.name for w in self.graph.workers if w.role == role})]

    def metrics_url(self, name: str) -> str:
        return f"http://{LOOPBACK}:{self.components[name].system_port}/metrics"

    def dead(self) -> list[Component]:
        return [c for c in self.components.values() if c.proc.poll() is not None]

    def check_alive(self) -> None:
        """While starting: any component that died fails the launch."""
        for comp in self.dead():
            raise self.death_error(comp)

    def death_error(self, comp: Component, why: str = "") -> LaunchError:
        comp.reader.join(timeout=2)
        tail = "\n".join(f"  [{comp.name}] {line}" for line in comp.tail)
        self.failure = LaunchError(
            f"component {comp.name} exited with code {comp.proc.returncode}{why}; last log "
            f"lines (full log: {comp.log_path}):\n{tail}")
        return self.failure

    def check_serving(self) -> None:
        """Once serving: raise the supervisor's verdict if the graph cannot go on."""
        if self.supervisor is None:
            self.check_alive()
        elif self.failure is not None:
            raise self.failure

    def echo_line(self, line: str) -> None:
        """A launcher line (restarts) in the stream and in logs/launcher.log."""
        with self._echo_lock:
            with open(self.run_dir / "logs" / "launcher.log", "a") as f:
                f.write(line + "\n")
            if self.echo is not None:
                self.echo.write(f"[serve] {line}\n")
                self.echo.flush()

    def stop(self) -> None:
        """SIGTERM every process group, then SIGKILL what is left after `shutdown_s`."""
        if self._stopped:
            return
        self._stopped = True
        if self.supervisor is not None:
            self.supervisor.stop()
        procs = [c.proc for c in self.components.values()]
        for p in procs:
            signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + self.graph.timeouts.shutdown_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(p, signal.SIGKILL)
                p.wait(timeout=5)
        for c in self.components.values():
            c.reader.join(timeout=2)
        self._clean_run_dir()

    def _clean_run_dir(self) -> None:
        """Nothing of a run outlives it but its logs: the KV disk tier and Dynamo's temp
        files always go; a run folder launch() made goes whole unless a component failed
        (then its logs stay, and the error names the folder)."""
        if self.owned_run_dir and self.failure is None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return
        for sub in ("offload", "tmp", "home"):
            shutil.rmtree(self.run_dir / sub, ignore_errors=True)

    def __enter__(self) -> "RunningGraph":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ readiness
    def wait_ready(self, progress: Callable[[str], None] | None = None) -> None:
        """Block until the graph serves: model listed, all workers registered, router active."""
        deadline = time.monotonic() + self.graph.timeouts.startup_s
        expected = {w.name: w.count for w in self.graph.workers}
        last = ""
        while True:
            self.check_alive()
            listed = self.graph.served_model_name in self.models()
            registered = count_instances(self.run_dir / "discovery", self.graph.namespace)
            missing = {n: c for n, c in expected.items() if registered.get(n, 0) < c}
            router_ok = (not self.graph.disaggregated
                         or PREFILL_ROUTER_ACTIVE in self.log_text("frontend"))
            if listed and not missing and router_ok:
                from .supervise import Supervisor

                self.supervisor = Supervisor(self)
                self.supervisor.start()
                return
            state = (f"model listed: {listed}; waiting for workers "
                     f"{ {n: f'{registered.get(n, 0)}/{c}' for n, c in missing.items()} }; "
                     f"prefill router active: {router_ok}")
            if progress and state != last:
                progress(state)
                last = state
            if time.monotonic() > deadline:
                raise LaunchError(f"graph {self.graph.name} not ready after "
                                  f"{self.graph.timeouts.startup_s:.0f} s ({state}); logs in "
                                  f"{self.run_dir / 'logs'}")
            time.sleep(0.2)

    def models(self) -> list[str]:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as resp:
                return [m["id"] for m in json.load(resp).get("data", [])]
        except (urllib.error.URLError, OSError, ValueError):
            return []


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the launcher dies, however it dies (even
    SIGKILL), so a graph never outlives the process that started it (Linux prctl)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM (systemd, kubectl, kill) stop the graph (main thread only).
    SIGINT is set explicitly: a process started as a background job of a non-interactive shell
    inherits it ignored, and then `kill -INT` (or a demo's Ctrl-C) would never stop the graph."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)


def launch(graph: Graph, run_dir: str | Path | None = None, echo: TextIO | None = sys.stdout,
           progress: Callable[[str], None] | None = None, wait: bool = True) -> RunningGraph:
    """Start every component of `graph` in parallel and (unless `wait=False`, then call
    `wait_ready()` later) wait until it serves; then a supervisor restarts dead workers."""
    max_seq_len = check_engine_limits(graph) if graph.backend == "beam" else None
    if graph.frontend.http_port:
        check_port_free(graph.frontend.http_port)
    owned = run_dir is None
    run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix=f"beam-{graph.name}-"))
    for sub in ("discovery", "home", "logs", "offload", "status", "tmp"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    running = RunningGraph(graph, run_dir, echo, owned)
    if max_seq_len is not None:  # bodies that cannot fit the context: refused before parsing
        running.env.setdefault("DYN_HTTP_BODY_LIMIT_MB", str(body_limit_mib(max_seq_len)))
    # Share the cores between the workers instead of oversubscribing them (CPU engines).
    n_workers = sum(w.count for w in graph.workers)
    running.env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n_workers)))
    try:
        running.start_component("frontend", frontend_argv(graph, running.port))
        for spec in graph.workers:
            for i in range(spec.count):
                argv = [sys.executable] + worker_argv(graph, spec, run_dir, i)
                running.start_component(f"{spec.name}-{i}", argv, free_system_port())
        if wait:
            running.wait_ready(progress)
    except BaseException:
        running.stop()
        raise
    return running


def serve_forever(running: RunningGraph, poll_s: float = 0.5) -> int:
    """Block until Ctrl-C or SIGTERM (exit 0) or until the graph cannot go on (the frontend
    died, or a worker that used up its restarts: LaunchError); always stop all."""
    stop_on_signals()
    try:
        while True:
            running.check_serving()
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return 0
    finally:
        running.stop()
