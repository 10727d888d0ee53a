"""BeamConfig: spec facts checked against hand-written values, and bad configs refused."""

import json

import pytest
from click.testing import CliRunner

from beam_trtllm.cli import main
from beam_trtllm.config import FULL, PRESETS, SLIDING, BeamConfig, ConfigError, preset
from beam_trtllm.reference import ssmax_scale

BEAM = PRESETS["beam-1.0-501b"]


def test_501b_full_layers_are_the_published_ones():
    assert BEAM.full_layers == (5, 11, 17, 23, 29, 35, 41, 47, 51)
    assert len(BEAM.sliding_layers) == 43
    assert BEAM.dense_layers == (0, 1, 2)
    assert BEAM.moe_layers == tuple(range(3, 52))


def test_501b_parameter_counts():
    assert round(BEAM.total_params / 1e9, 2) == 500.96
    assert round(BEAM.active_params / 1e9, 2) == 23.13


def test_501b_kv_bytes():
    # 9 full layers x 8 KV heads x 128 dims x (K and V) x bytes
    assert BEAM.kv_bytes_per_token("bf16") == 9 * 8 * 128 * 2 * 2 == 36 * 1024
    assert BEAM.kv_bytes_per_token("fp8") == 18 * 1024
    assert (1 << 20) * BEAM.kv_bytes_per_token("fp8") == 18 * (1 << 30)


def test_presets_are_exact_keys():
    assert set(PRESETS) == {"beam-1.0-501b", "tiny"}
    with pytest.raises(ConfigError, match="unknown preset 'beam'"):
        preset("beam")


def test_tiny_exercises_every_feature():
    tiny = PRESETS["tiny"]
    assert len(tiny.dense_layers) >= 1 and len(tiny.moe_layers) >= 1
    assert len(tiny.full_layers) >= 2 and len(tiny.sliding_layers) >= 1
    assert tiny.sliding_window < 32  # test sequences are longer than the window
    assert tiny.n_group > tiny.topk_group  # whole groups are dropped
    assert tiny.num_attention_heads // tiny.num_key_value_heads > 1  # GQA
    assert float(ssmax_scale(__import__("torch").tensor(64.0), tiny.ssmax_base,
                             tiny.ssmax_exponent)) > 1.3


def test_hf_round_trip(tmp_path):
    raw = BEAM.to_hf()
    assert raw["model_type"] == "beam" and raw["architectures"] == ["BeamForCausalLM"]
    assert len(raw["layer_types"]) == 52
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert BeamConfig.from_hf(tmp_path) == BEAM
    assert BeamConfig.from_hf(raw) == BEAM


@pytest.mark.parametrize(
    "change, field",
    [
        ({"layer_types": [SLIDING] * 51}, "layer_types"),
        ({"layer_types": [SLIDING] * 51 + ["local"]}, "layer_types"),
        ({"num_attention_heads": 50}, "num_attention_heads"),
        ({"topk_group": 9}, "topk_group"),
        ({"n_routed_experts": 250}, "n_routed_experts"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
        ({"first_k_dense_replace": 60}, "first_k_dense_replace"),
    ],
)
def test_contradictory_configs_name_the_field(change, field):
    raw = {**BEAM.to_hf(), **change}
    with pytest.raises(ConfigError, match=field):
        BeamConfig.from_hf(raw)


def test_bad_config_file_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        BeamConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**BEAM.to_hf(), "model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type"):
        BeamConfig.from_hf(tmp_path)


def test_default_layer_rule_on_other_depths():
    cfg = BEAM.replace(num_hidden_layers=8, layer_types=())
    assert cfg.layer_types == (SLIDING,) * 5 + (FULL, SLIDING, FULL)


def test_info_cli_text_and_json():
    runner = CliRunner()
    text = runner.invoke(main, ["info", "--preset", "beam-1.0-501b"])
    assert text.exit_code == 0, text.output
    for needle in ["500.96B", "23.13B", "36.00 KiB BF16", "18.00 KiB FP8", "18.00 GiB",
                   "5, 11, 17, 23, 29, 35, 41, 47, 51"]:
        assert needle in text.output
    out = runner.invoke(main, ["info", "--preset", "beam-1.0-501b", "--json",
                               "--context", str(1 << 20), "--kv-dtype", "fp8"])
    r = json.loads(out.output)
    assert r["kv_bytes_full_layers"] == 18 << 30
    assert r["kv_bytes_per_token"] == {"bf16": 36864, "fp8": 18432}
    assert r["full_layers"] == [5, 11, 17, 23, 29, 35, 41, 47, 51]
    # BF16 weights: 2 bytes a parameter except the FP32 router (4 bytes).
    router = 49 * 256 * 5121
    assert r["weight_bytes"]["bf16"] == 2 * BEAM.total_params + 2 * router
    assert r["weight_bytes"]["bf16"] > r["weight_bytes"]["fp8"] > r["weight_bytes"]["nvfp4"]


def test_info_cli_refuses_bad_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BEAM.to_hf(), "topk_group": 10}))
    out = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert out.exit_code == 1
    assert "topk_group" in out.output and "Traceback" not in out.output
