"""`beam-trt k8s`: DynamoGraphDeployment manifests checked against the CRD's real schema."""

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from beam_trtllm.cli import main
from beam_trtllm.config import preset
from dynamo_graphs.graph import load_graph
from beam_trtllm.trtllm.llm_args import max_attention_window
from dynamo_graphs.k8s import render_dgd, trtllm_engine_args
from helpers.openapi import validate

GRAPHS = Path(__file__).resolve().parents[1] / "dynamo_graphs"
SCHEMA = json.loads((Path(__file__).parent / "data" / "dgd_v1beta1_openapi.json").read_text())


def _graph(name, tmp_path, **edits):
    raw = yaml.safe_load((GRAPHS / name).read_text())
    for key, value in edits.items():
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return load_graph(path)


def _check_cel_rules(manifest):
    """The CRD's CEL rules that can apply to what we render (listed from the schema)."""
    comps = manifest["spec"]["components"]
    names = [c["name"].lower() for c in comps]
    assert len(names) == len(set(names)), "component names must be unique (case-insensitive)"
    for c in comps:
        assert "eppConfig" not in c and "minAvailable" not in c
        mains = [k for k in c["podTemplate"]["spec"]["containers"] if k["name"] == "main"]
        assert len(mains) == 1 and mains[0]["image"], "podTemplate needs a 'main' container"


@pytest.mark.parametrize("name", ["agg.yaml", "disagg.yaml", "disagg_offload.yaml"])
@pytest.mark.parametrize("backend", ["trtllm", "beam"])
def test_rendered_manifest_conforms_to_the_crd_schema(name, backend, tmp_path):
    graph = _graph(name, tmp_path, backend=backend, **{"k8s.pvc": "beam-weights"})
    manifest = render_dgd(graph, preset("beam-1.0-501b"))
    # Round-trip through YAML text: what kubectl would receive.
    manifest = yaml.safe_load(yaml.safe_dump(manifest))
    assert manifest["apiVersion"] == SCHEMA["apiVersion"]
    assert validate(manifest, SCHEMA["openAPIV3Schema"]) == []
    _check_cel_rules(manifest)
    types = {c["name"]: (c["type"], c["replicas"]) for c in manifest["spec"]["components"]}
    assert types["frontend"] == ("frontend", 1)
    for w in graph.workers:
        expected_type = {"agg": "worker"}.get(w.role, w.role)
        assert types[w.name] == (expected_type, w.count)


def test_the_checker_rejects_what_the_api_server_would_reject(tmp_path):
    manifest = render_dgd(_graph("disagg.yaml", tmp_path), preset("tiny"))
    bad = yaml.safe_load(yaml.safe_dump(manifest))
    bad["spec"]["components"][1]["type"] = "prefiller"
    bad["spec"]["components"][2]["replicaz"] = 2
    bad["spec"]["components"][0]["podTemplate"]["spec"]["containers"][0]["args"] = "--x"
    errors = validate(bad, SCHEMA["openAPIV3Schema"])
    assert any("components[1].type: 'prefiller' not in" in e for e in errors), errors
    assert any("components[2].replicaz: unknown field" in e for e in errors), errors
    assert any("containers[0].args: must be array" in e for e in errors), errors


def test_trtllm_disagg_workers_get_beam_engine_args(tmp_path):
    cfg = preset("beam-1.0-501b")
    graph = _graph("disagg.yaml", tmp_path, backend="trtllm",
                   **{"disaggregation.max_isl": 32768, "k8s.max_seq_len": 131072,
                      "k8s.tensor_parallel_size": 8})
    manifest = render_dgd(graph, cfg)
    by_name = {c["name"]: c for c in manifest["spec"]["components"]}
    for role in ("prefill", "decode"):
        main_c = by_name[role]["podTemplate"]["spec"]["containers"][0]
        assert main_c["command"] == ["python3", "-m", "beam_trtllm.trtllm.dynamo_worker"]
        args = main_c["args"]
        assert args[args.index("--disaggregation-mode") + 1] == role
        engine = json.loads(args[args.index("--override-engine-args") + 1])
        assert engine == trtllm_engine_args(graph, cfg, role)
        window = engine["kv_cache_config"]["max_attention_window"]
        assert len(window) == cfg.num_hidden_layers == 52
        assert [i for i, w in enumerate(window) if w == 131072] == list(cfg.full_layers)
        assert all(window[i] == 512 for i in cfg.sliding_layers)
        ct = engine["cache_transceiver_config"]
        assert ct["backend"] == "NIXL" and ct["max_tokens_in_buffer"] >= 32768
        # Finite and derived: base + bytes of a max-ISL prompt's KV / the minimum bandwidth.
        kv = cfg.kv_bytes(32768, "fp8")
        assert ct["kv_transfer_timeout_ms"] == int((5.0 + kv / (50.0 * 2**20)) * 1000)
        assert main_c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert ("--publish-kv-events" in args) == (role == "prefill")
    assert json.loads(by_name["prefill"]["podTemplate"]["spec"]["containers"][0]["args"][-2])[
        "disable_overlap_scheduler"] is True
    assert manifest["spec"]["backendFramework"] == "trtllm"


def test_tiny_window_list_follows_layer_types():
    cfg = preset("tiny")
    assert max_attention_window(cfg, 4096) == [8, 4096, 8, 8, 4096, 4096]


def test_cli_renders_yaml_and_reports_bad_input_without_traceback(tmp_path):
    runner = CliRunner()
    out = tmp_path / "dgd.yaml"
    res = runner.invoke(main, ["k8s", str(GRAPHS / "disagg.yaml"), "--preset", "tiny",
                               "-o", str(out)])
    assert res.exit_code == 0, res.output
    manifest = yaml.safe_load(out.read_text())
    assert validate(manifest, SCHEMA["openAPIV3Schema"]) == []
    res = runner.invoke(main, ["k8s", str(GRAPHS / "disagg.yaml"),
                               "--engine-dir", str(tmp_path / "missing")])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "config.json" in res.output and "--preset" in res.output


def test_cli_names_a_trtllm_option_the_model_cannot_take(tmp_path):
    graph = tmp_path / "g.yaml"
    raw = yaml.safe_load((GRAPHS / "disagg.yaml").read_text())
    raw.update(backend="trtllm", k8s={"tensor_parallel_size": 5})
    graph.write_text(yaml.safe_dump(raw))
    res = CliRunner().invoke(main, ["k8s", str(graph), "--preset", "beam-1.0-501b"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "tensor_parallel_size: 5 does not divide num_attention_heads (48)" in res.output
