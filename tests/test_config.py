"""BeamConfig: spec facts checked against hand-written values and against transformers'
BeamConfig, configs written by transformers read exactly, and bad configs refused."""

import json

import pytest
from click.testing import CliRunner

from beam_trtllm.cli import main
from beam_trtllm.config import DENSE, FULL, PRESETS, SLIDING, SPARSE, BeamConfig, ConfigError, preset

BEAM = PRESETS["beam-1.0-501b"]


def test_501b_full_layers_are_the_published_ones():
    assert BEAM.full_layers == (5, 11, 17, 23, 29, 35, 41, 47, 51)
    assert len(BEAM.sliding_layers) == 43
    assert BEAM.dense_layers == (0, 1, 2)
    assert BEAM.moe_layers == tuple(range(3, 52))


def test_501b_parameter_counts():
    assert round(BEAM.total_params / 1e9, 2) == 501.27
    assert round(BEAM.active_params / 1e9, 2) == 23.43
    assert (BEAM.vocab_size, BEAM.intermediate_size) == (151936, 20480)


def test_parameter_counts_equal_transformers_model():
    """Every parameter and buffer of transformers' BeamForCausalLM (meta device), counted."""
    import torch
    from transformers import BeamForCausalLM

    from beam_trtllm.hf_model import hf_config

    for cfg in (BEAM, PRESETS["tiny"]):
        with torch.device("meta"):
            model = BeamForCausalLM(hf_config(cfg))
        tensors = [t for n, t in [*model.named_parameters(), *model.named_buffers()]
                   if "rotary_emb" not in n]
        assert sum(t.numel() for t in tensors) == cfg.total_params


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
    assert tiny.dense_layers == (0, 3)  # dense and sparse in a non-prefix pattern
    assert tiny.final_logit_softcapping == 30.0


def test_hf_round_trip(tmp_path):
    raw = BEAM.to_hf()
    assert raw["model_type"] == "beam" and raw["architectures"] == ["BeamForCausalLM"]
    assert len(raw["layer_types"]) == 52 and len(raw["mlp_layer_types"]) == 52
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert BeamConfig.from_hf(tmp_path) == BEAM
    assert BeamConfig.from_hf(raw) == BEAM


def test_reads_what_transformers_writes(tmp_path):
    """transformers' own BeamConfig(), saved: the published model's facts, no unknown field;
    its defaults are the canonical ones (max_position_embeddings 8192 there, pinned 1M in our
    preset)."""
    from transformers import BeamConfig as HFBeamConfig

    HFBeamConfig(mlp_layer_types=[SPARSE, DENSE] * 26).save_pretrained(tmp_path)
    cfg = BeamConfig.from_hf(tmp_path)
    assert not cfg.unknown_fields and cfg.report_unknown() is None
    assert cfg == BEAM.replace(max_position_embeddings=8192,
                               mlp_layer_types=(SPARSE, DENSE) * 26)
    assert cfg.moe_layers == tuple(range(0, 52, 2)) and cfg.rope_theta == 10000.0
    assert BeamConfig.from_hf(tmp_path / "config.json").to_hf()["rope_parameters"] == {
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0}, FULL: None}


def test_unknown_fields_are_kept_written_back_and_reported(tmp_path):
    raw = {**BEAM.to_hf(), "my_extension": [1, 2], "rope_scaling_note": "x"}
    cfg = BeamConfig.from_hf(raw)
    assert cfg.unknown_fields == {"my_extension": [1, 2], "rope_scaling_note": "x"}
    assert cfg.to_hf()["my_extension"] == [1, 2]
    assert "my_extension, rope_scaling_note" in cfg.report_unknown()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    out = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert out.exit_code == 0 and "my_extension" in out.output


def test_v1_config_is_refused_saying_what_it_is():
    raw = {k: v for k, v in BEAM.to_hf().items() if k != "mlp_layer_types"}
    raw.update(n_routed_experts=256, first_k_dense_replace=3, ssmax_base=2048.0)
    with pytest.raises(ConfigError, match="pre-canonical Beam.*first_k_dense_replace"):
        BeamConfig.from_hf(raw)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"layer_types": [SLIDING] * 51}, "layer_types"),
        ({"layer_types": [SLIDING] * 51 + ["local"]}, "layer_types"),
        ({"num_attention_heads": 50}, "num_attention_heads"),
        ({"topk_group": 9}, "topk_group"),
        ({"num_experts": 250}, "num_experts"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
        ({"mlp_layer_types": [DENSE] * 50}, "mlp_layer_types"),
        ({"mlp_layer_types": [DENSE] * 51 + ["moe"]}, "mlp_layer_types"),
        ({"rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 1e4}}},
         "rope_parameters"),
        ({"rope_parameters": {SLIDING: {"rope_type": "yarn", "rope_theta": 1e4}, FULL: None}},
         "rope_parameters"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"attention_bias": True}, "attention_bias"),
        ({"sliding_window": None}, "sliding_window"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
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
    cfg = BEAM.replace(num_hidden_layers=8, layer_types=(), mlp_layer_types=())
    assert cfg.layer_types == (SLIDING,) * 5 + (FULL, SLIDING, FULL)
    assert cfg.mlp_layer_types == (DENSE,) * 3 + (SPARSE,) * 5
    assert BEAM.replace(num_hidden_layers=2, layer_types=(), mlp_layer_types=()).moe_layers == ()


def test_info_cli_text_and_json():
    runner = CliRunner()
    text = runner.invoke(main, ["info", "--preset", "beam-1.0-501b"])
    assert text.exit_code == 0, text.output
    for needle in ["501.27B", "23.43B", "36.00 KiB BF16", "18.00 KiB FP8", "18.00 GiB",
                   "5, 11, 17, 23, 29, 35, 41, 47, 51", "dense 0-2; moe 3-51"]:
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


def test_info_activations_follow_the_chunk_and_the_dense_mlp():
    """The activation term: linear in the chunk, the dense MLP's [T, 3I] BF16 tensors plus
    the larger of one SWIGLU_ROWS FP32 temporary and down_proj's input codes, and an engine dir's plan adds it."""
    from beam_trtllm.engine.model import SWIGLU_ROWS
    from beam_trtllm.info import activation_bytes, report

    a8, a16 = (activation_bytes(BEAM, t, "fp8") for t in (8192, 16384))
    assert a16["stream"] == 2 * a8["stream"] and a16["moe"] < 2 * a8["moe"] + 1
    t, i = 16384, BEAM.intermediate_size
    # gate/up + h in BF16, then the larger of the FP32 temporary and down_proj's FP8 input
    # with its output
    assert a16["dense_mlp"] == t * 3 * i * 2 + max(SWIGLU_ROWS * i * 4,
                                                   t * i + t * BEAM.hidden_size * 2)
    assert a16["peak"] == a16["stream"] + max(a16["attention"], a16["dense_mlp"], a16["moe"])
    r = report(BEAM, 1 << 20, "fp8", 16384, "fp8")
    assert r["plan"]["total"] == (r["weight_bytes"]["fp8"] + r["kv_bytes_sequence"]
                                  + a16["peak"])
    text = CliRunner().invoke(main, ["info", "--preset", "beam-1.0-501b",
                                     "--max-num-tokens", "16384"])
    assert "a 16,384-token chunk: BF16" in text.output
