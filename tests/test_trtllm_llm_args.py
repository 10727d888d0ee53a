"""The TensorRT-LLM adapter's configuration side (beam_trtllm/trtllm): the HF config it hands
TensorRT-LLM (transformers' own `beam` config, never replaced) and the engine-args generator
with its validation and CLI. TensorRT-LLM itself is not installed here."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from beam_trtllm.config import BeamConfig, ConfigError, preset
from beam_trtllm.trtllm import LlmArgsError
from beam_trtllm.trtllm.__main__ import main as trtllm_cli
from beam_trtllm.trtllm.llm_args import (ServingOptions, check_disagg_pair, engine_args,
                                         engine_args_yaml, max_attention_window,
                                         validate_engine_args)


# ------------------------------------------------------------------------------- HF config
def test_transformers_beam_config_is_used_and_never_replaced(tiny_dir):
    from transformers import AutoConfig
    from transformers import BeamConfig as TransformersBeamConfig

    from beam_trtllm.trtllm.configuration_beam import (beam_config, installed_beam_config_class,
                                                       register_hf_config)

    assert register_hf_config() is TransformersBeamConfig
    assert installed_beam_config_class() is TransformersBeamConfig
    hf = AutoConfig.from_pretrained(tiny_dir)
    assert type(hf) is TransformersBeamConfig
    assert beam_config(hf) == BeamConfig.from_hf(tiny_dir)
    raw = json.loads((tiny_dir / "config.json").read_text())
    v1 = TransformersBeamConfig.from_dict({**raw, "n_routed_experts": 16})  # kept as an attribute
    with pytest.raises(ConfigError, match="v1 field 'n_routed_experts'"):
        beam_config(v1)


def test_fallback_hf_config_reads_the_canonical_fields_and_refuses_bad_ones(tiny_dir):
    from beam_trtllm.trtllm.configuration_beam import BeamHfConfig, beam_config

    raw = json.loads((tiny_dir / "config.json").read_text())
    hf = BeamHfConfig(**raw)
    assert beam_config(hf) == BeamConfig.from_hf(tiny_dir)
    assert hf.num_experts == 16 and hf.mlp_layer_types == raw["mlp_layer_types"]
    assert hf.final_logit_softcapping == 30.0 and hf.dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="mlp_layer_types has 5 entries but num_hidden_layers"):
        BeamHfConfig(**{**raw, "mlp_layer_types": raw["mlp_layer_types"][:5]})
    with pytest.raises(ConfigError, match="v1 field 'first_k_dense_replace'"):
        BeamHfConfig(**{**raw, "first_k_dense_replace": 1})


# ------------------------------------------------------------------------------ engine args
OPTS_501B = ServingOptions(tensor_parallel_size=8, max_seq_len=131072, max_isl=32768)


def test_501b_engine_args_per_role():
    cfg = preset("beam-1.0-501b")
    args = {role: engine_args(cfg, role, OPTS_501B) for role in ("agg", "prefill", "decode")}
    for role, a in args.items():
        window = a["kv_cache_config"]["max_attention_window"]
        assert len(window) == 52
        assert [i for i, w in enumerate(window) if w == 131072] == [5, 11, 17, 23, 29, 35, 41, 47, 51]
        assert set(window[i] for i in cfg.sliding_layers) == {512}
        assert a["kv_cache_config"]["dtype"] == "fp8" and a["moe_config"] == {"backend": "CUTLASS"}
        assert a["trust_remote_code"] is False  # transformers' own beam config: no remote code
        validate_engine_args(cfg, role, a)
    pre, dec = args["prefill"], args["decode"]
    assert (pre["disable_overlap_scheduler"], dec["disable_overlap_scheduler"]) == (True, False)
    assert (pre["enable_chunked_prefill"], dec["enable_chunked_prefill"]) == (True, False)
    assert (pre["max_num_tokens"], dec["max_num_tokens"]) == (32768, 256)
    assert "cuda_graph_config" not in pre
    assert dec["cuda_graph_config"]["batch_sizes"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert (pre["kv_cache_config"]["enable_block_reuse"], dec["kv_cache_config"]["enable_block_reuse"]) \
        == (True, False)
    assert "cache_transceiver_config" not in args["agg"]
    # KV of the longest prompt: 9 full layers x 8 KV heads x 128 x 2 (K, V) x 1 B (FP8) per
    # token (18 KiB) plus 43 windows of 512; base 5 s + that at 50 MiB/s.
    kv = 32768 * 9 * 8 * 128 * 2 + 43 * 512 * 8 * 128 * 2
    assert cfg.kv_bytes(32768, "fp8") == kv
    expected_ms = int((5.0 + kv / (50.0 * 2**20)) * 1000)
    for a in (pre, dec):
        assert a["cache_transceiver_config"] == {"backend": "NIXL", "max_tokens_in_buffer": 32768,
                                                 "kv_transfer_timeout_ms": expected_ms}
    check_disagg_pair(pre, dec)
    assert yaml.safe_load(engine_args_yaml(cfg, "decode", OPTS_501B)) == dec


def test_tiny_window_list_follows_layer_types():
    assert max_attention_window(preset("tiny"), 4096) == [8, 4096, 8, 8, 4096, 4096]


@pytest.mark.parametrize("opts, field", [
    (ServingOptions(tensor_parallel_size=5), "tensor_parallel_size: 5 does not divide"),
    (ServingOptions(tensor_parallel_size=12), "tensor_parallel_size: 12: the 8 KV heads"),
    (ServingOptions(tensor_parallel_size=8, moe_expert_parallel_size=3), "moe_expert_parallel_size"),
    (ServingOptions(max_isl=32768, max_tokens_in_buffer=16384), "max_tokens_in_buffer: 16384 is smaller"),
    (ServingOptions(moe_backend="TRTLLM"), "moe_backend: TRTLLM keeps .* BF16"),
    (ServingOptions(kv_cache_dtype="nvfp4"), "kv_cache_dtype: 'nvfp4'"),
    (ServingOptions(max_seq_len=2 << 20), "max_seq_len: 2097152 exceeds"),
    (ServingOptions(kv_transfer_timeout_ms=0), "kv_transfer_timeout_ms: must be a positive"),
    (ServingOptions(cuda_graph_batch_sizes=(4, 2)), "cuda_graph_batch_sizes"),
])
def test_bad_serving_options_are_refused_by_field(opts, field):
    with pytest.raises(LlmArgsError, match=field):
        engine_args(preset("beam-1.0-501b"), "prefill", opts)


def test_bad_engine_args_are_refused_by_field():
    cfg = preset("beam-1.0-501b")
    good = engine_args(cfg, "prefill", OPTS_501B)
    kv = good["kv_cache_config"]
    cases = [
        ({**good, "kv_cache_config": {**kv, "max_attention_window": kv["max_attention_window"][:51]}},
         r"max_attention_window: has 51 entries but the model has 52 layers"),
        ({**good, "kv_cache_config": {**kv, "max_attention_window": [512] * 52}},
         r"max_attention_window\[5\]: 512, but layer 5 is full_attention and needs 131072"),
        ({**good, "disable_overlap_scheduler": False}, "disable_overlap_scheduler: must be true"),
        ({**good, "cache_transceiver_config": {"backend": "NIXL", "max_tokens_in_buffer": 8}},
         "kv_transfer_timeout_ms: missing"),
        ({**good, "moe_config": {"backend": "TRTLLM"}}, "moe_backend: TRTLLM"),
    ]
    for args, message in cases:
        with pytest.raises(LlmArgsError, match=message):
            validate_engine_args(cfg, "prefill", args)
    decode = engine_args(cfg, "decode", ServingOptions(tensor_parallel_size=8, max_seq_len=131072,
                                                       max_isl=32768, tokens_per_block=64))
    with pytest.raises(LlmArgsError, match="tokens_per_block: prefill has 32, decode 64"):
        check_disagg_pair(good, decode)


def test_cli_writes_yaml_and_reports_bad_input_without_traceback(tmp_path):
    out = tmp_path / "decode.yaml"
    res = CliRunner().invoke(trtllm_cli, ["engine-args", "--preset", "tiny", "--role", "decode",
                                          "--tp", "2", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert yaml.safe_load(out.read_text())["kv_cache_config"]["max_attention_window"] == \
        max_attention_window(preset("tiny"), 4096)
    res = CliRunner().invoke(trtllm_cli, ["engine-args", "--preset", "tiny", "--role", "prefill",
                                          "--tp", "3"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "Error: tensor_parallel_size: 3 does not divide num_attention_heads (4)" in res.output
