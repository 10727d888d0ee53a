"""`beam-trt k8s GRAPH.yaml`: the graph as a Dynamo `DynamoGraphDeployment` (nvidia.com/v1beta1).

Components: the frontend, and one component per worker group (type prefill / decode /
worker), each with its replica count and GPU limit. With `backend: trtllm` the workers run
`python3 -m dynamo.trtllm` and get their TRT-LLM engine args inline through
`--override-engine-args` (a DGD cannot ship a file): the per-layer `max_attention_window`
list is generated from `BeamConfig.layer_types` (TRT-LLM only auto-fills it for regular
patterns), and disaggregated workers get a NIXL cache transceiver whose buffer holds the
longest prompt and whose transfer timeout is finite and derived from the graph (the
deadlocks of Dynamo #4327 and TRT-LLM #17665 are what these two settings prevent).
With `backend: beam` the workers run this project's worker, `python3 -m dynamo_graphs.worker`.
"""

from __future__ import annotations

import json
from typing import Any

from beam_trtllm.config import BeamConfig

from .graph import Graph, WorkerSpec
from .launch import worker_argv

API_VERSION = "nvidia.com/v1beta1"
COMPONENT_TYPE = {"agg": "worker", "prefill": "prefill", "decode": "decode"}
KV_BLOCK_SIZE = 32  # TRT-LLM tokens_per_block: identical on prefill and decode by construction


def max_attention_window(cfg: BeamConfig, max_seq_len: int) -> list[int]:
    """One entry per layer, in `layer_types` order: the window for sliding layers."""
    return [cfg.sliding_window if t == "sliding_attention" else max_seq_len
            for t in cfg.layer_types]


def trtllm_engine_args(graph: Graph, cfg: BeamConfig, role: str) -> dict[str, Any]:
    """TorchLlmArgs for one role (the keys of `--extra-engine-args` / `trtllm-serve --config`)."""
    k = graph.k8s
    max_seq_len = min(cfg.max_position_embeddings, k.max_seq_len or cfg.max_position_embeddings)
    max_isl = min(graph.disaggregation.max_isl, max_seq_len)
    args: dict[str, Any] = {
        "backend": "pytorch",
        "trust_remote_code": True,
        "tensor_parallel_size": k.tensor_parallel_size,
        "moe_expert_parallel_size": k.tensor_parallel_size,
        "max_seq_len": max_seq_len,
        "max_num_tokens": max(8192, max_isl) if role != "decode" else 256,
        "enable_chunked_prefill": role != "decode",
        # "Overlap scheduler not currently supported in prefill only workers."
        "disable_overlap_scheduler": role == "prefill",
        "kv_cache_config": {
            "dtype": k.kv_cache_dtype,
            "free_gpu_memory_fraction": k.free_gpu_memory_fraction,
            "tokens_per_block": KV_BLOCK_SIZE,
            "max_attention_window": max_attention_window(cfg, max_seq_len),
            # Block reuse while a disaggregated send is in flight can deadlock the decode
            # side (TRT-LLM #12542); decode never reuses prefixes anyway.
            "enable_block_reuse": role != "decode",
        },
    }
    if role in ("prefill", "decode"):
        kv_dtype = "fp8" if k.kv_cache_dtype == "fp8" else "bf16"
        timeout_s = graph.timeouts.kv_transfer_s(cfg.kv_bytes(max_isl, kv_dtype))
        args["cache_transceiver_config"] = {
            "backend": "NIXL",
            "max_tokens_in_buffer": max_isl,  # must be >= the longest prompt (Dynamo #4327)
            "kv_transfer_timeout_ms": int(timeout_s * 1000),
        }
    return args


def _container(graph: Graph, command: list[str], args: list[str], gpus: int) -> dict:
    c: dict[str, Any] = {"name": "main", "image": graph.k8s.image,
                         "command": command, "args": args}
    if gpus:
        c["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)},
                          "requests": {"nvidia.com/gpu": str(gpus)}}
    if graph.k8s.pvc:
        c["volumeMounts"] = [{"name": "model", "mountPath": graph.k8s.model_path,
                              "readOnly": True}]
    return c


def _component(graph: Graph, name: str, ctype: str, replicas: int, container: dict) -> dict:
    spec: dict[str, Any] = {"containers": [container]}
    if graph.k8s.pvc:
        spec["volumes"] = [{"name": "model", "persistentVolumeClaim": {
            "claimName": graph.k8s.pvc, "readOnly": True}}]
    return {"name": name, "type": ctype, "replicas": replicas, "podTemplate": {"spec": spec}}


def _worker_component(graph: Graph, cfg: BeamConfig, w: WorkerSpec) -> dict:
    if graph.backend == "trtllm":
        args = ["--model", graph.k8s.model_path, "--served-model-name", graph.served_model_name,
                "--disaggregation-mode", w.role, "--kv-block-size", str(KV_BLOCK_SIZE),
                "--override-engine-args", json.dumps(trtllm_engine_args(graph, cfg, w.role),
                                                     separators=(",", ":"))]
        if w.role != "decode":
            args.append("--publish-kv-events")  # the KV router scores prefill/agg workers
        command = ["python3", "-m", "dynamo.trtllm"]
    else:
        in_pod = graph.with_engine_dir(graph.k8s.model_path)
        argv = worker_argv(in_pod, w, None, 0)
        command, args = ["python3"] + argv[:2], argv[2:]
    return _component(graph, w.name, COMPONENT_TYPE[w.role], w.count,
                      _container(graph, command, args, w.gpus))


def render_dgd(graph: Graph, cfg: BeamConfig) -> dict:
    """The DynamoGraphDeployment manifest of `graph` as a dict (yaml.safe_dump it)."""
    frontend = _component(graph, "frontend", "frontend", 1, _container(
        graph, ["python3", "-m", "dynamo.frontend"],
        ["--router-mode", graph.frontend.router_mode,
         "--http-port", str(graph.frontend.http_port or 8000)], 0))
    spec: dict[str, Any] = {
        "components": [frontend] + [_worker_component(graph, cfg, w) for w in graph.workers]}
    if graph.backend == "trtllm":
        spec["backendFramework"] = "trtllm"
    metadata: dict[str, Any] = {"name": graph.name,
                                "labels": {"app.kubernetes.io/part-of": "beam-trt"}}
    if graph.k8s.namespace:
        metadata["namespace"] = graph.k8s.namespace
    return {"apiVersion": API_VERSION, "kind": "DynamoGraphDeployment",
            "metadata": metadata, "spec": spec}
