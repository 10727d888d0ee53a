"""What every process of a served graph runs with: the loopback environment, the frontend's
and the workers' command lines, free ports, and the checks made before anything starts.

Everything is on 127.0.0.1 (file discovery in a private folder, TCP request plane, ZMQ event
plane, every DYN_* host variable at loopback, HOME in the private folder so Dynamo's model
card cache stays there). `beam-trt k8s` shares `worker_argv`.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import sys
from pathlib import Path
from urllib.parse import unquote

from .graph import Graph, GraphError, WorkerSpec

LOOPBACK = "127.0.0.1"
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


def free_system_port() -> int:
    """A free port below 32768: Dynamo 1.6.1 reads DYN_SYSTEM_PORT as an i16."""
    for port in random.sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    raise LaunchError("no free port in 20000-32767 for a worker's system endpoint")


def loopback_env(run_dir: Path) -> dict[str, str]:
    """The environment every process of a graph runs with."""
    env = dict(os.environ)
    env.update({
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(run_dir / "discovery"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_SYSTEM_PORT": "-1",  # workers get their own port (metrics, health) at start
        "DYN_SELF_HOST_METADATA": "0",  # model cards go into the discovery folder
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",
        "DYN_PREFILL_DRAIN_TIMEOUT_S": "2",
        "DYN_LOG": env.get("DYN_LOG", "info"),
        "HOME": str(run_dir / "home"),
        "TMPDIR": str(run_dir / "tmp"),  # Dynamo writes a logging config per process there
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
    return [sys.executable, "-m", "beam_trtllm.chat.frontend", "--http-host", LOOPBACK,
            "--http-port", str(port), "--router-mode", graph.frontend.router_mode,
            "--namespace", graph.namespace, "--discovery-backend", "file",
            "--request-plane", "tcp", "--event-plane", "zmq",
            "--migration-limit", str(graph.frontend.migration_limit)]


def worker_argv(graph: Graph, spec: WorkerSpec, run_dir: Path | None, index: int) -> list[str]:
    """The worker command line (shared with `beam-trt k8s`, which passes run_dir=None)."""
    t, d, o = graph.timeouts, graph.disaggregation, graph.offload
    argv = ["-m", "dynamo_graphs.worker", "--engine-dir", str(graph.engine_dir),
            "--role", spec.role, "--served-model-name", graph.served_model_name,
            "--namespace", graph.namespace, "--component", spec.name,
            "--kv-transfer-base-s", str(t.kv_transfer_base_s),
            "--kv-transfer-min-mib-s", str(t.kv_transfer_min_mib_s),
            "--kv-handoff-ttl-s", str(t.kv_handoff_ttl_s),
            "--on-transfer-failure", d.on_transfer_failure]
    if d.max_isl is not None:
        argv += ["--max-isl", str(d.max_isl)]
    # A decode worker never looks a prefix up (its KV arrives by transfer): tiers there
    # would be written and never read.
    if o.host_mib and spec.role != "decode":
        argv += ["--offload-host-mib", str(o.host_mib)]
    if o.disk_mib and spec.role != "decode":
        disk = o.disk_dir or (run_dir / "offload" if run_dir else Path("/tmp/beam-offload"))
        argv += ["--offload-disk-mib", str(o.disk_mib),
                 "--offload-disk-dir", str(Path(disk) / f"{spec.name}-{index}")]
    if graph.speculative is not None:
        argv += ["--speculative", json.dumps(graph.speculative)]
    if graph.batch_invariant:
        argv += ["--batch-invariant"]
    if run_dir is not None:
        argv += ["--status-file", str(run_dir / "status" / f"{spec.name}-{index}.json")]
    return argv


def count_instances(discovery: Path, namespace: str) -> dict[str, int]:
    """Registered `generate` endpoints per component, read from the file-discovery folder.

    Keys there are `v1/instances/<namespace>/<component>/<endpoint>/<id>` (URL-encoded
    or nested, depending on the Dynamo version), so both spellings are accepted.
    """
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


def check_engine_limits(graph: Graph) -> int:
    """The graph's prompt limit against the engine's context, before anything starts; returns
    the engine's max_seq_len."""
    spec = graph.engine_dir / "engine.json"
    if not spec.is_file() and (graph.engine_dir / "parallel.json").is_file():
        spec = graph.engine_dir / "rank0" / "engine.json"  # a parallel engine: its ranks' options
    try:
        max_seq_len = int(json.loads(spec.read_text())["options"]["max_seq_len"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GraphError(f"{graph.path}: cannot read max_seq_len from {spec}: {exc}") from None
    isl = graph.disaggregation.max_isl
    if isl is not None and isl >= max_seq_len:
        raise GraphError(f"{graph.path}: disaggregation.max_isl is {isl}, but the engine "
                         f"{graph.engine_dir} has max_seq_len {max_seq_len} (a prompt must "
                         f"leave room for one generated token: max_isl <= {max_seq_len - 1})")
    return max_seq_len


# A token of text is a few characters; JSON escaping can take 6 bytes per character (\uXXXX),
# and tool schemas ride along: 96 bytes per context token bounds any body that can fit.
BODY_BYTES_PER_TOKEN = 96


def body_limit_mib(max_seq_len: int) -> int:
    """DYN_HTTP_BODY_LIMIT_MB for the frontend: Dynamo refuses a larger body before it parses it."""
    return max(1, math.ceil(max_seq_len * BODY_BYTES_PER_TOKEN / 2**20))


def check_port_free(port: int) -> None:
    """A busy HTTP port is reported at once, not after the frontend gives up."""
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError as exc:
            raise LaunchError(f"frontend port {LOOPBACK}:{port} is not free ({exc.strerror}); "
                              "set frontend.http_port (0 = any free port) or --port") from None


def signal_group(proc, sig: int) -> None:
    """Send sig to a started component's process group (the process and its children, which
    run in its own session), if it still runs."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
