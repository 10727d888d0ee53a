"""Serving graphs as data: the YAML schema of `dynamo_graphs/*.yaml`, strictly validated.

A graph names the engine dir, the components (frontend, workers with a role and a count),
the router mode, the KV transfer and offload settings and the timeouts. `beam-trt serve`
and `beam-trt k8s` both read it through `load_graph`; every bad field gets one `GraphError`
naming the file and the field path. Relative paths resolve against the graph file's folder,
so a graph means the same thing from any working directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROLES = ("agg", "prefill", "decode")
ROUTER_MODES = ("kv", "round-robin", "random", "least-loaded")
BACKENDS = ("beam", "trtllm")
ON_TRANSFER_FAILURE = ("error", "recompute")
MIB = 1 << 20


class GraphError(ValueError):
    """A serving graph that is malformed; the message names the file and the field."""


@dataclass(frozen=True)
class WorkerSpec:
    name: str  # Dynamo component name, also the log prefix
    role: str
    count: int = 1
    gpus: int = 1


@dataclass(frozen=True)
class FrontendSpec:
    http_host: str = "127.0.0.1"
    http_port: int = 8000  # 0 = pick a free port at launch
    router_mode: str = "kv"
    # Dynamo's request migration: a stream whose worker died is re-sent (with the tokens so
    # far) to another worker up to this many times; 0 = the client gets the error.
    migration_limit: int = 3


@dataclass(frozen=True)
class Restarts:
    """The launcher restarts a dead worker `max` times per `window_s`, waiting `backoff_s`
    before the first restart and doubling it each time (capped at `max_backoff_s`)."""

    max: int = 3
    window_s: float = 300.0
    backoff_s: float = 1.0
    max_backoff_s: float = 10.0


@dataclass(frozen=True)
class Timeouts:
    startup_s: float = 180.0  # frontend + every worker registered and routable
    shutdown_s: float = 10.0  # SIGTERM -> SIGKILL
    # KV transfer budget = base + bytes / min bandwidth: a transfer slower than that is
    # treated as failed instead of waited on forever (the failure mode of TRT-LLM #17665).
    kv_transfer_base_s: float = 5.0
    kv_transfer_min_mib_s: float = 50.0
    # How long a prefill worker keeps a finished prompt's KV pinned for its decode peer.
    kv_handoff_ttl_s: float = 60.0

    def kv_transfer_s(self, nbytes: int) -> float:
        return self.kv_transfer_base_s + nbytes / (self.kv_transfer_min_mib_s * MIB)


@dataclass(frozen=True)
class Disaggregation:
    transport: str = "nixl"
    on_transfer_failure: str = "error"  # or "recompute" the prompt on the decode worker
    # Longest prompt a prefill worker accepts (sizes transfer buffers on TRT-LLM); checked
    # against the engine's max_seq_len at launch. None = max_seq_len - 1.
    max_isl: int | None = None


@dataclass(frozen=True)
class Offload:
    host_mib: float = 0  # 0 = no host tier
    disk_mib: float = 0  # 0 = no disk tier
    disk_dir: Path | None = None  # None = a private folder of the run


@dataclass(frozen=True)
class K8sSpec:
    namespace: str | None = None
    image: str = "nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:1.6.1"
    model_path: str = "/models/beam"  # where the engine/checkpoint is mounted in the pods
    pvc: str | None = None  # PersistentVolumeClaim holding model_path
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "fp8"
    free_gpu_memory_fraction: float = 0.85
    max_seq_len: int | None = None  # None = the model's max_position_embeddings


@dataclass(frozen=True)
class Graph:
    path: Path
    name: str
    engine_dir: Path
    served_model_name: str
    backend: str
    namespace: str
    frontend: FrontendSpec
    workers: tuple[WorkerSpec, ...]
    timeouts: Timeouts = field(default_factory=Timeouts)
    disaggregation: Disaggregation = field(default_factory=Disaggregation)
    offload: Offload = field(default_factory=Offload)
    restarts: Restarts = field(default_factory=Restarts)
    k8s: K8sSpec = field(default_factory=K8sSpec)
    # speculative decoding (docs/SPECULATIVE.md): None = as the engine dir says (on when it
    # has a drafter), False = off, or {draft, tokens, adaptive}
    speculative: Any = None
    # every decode/verify step at one shape, never beside a prefill chunk (docs/ENGINE.md
    # "Batch-invariant mode")
    batch_invariant: bool = False

    @property
    def disaggregated(self) -> bool:
        return any(w.role == "prefill" for w in self.workers)

    def workers_of(self, role: str) -> list[WorkerSpec]:
        return [w for w in self.workers if w.role == role]

    def with_engine_dir(self, engine_dir: str | Path) -> "Graph":
        from dataclasses import replace

        return replace(self, engine_dir=Path(engine_dir).resolve())


# ---------------------------------------------------------------------------------- parsing
class _Reader:
    """Typed access to one YAML mapping that refuses unknown keys and wrong types."""

    def __init__(self, raw: Any, where: str, path: str):
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise GraphError(f"{where}: {path or 'the file'} must be a mapping, got {_kind(raw)}")
        self.raw, self.where, self.path, self.used = raw, where, path, set()

    def _field(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, kind: type | tuple, default: Any = ..., *, choices=None,
            minimum: float | None = None) -> Any:
        self.used.add(key)
        if key not in self.raw or self.raw[key] is None:
            if default is ...:
                raise GraphError(f"{self.where}: missing required field {self._field(key)}")
            return default
        value = self.raw[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise GraphError(f"{self.where}: {self._field(key)} must be {names}, got {value!r}")
        if choices is not None and value not in choices:
            raise GraphError(
                f"{self.where}: {self._field(key)} is {value!r}; allowed: {', '.join(choices)}"
            )
        if minimum is not None and value < minimum:
            raise GraphError(f"{self.where}: {self._field(key)} must be >= {minimum}, got {value}")
        return value

    def sub(self, key: str) -> "_Reader":
        self.used.add(key)
        return _Reader(self.raw.get(key), self.where, self._field(key))

    def done(self) -> None:
        extra = sorted(set(self.raw) - self.used)
        if extra:
            raise GraphError(f"{self.where}: unknown field {self._field(str(extra[0]))}")


def _kind(value: Any) -> str:
    return type(value).__name__


def load_graph(path: str | Path, engine_dir: str | Path | None = None) -> Graph:
    """Read and validate a graph file; `engine_dir` overrides the file's `engine_dir`."""
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise GraphError(f"{where}: no such graph file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise GraphError(f"{where}: not valid YAML ({exc})") from None
    return parse_graph(raw, path, engine_dir)


def parse_graph(raw: Any, path: Path, engine_dir: str | Path | None = None) -> Graph:
    where = str(path)
    top = _Reader(raw, where, "")
    base = path.resolve().parent
    name = top.get("name", str)
    _check_dns_name(name, where, "name")
    file_engine_dir = top.get("engine_dir", str)
    resolved = Path(engine_dir) if engine_dir is not None else base / file_engine_dir
    graph = Graph(
        path=path,
        name=name,
        engine_dir=resolved.resolve(),
        served_model_name=top.get("served_model_name", str, "beam"),
        backend=top.get("backend", str, "beam", choices=BACKENDS),
        namespace=top.get("namespace", str, "beam"),
        frontend=_frontend(top.sub("frontend")),
        workers=_workers(top, where),
        timeouts=_timeouts(top.sub("timeouts")),
        disaggregation=_disaggregation(top.sub("disaggregation")),
        offload=_offload(top.sub("offload"), base),
        restarts=_restarts(top.sub("restarts")),
        k8s=_k8s(top.sub("k8s")),
        speculative=_speculative(top, base, where),
        batch_invariant=top.get("batch_invariant", bool, False),
    )
    top.done()
    _check_roles(graph, where)
    return graph


def _speculative(top: _Reader, base: Path, where: str):
    """`speculative: {draft: DIR, tokens: N, adaptive: bool}` | true | false (checked here,
    so a bad block fails `serve` before any process starts); `draft` is relative to the file."""
    from beam_trtllm.engine.speculative import SpecConfig
    from beam_trtllm.engine.types import EngineError

    top.used.add("speculative")
    raw = top.raw.get("speculative")
    try:
        spec = SpecConfig.from_json(raw, where)
    except EngineError as exc:
        raise GraphError(str(exc)) from None
    if spec is None:
        return None if raw is None else False
    out = {"tokens": spec.tokens, "adaptive": spec.adaptive, "compile": spec.compile}
    if spec.draft is not None:
        out["draft"] = str((base / spec.draft).resolve())
    return out


def _frontend(r: _Reader) -> FrontendSpec:
    spec = FrontendSpec(
        http_host=r.get("http_host", str, "127.0.0.1"),
        http_port=r.get("http_port", int, 8000, minimum=0),
        router_mode=r.get("router_mode", str, "kv", choices=ROUTER_MODES),
        migration_limit=r.get("migration_limit", int, FrontendSpec.migration_limit, minimum=0),
    )
    if spec.http_port > 65535:
        raise GraphError(f"{r.where}: frontend.http_port must be <= 65535, got {spec.http_port}")
    r.done()
    return spec


def _workers(top: _Reader, where: str) -> tuple[WorkerSpec, ...]:
    top.used.add("workers")
    raw = top.raw.get("workers")
    if not isinstance(raw, list) or not raw:
        raise GraphError(f"{where}: workers must be a non-empty list of worker groups")
    out, names = [], set()
    for i, item in enumerate(raw):
        r = _Reader(item, where, f"workers[{i}]")
        role = r.get("role", str, choices=ROLES)
        name = r.get("name", str, role)
        _check_dns_name(name, where, f"workers[{i}].name")
        if name in names or name == "frontend":
            raise GraphError(f"{where}: workers[{i}].name {name!r} is used twice")
        names.add(name)
        out.append(WorkerSpec(name=name, role=role, count=r.get("count", int, 1, minimum=1),
                              gpus=r.get("gpus", int, 1, minimum=0)))
        r.done()
    return tuple(out)


def _timeouts(r: _Reader) -> Timeouts:
    d = Timeouts()
    t = Timeouts(
        startup_s=r.get("startup_s", float, d.startup_s, minimum=1.0),
        shutdown_s=r.get("shutdown_s", float, d.shutdown_s, minimum=0.5),
        kv_transfer_base_s=r.get("kv_transfer_base_s", float, d.kv_transfer_base_s, minimum=0.1),
        kv_transfer_min_mib_s=r.get("kv_transfer_min_mib_s", float, d.kv_transfer_min_mib_s,
                                    minimum=0.001),
        kv_handoff_ttl_s=r.get("kv_handoff_ttl_s", float, d.kv_handoff_ttl_s, minimum=1.0),
    )
    r.done()
    return t


def _disaggregation(r: _Reader) -> Disaggregation:
    d = Disaggregation(
        transport=r.get("transport", str, "nixl", choices=("nixl",)),
        on_transfer_failure=r.get("on_transfer_failure", str, "error",
                                  choices=ON_TRANSFER_FAILURE),
        max_isl=r.get("max_isl", int, None, minimum=1),
    )
    r.done()
    return d


def _restarts(r: _Reader) -> Restarts:
    d = Restarts()
    out = Restarts(max=r.get("max", int, d.max, minimum=0),
                   window_s=r.get("window_s", float, d.window_s, minimum=1.0),
                   backoff_s=r.get("backoff_s", float, d.backoff_s, minimum=0.0),
                   max_backoff_s=r.get("max_backoff_s", float, d.max_backoff_s, minimum=0.0))
    r.done()
    return out


def _offload(r: _Reader, base: Path) -> Offload:
    disk_dir = r.get("disk_dir", str, None)
    o = Offload(
        host_mib=r.get("host_mib", float, 0.0, minimum=0),
        disk_mib=r.get("disk_mib", float, 0.0, minimum=0),
        disk_dir=(base / disk_dir).resolve() if disk_dir else None,
    )
    r.done()
    if o.disk_mib and not o.host_mib:
        raise GraphError(f"{r.where}: offload.disk_mib needs a host tier (offload.host_mib > 0)")
    return o


def _k8s(r: _Reader) -> K8sSpec:
    d = K8sSpec()
    k = K8sSpec(
        namespace=r.get("namespace", str, None),
        image=r.get("image", str, d.image),
        model_path=r.get("model_path", str, d.model_path),
        pvc=r.get("pvc", str, None),
        tensor_parallel_size=r.get("tensor_parallel_size", int, 1, minimum=1),
        kv_cache_dtype=r.get("kv_cache_dtype", str, "fp8", choices=("fp8", "auto")),
        free_gpu_memory_fraction=r.get("free_gpu_memory_fraction", float, 0.85, minimum=0.05),
        max_seq_len=r.get("max_seq_len", int, None, minimum=1),
    )
    r.done()
    if k.free_gpu_memory_fraction > 0.98:
        raise GraphError(f"{r.where}: k8s.free_gpu_memory_fraction must be <= 0.98")
    return k


def _check_roles(graph: Graph, where: str) -> None:
    roles = {w.role for w in graph.workers}
    if "agg" in roles and roles & {"prefill", "decode"}:
        raise GraphError(f"{where}: workers mix role agg with prefill/decode; use one or the other")
    if roles & {"prefill", "decode"} and roles != {"prefill", "decode"}:
        missing = ({"prefill", "decode"} - roles).pop()
        raise GraphError(f"{where}: a disaggregated graph needs a {missing} worker group")


def _check_dns_name(name: str, where: str, fld: str) -> None:
    import re

    # Kubernetes names (DGD components must match this), so `beam-trt k8s` never fails later.
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name):
        raise GraphError(f"{where}: {fld} {name!r} must be lower-case letters, digits and '-'")
