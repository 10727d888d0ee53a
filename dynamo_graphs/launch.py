"""The launcher behind `beam-trt serve GRAPH.yaml`: processes, environment, readiness, logs.

No serving logic lives here. It starts `python -m dynamo.frontend` and every worker of the
graph on loopback only (file discovery in a private folder, TCP request plane, ZMQ event
plane, every DYN_* host variable at 127.0.0.1, HOME in the private folder so Dynamo's model
card cache stays there), waits until the model is listed, every worker instance is
registered and, for a disaggregated graph, the frontend's prefill router is active; then it
streams the logs with component prefixes and stops everything on Ctrl-C or when any one
component exits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
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

from .graph import Graph, WorkerSpec

LOOPBACK = "127.0.0.1"
PREFILL_ROUTER_ACTIVE = "Prefill router target activated"
# Hosts every Dynamo process would otherwise bind or advertise on the first non-loopback
# interface (found in the 1.6.1 runtime; see shared/research/dynamo-local.md).
HOST_VARS = ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST",
             "DYN_HTTP_HOST", "DYN_HTTP_RPC_HOST", "DYN_SYSTEM_HOST")


class LaunchError(RuntimeError):
    """A component that failed to start or died; the message names it and shows its log tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def loopback_env(run_dir: Path) -> dict[str, str]:
    """The environment every process of a graph runs with."""
    env = dict(os.environ)
    env.update({
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(run_dir / "discovery"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_SYSTEM_PORT": "-1",  # no per-worker HTTP status server
        "DYN_SELF_HOST_METADATA": "0",  # model cards go into the discovery folder
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",
        "DYN_PREFILL_DRAIN_TIMEOUT_S": "2",
        "DYN_LOG": env.get("DYN_LOG", "info"),
        "HOME": str(run_dir / "home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # NIXL's UCX backend: shared memory and TCP on the loopback device only.
        "UCX_TLS": env.get("UCX_TLS", "sm,tcp,self"),
        "UCX_NET_DEVICES": "lo",
        "PYTHONUNBUFFERED": "1",
        "NO_COLOR": "1",  # plain log lines: prefixed, grepped by tests, stored in files
    })
    for var in HOST_VARS:
        env[var] = LOOPBACK
    return env


def frontend_argv(graph: Graph, port: int) -> list[str]:
    return [sys.executable, "-m", "dynamo.frontend", "--http-host", LOOPBACK,
            "--http-port", str(port), "--router-mode", graph.frontend.router_mode,
            "--namespace", graph.namespace, "--discovery-backend", "file",
            "--request-plane", "tcp", "--event-plane", "zmq"]


def worker_argv(graph: Graph, spec: WorkerSpec, run_dir: Path | None, index: int) -> list[str]:
    """The worker command line (shared with `beam-trt k8s`, which passes run_dir=None)."""
    t, d, o = graph.timeouts, graph.disaggregation, graph.offload
    argv = ["-m", "dynamo_graphs.worker", "--engine-dir", str(graph.engine_dir),
            "--role", spec.role, "--served-model-name", graph.served_model_name,
            "--namespace", graph.namespace, "--component", spec.name,
            "--kv-transfer-base-s", str(t.kv_transfer_base_s),
            "--kv-transfer-min-mib-s", str(t.kv_transfer_min_mib_s),
            "--kv-handoff-ttl-s", str(t.kv_handoff_ttl_s),
            "--on-transfer-failure", d.on_transfer_failure, "--max-isl", str(d.max_isl)]
    if o.host_mib:
        argv += ["--offload-host-mib", str(o.host_mib)]
    if o.disk_mib:
        disk = o.disk_dir or (run_dir / "offload" if run_dir else Path("/tmp/beam-offload"))
        argv += ["--offload-disk-mib", str(o.disk_mib),
                 "--offload-disk-dir", str(Path(disk) / f"{spec.name}-{index}")]
    if run_dir is not None:
        argv += ["--status-file", str(run_dir / "status" / f"{spec.name}-{index}.json")]
    return argv


@dataclass
class Component:
    name: str  # log prefix, e.g. "decode-1"
    proc: subprocess.Popen
    log_path: Path
    tail: deque = field(default_factory=lambda: deque(maxlen=40))
    reader: threading.Thread | None = None


class RunningGraph:
    """A launched graph: `url`, `components`, `logs(name)`, `stop()`; also a context manager."""

    def __init__(self, graph: Graph, run_dir: Path, echo: TextIO | None):
        self.graph, self.run_dir, self.echo = graph, run_dir, echo
        self.components: dict[str, Component] = {}
        self.port = graph.frontend.http_port or free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self._echo_lock = threading.Lock()
        self._stopped = False
        self.env = loopback_env(run_dir)

    # ------------------------------------------------------------------ processes
    def start_component(self, name: str, argv: list[str]) -> Component:
        log_path = self.run_dir / "logs" / f"{name}.log"
        proc = subprocess.Popen(argv, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=self.run_dir, start_new_session=True, text=True,
                                errors="replace", bufsize=1, preexec_fn=_die_with_parent)
        comp = Component(name, proc, log_path)
        comp.reader = threading.Thread(target=self._pump, args=(comp,), daemon=True,
                                       name=f"log-{name}")
        comp.reader.start()
        self.components[name] = comp
        return comp

    def _pump(self, comp: Component) -> None:
        with open(comp.log_path, "w") as log:
            for line in comp.proc.stdout:
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

    def dead(self) -> list[Component]:
        return [c for c in self.components.values() if c.proc.poll() is not None]

    def check_alive(self) -> None:
        for comp in self.dead():
            comp.reader.join(timeout=2)
            tail = "\n".join(f"  [{comp.name}] {line}" for line in comp.tail)
            raise LaunchError(
                f"component {comp.name} exited with code {comp.proc.returncode}; last log lines "
                f"(full log: {comp.log_path}):\n{tail}")

    def stop(self) -> None:
        """SIGTERM every process group, then SIGKILL what is left after `shutdown_s`."""
        if self._stopped:
            return
        self._stopped = True
        procs = [c.proc for c in self.components.values()]
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + self.graph.timeouts.shutdown_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(timeout=5)
        for c in self.components.values():
            c.reader.join(timeout=2)

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


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)  # the process and its children (its own session)
        except ProcessLookupError:
            pass


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM (systemd, kubectl, kill) stop the graph (main thread only).
    SIGINT is set explicitly: a process started as a background job of a non-interactive shell
    inherits it ignored, and then `kill -INT` (or a demo's Ctrl-C) would never stop the graph."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)


def count_instances(discovery: Path, namespace: str) -> dict[str, int]:
    """Registered `generate` endpoints per component, read from the file-discovery folder.

    Keys there are `v1/instances/<namespace>/<component>/<endpoint>/<id>` (URL-encoded
    or nested, depending on the Dynamo version), so both spellings are accepted.
    """
    from urllib.parse import unquote

    root = discovery / "v1" / "instances"
    counts: dict[str, int] = {}
    if not root.is_dir():
        return counts
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        parts = [p for p in unquote(str(path.relative_to(root))).split("/") if p]
        if len(parts) >= 4 and parts[0] == namespace and parts[2] == "generate":
            counts[parts[1]] = counts.get(parts[1], 0) + 1
    return counts


def launch(graph: Graph, run_dir: str | Path | None = None, echo: TextIO | None = sys.stdout,
           progress: Callable[[str], None] | None = None, wait: bool = True) -> RunningGraph:
    """Start every component of `graph` in parallel and (unless `wait=False`, then call
    `wait_ready()` later) wait until it serves."""
    run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix=f"beam-{graph.name}-"))
    for sub in ("discovery", "home", "logs", "offload", "status"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    running = RunningGraph(graph, run_dir, echo)
    # Share the cores between the workers instead of oversubscribing them (CPU engines).
    n_workers = sum(w.count for w in graph.workers)
    running.env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n_workers)))
    try:
        running.start_component("frontend", frontend_argv(graph, running.port))
        for spec in graph.workers:
            for i in range(spec.count):
                argv = [sys.executable] + worker_argv(graph, spec, run_dir, i)
                running.start_component(f"{spec.name}-{i}", argv)
        if wait:
            running.wait_ready(progress)
    except BaseException:
        running.stop()
        raise
    return running


def serve_forever(running: RunningGraph, poll_s: float = 0.5) -> int:
    """Block until Ctrl-C or SIGTERM (exit 0) or until a component dies (LaunchError);
    always stop all."""
    stop_on_signals()
    try:
        while True:
            running.check_alive()
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return 0
    finally:
        running.stop()
