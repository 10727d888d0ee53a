"""Serving graphs as data: the shipped YAMLs load, and every bad field gets one clear error."""

from pathlib import Path

import pytest
import yaml

from dynamo_graphs.graph import GraphError, load_graph
from dynamo_graphs.launch import count_instances, worker_argv

GRAPHS = Path(__file__).resolve().parents[1] / "dynamo_graphs"


def test_shipped_graphs_load_with_their_components():
    agg = load_graph(GRAPHS / "agg.yaml")
    assert not agg.disaggregated and [(w.name, w.role, w.count) for w in agg.workers] == [
        ("backend", "agg", 1)]
    assert agg.engine_dir == (GRAPHS.parent / "out" / "demo" / "tiny-nvfp4-engine").resolve()
    assert agg.frontend.router_mode == "kv" and agg.frontend.http_host == "127.0.0.1"
    dis = load_graph(GRAPHS / "disagg.yaml")
    assert dis.disaggregated and [w.role for w in dis.workers] == ["prefill", "decode"]
    assert dis.offload.host_mib == 0
    off = load_graph(GRAPHS / "disagg_offload.yaml", engine_dir="/x/engine")
    assert off.engine_dir == Path("/x/engine") and off.offload.host_mib == 64
    assert off.offload.disk_mib == 256 and off.offload.disk_dir is None


def test_worker_command_line_carries_the_graph_settings(tmp_path):
    off = load_graph(GRAPHS / "disagg_offload.yaml", engine_dir="/x/engine")
    argv = worker_argv(off, off.workers[0], tmp_path, 3)
    flags = dict(zip(argv[2::2], argv[3::2]))
    assert argv[:2] == ["-m", "dynamo_graphs.worker"]
    assert flags["--engine-dir"] == "/x/engine" and flags["--role"] == "prefill"
    assert flags["--component"] == "prefill" and flags["--offload-host-mib"] == "64.0"
    assert flags["--offload-disk-dir"] == str(tmp_path / "offload" / "prefill-3")
    assert flags["--kv-transfer-base-s"] == "5.0" and flags["--on-transfer-failure"] == "error"


def test_the_speculative_block_reaches_every_worker(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump({**BASE, "speculative": {"tokens": 5, "adaptive": True,
                                                            "draft": "drafter"}}))
    graph = load_graph(path)
    flags = dict(zip(*[iter(worker_argv(graph, graph.workers[0], tmp_path, 0)[2:])] * 2))
    import json

    assert json.loads(flags["--speculative"]) == {"tokens": 5, "adaptive": True, "compile": True,
                                                  "draft": str(tmp_path / "drafter")}
    path.write_text(yaml.safe_dump({**BASE, "speculative": False}))
    assert json.loads(dict(zip(*[iter(worker_argv(load_graph(path), graph.workers[0], tmp_path,
                                                   0)[2:])] * 2))["--speculative"]) is False


def test_batch_invariant_reaches_every_worker(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump({**BASE, "batch_invariant": True}))
    graph = load_graph(path)
    assert "--batch-invariant" in worker_argv(graph, graph.workers[0], tmp_path, 0)
    path.write_text(yaml.safe_dump(BASE))
    assert "--batch-invariant" not in worker_argv(load_graph(path), graph.workers[0], tmp_path, 0)


BASE = {"name": "g", "engine_dir": "e", "workers": [{"role": "agg"}]}


@pytest.mark.parametrize("edit, message", [
    ({"workers": []}, "workers must be a non-empty list"),
    ({"workers": [{"role": "agg", "cuont": 2}]}, r"unknown field workers\[0\].cuont"),
    ({"workers": [{"role": "mixed"}]}, r"workers\[0\].role is 'mixed'; allowed: agg, prefill"),
    ({"workers": [{"role": "agg", "count": 0}]}, r"workers\[0\].count must be >= 1"),
    ({"workers": [{"role": "agg", "count": "2"}]}, r"workers\[0\].count must be int"),
    ({"workers": [{"role": "prefill"}]}, "needs a decode worker group"),
    ({"workers": [{"role": "agg"}, {"role": "decode"}]}, "mix role agg"),
    ({"workers": [{"role": "agg"}, {"role": "agg"}]}, "'agg' is used twice"),
    ({"workers": [{"role": "agg", "name": "Agg_1"}]}, "lower-case"),
    ({"frontend": {"router_mode": "kv-aware"}}, "frontend.router_mode is 'kv-aware'"),
    ({"frontend": {"http_port": 70000}}, "http_port must be <= 65535"),
    ({"timeouts": {"kv_transfer_base_s": 0}}, "timeouts.kv_transfer_base_s must be >= 0.1"),
    ({"offload": {"disk_mib": 10}}, "needs a host tier"),
    ({"offload": {"host_mib": -1}}, "offload.host_mib must be >= 0"),
    ({"disaggregation": {"on_transfer_failure": "retry"}}, "allowed: error, recompute"),
    ({"k8s": {"image": 3}}, "k8s.image must be str"),
    ({"backend": "vllm"}, "backend is 'vllm'"),
    ({"engine_dir": None}, "missing required field engine_dir"),
    ({"extra": 1}, "unknown field extra"),
    ({"speculative": {"tokens": 0}}, "speculative.tokens must be an integer >= 1"),
    ({"speculative": {"token": 4}}, "speculative has an unknown field 'token'"),
    ({"speculative": {"adaptive": "yes"}}, "speculative.adaptive must be true or false"),
    ({"speculative": 3}, "speculative must be a mapping, true or false"),
    ({"batch_invariant": "yes"}, "batch_invariant must be bool"),
])
def test_bad_fields_are_named(tmp_path, edit, message):
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump({**BASE, **edit}))
    with pytest.raises(GraphError, match=message) as info:
        load_graph(path)
    assert str(path) in str(info.value)


def test_unreadable_files_are_named(tmp_path):
    with pytest.raises(GraphError, match="no such graph file"):
        load_graph(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(GraphError, match="not valid YAML"):
        load_graph(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(GraphError, match="must be a mapping, got list"):
        load_graph(bad)


def test_registered_instances_are_counted_per_component(tmp_path):
    inst = tmp_path / "v1" / "instances"
    for comp, ids in (("prefill", [1, 2]), ("decode", [3])):
        for i in ids:
            p = inst / "beam" / comp / "generate" / f"{i:x}"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("{}")
    other = inst / "beam" / "decode" / "worker_kv_query_source" / "3"
    other.parent.mkdir(parents=True)
    other.write_text("{}")
    (inst / "beam%2Fprefill%2Fgenerate%2F9").write_text("{}")  # URL-encoded spelling
    assert count_instances(tmp_path, "beam") == {"prefill": 3, "decode": 1}
    assert count_instances(tmp_path, "other") == {}


def test_decode_workers_get_no_offload_tier(tmp_path):
    """Their KV arrives by transfer and they never look a prefix up: a tier would only fill."""
    off = load_graph(GRAPHS / "disagg_offload.yaml", engine_dir="/x/engine")
    decode = next(w for w in off.workers if w.role == "decode")
    assert not any(a.startswith("--offload") for a in worker_argv(off, decode, tmp_path, 0))


def test_max_isl_is_checked_against_the_engine_before_anything_starts(tmp_path):
    import json

    from dynamo_graphs.launch import check_engine_limits

    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "engine.json").write_text(json.dumps({"options": {"max_seq_len": 512}}))
    raw = {**BASE, "engine_dir": "engine", "workers": [{"role": "prefill"}, {"role": "decode"}]}
    path = tmp_path / "g.yaml"
    for isl, ok in ((511, True), (512, False), (4096, False)):
        path.write_text(yaml.safe_dump({**raw, "disaggregation": {"max_isl": isl}}))
        if ok:
            assert check_engine_limits(load_graph(path)) == 512
        else:
            with pytest.raises(GraphError, match=f"max_isl is {isl}, but the engine .* "
                                                 "max_seq_len 512"):
                check_engine_limits(load_graph(path))
