"""The TensorRT-LLM adapter's pure parts (beam_trtllm/trtllm): weight mapping, residual folding,
KV-head duplication, engine-args generation and validation, lazy imports. TensorRT-LLM itself is
not installed here; nothing below imports or imitates it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
import yaml
from click.testing import CliRunner

import plugins  # noqa: F401  (torch.ops.beam.*: the reference implementations on CPU)
from beam_trtllm.checkpoint import load_state_dict
from beam_trtllm.config import BeamConfig, preset
from beam_trtllm.quant_formats import quantize_nvfp4
from beam_trtllm.reference import residual_add, rms_norm
from beam_trtllm.trtllm import LlmArgsError, WeightMappingError
from beam_trtllm.trtllm.__main__ import main as trtllm_cli
from beam_trtllm.trtllm.ops import apply_head_gate, prep_qkv
from beam_trtllm.trtllm.llm_args import (ServingOptions, check_disagg_pair, engine_args,
                                         engine_args_yaml, max_attention_window,
                                         validate_engine_args)
from beam_trtllm.trtllm.weight_mapper import (duplicate_kv_part, fold_residual_scale, fuse_parts,
                                              module_loads, plan_weights)
from conftest import tol

HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------ lazy imports
def test_package_import_pulls_in_no_tensorrt_llm():
    res = _run("import sys, beam_trtllm.trtllm, beam_trtllm.trtllm.weight_mapper, "
               "beam_trtllm.trtllm.llm_args, beam_trtllm.trtllm.dynamo_worker\n"
               "print(sorted(m for m in sys.modules if m.split('.')[0] in "
               "('tensorrt_llm', 'transformers', 'dynamo')))")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


@pytest.mark.skipif(HAS_TRTLLM, reason="TensorRT-LLM is installed")
@pytest.mark.parametrize("module", ["modeling_beam", "hf_weight_mapper", "beam_model"])
def test_model_import_without_tensorrt_llm_is_one_clear_error(module):
    res = _run(f"import beam_trtllm.trtllm.{module}")
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("beam_trtllm.trtllm.errors.MissingPackageError: ")
    assert "'tensorrt_llm', which is not installed" in last
    assert res.stderr.count("Error:") == 1  # one error, not a chain of import failures


@pytest.mark.skipif(HAS_TRTLLM, reason="TensorRT-LLM is installed")
def test_dynamo_worker_without_tensorrt_llm_exits_with_the_package_named():
    res = subprocess.run([sys.executable, "-m", "beam_trtllm.trtllm.dynamo_worker",
                          "--model-path", "/nowhere"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith("Error: python -m beam_trtllm.trtllm.dynamo_worker needs the "
                                 "Python package 'tensorrt_llm'")


# ---------------------------------------------------------------------------- weight mapping
@pytest.fixture(scope="module")
def tiny(tiny_dir):
    cfg = BeamConfig.from_hf(tiny_dir)
    return cfg, load_state_dict(tiny_dir, cfg)


def test_every_tiny_tensor_is_consumed_exactly_once(tiny):
    cfg, state = tiny
    plan = plan_weights(cfg, state)
    placed = [name for parts in plan.values() for keys in parts.values() for name in keys.values()]
    assert sorted(placed) == sorted(state) and len(placed) == len(set(placed))
    layer1 = "model.layers.1."  # a MoE layer of the tiny (first_k_dense_replace = 1)
    assert plan[layer1 + "self_attn.qkv_proj"]["k_proj"] == {"weight": layer1 + "self_attn.k_proj.weight"}
    assert plan[layer1 + "mlp.experts"][None]["15.w3.weight"] == layer1 + "mlp.experts.15.up_proj.weight"
    assert set(plan[layer1 + "mlp.gate"][None]) == {"weight", "e_score_correction_bias"}


def test_fused_modules_have_the_right_shapes_and_contents(tiny):
    cfg, state = tiny
    loads = module_loads(cfg, state)
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = fuse_parts(loads[p + "self_attn.qkv_proj"], p + "qkv_proj")["weight"]
        assert qkv.shape == (q + 2 * kv, h)
        assert torch.equal(qkv[q:q + kv], state[p + "self_attn.k_proj.weight"])
        assert loads[p + "self_attn.g_proj"][0]["weight"].shape == (cfg.num_attention_heads, h)
        if cfg.is_moe(i):
            experts = loads[p + "mlp.experts"][0]
            assert len(experts) == 3 * cfg.n_routed_experts
            assert experts["7.w1.weight"].shape == (cfg.moe_intermediate_size, h)
            assert experts["7.w2.weight"].shape == (h, cfg.moe_intermediate_size)
            assert loads[p + "mlp.gate"][0]["weight"].dtype == torch.float32
        else:
            gate_up = fuse_parts(loads[p + "mlp.gate_up_proj"], p + "gate_up_proj")["weight"]
            assert gate_up.shape == (2 * cfg.intermediate_size, h)
            assert torch.equal(gate_up[cfg.intermediate_size:], state[p + "mlp.up_proj.weight"])


@pytest.mark.parametrize("name, why", [
    ("model.layers.0.self_attn.q_proj.pre_quant_scale", "not a Beam tensor of layer 0"),
    ("model.layers.6.input_layernorm.weight", "the config has 6 layers"),
    ("model.layers.1.mlp.gate_proj.weight", "not a Beam tensor of layer 1 (MoE)"),
    ("model.layers.0.mlp.gate.weight", "not a Beam tensor of layer 0 (dense)"),
    ("model.layers.2.mlp.experts.16.up_proj.weight", "not a Beam tensor of layer 2"),
    ("model.layers.3.self_attn.q_proj.k_scale", "not a Beam tensor of layer 3"),
])
def test_unknown_tensors_are_refused_by_name(tiny, name, why):
    cfg, state = tiny
    with pytest.raises(WeightMappingError, match=f"tensor {name}: .*{why}".replace("(", r"\(")
                       .replace(")", r"\)")):
        plan_weights(cfg, [*state, name])


def test_missing_tensor_is_refused_unless_partial(tiny):
    cfg, state = tiny
    names = [n for n in state if n != "model.layers.2.mlp.gate.e_score_correction_bias"]
    with pytest.raises(WeightMappingError,
                       match="lacks tensor model.layers.2.mlp.gate.e_score_correction_bias$"):
        plan_weights(cfg, names)
    plan_weights(cfg, names, complete=False)  # layer-wise partial loads: names only


def test_folding_b_into_the_post_norms_gives_the_reference_model(tiny, tiny_model):
    """The TRT-LLM model's data flow (beam::rmsnorm, then per sublayer beam::add_rmsnorm with the
    mapper's folded post-norm weight, a_k and b = 1), with the reference's sublayers, reproduces
    the reference logits (which apply a_k and b_k unfolded)."""
    cfg, state = tiny
    loads = module_loads(cfg, state)
    ids = torch.randint(0, cfg.vocab_size, (1, 23), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(23)[None]
    m, eps = tiny_model.model, cfg.rms_norm_eps
    h = m.embed_tokens(ids)[0]
    x = torch.ops.beam.rmsnorm(h, m.layers[0].input_layernorm.weight, eps)
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        nxt = m.norm.weight if i == cfg.num_hidden_layers - 1 else m.layers[i + 1].input_layernorm.weight
        y = layer.self_attn(x[None], positions)[0]
        h, x = torch.ops.beam.add_rmsnorm(h, y, loads[p + "post_attention_layernorm"][0]["weight"],
                                          layer.pre_feedforward_layernorm.weight,
                                          cfg.residual_coeffs(2 * i)[0], 1.0, eps)
        y = layer.mlp(x[None])[0]
        h, x = torch.ops.beam.add_rmsnorm(h, y, loads[p + "post_feedforward_layernorm"][0]["weight"],
                                          nxt, cfg.residual_coeffs(2 * i + 1)[0], 1.0, eps)
    logits = tiny_model.lm_head(x).float()
    torch.testing.assert_close(logits, tiny_model(ids)[0], **tol("fp32-reorder", torch.float32))


def test_one_folded_boundary_matches_the_unfolded_formula():
    """At realistic magnitudes (stream of unit variance, sublayer output up to ~4), deep in the
    stack (k = 99: a = 0.995, b = 0.0995), in plain torch FP32."""
    gen = torch.Generator().manual_seed(5)
    h, y = torch.randn(19, 320, generator=gen), 4 * torch.randn(19, 320, generator=gen)
    w_post = 1 + 0.1 * torch.randn(320, generator=gen)
    a, b = BeamConfig().residual_coeffs(99)
    unfolded = residual_add(h, rms_norm(y, w_post, 1e-6), a, b)
    folded = a * h + rms_norm(y, fold_residual_scale(w_post.bfloat16(), b), 1e-6)
    folded_w = fold_residual_scale(w_post.bfloat16(), b)
    assert folded_w.dtype == torch.float32  # b * w is not re-rounded to BF16
    unfolded_bf16w = residual_add(h, rms_norm(y, w_post.bfloat16(), 1e-6), a, b)
    torch.testing.assert_close(folded, unfolded_bf16w, **tol("fp32-reorder", torch.float32))
    assert not torch.equal(unfolded, unfolded_bf16w)  # the test data really is not BF16-exact


def _attend(q, k, v, positions, cfg, window):
    """Softmax attention in plain FP32 torch, standing where TRT-LLM's paged kernel runs."""
    t, hq, d = q.shape[0], cfg.num_attention_heads, cfg.head_dim
    q, k, v = q.view(t, hq, d), k.view(t, -1, d), v.view(t, -1, d)
    k, v = (x.repeat_interleave(cfg.num_queries_per_kv, dim=1) for x in (k, v))
    diff = positions[:, None] - positions[None, :]
    visible = (diff >= 0) & ((diff < window) if window else True)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(t, hq * d)


@pytest.mark.parametrize("layer", [1, 2])  # tiny: layer 1 is full (NoPE + SSMax), 2 sliding
def test_attention_data_flow_matches_the_reference(tiny_model, layer):
    """The TRT-LLM attention's own steps (packed [q k v g] -> beam::qk_prep with no cache ->
    attention -> per-head sigmoid gate -> o_proj) reproduce the reference attention layer."""
    cfg, attn = tiny_model.config, tiny_model.model.layers[layer].self_attn
    x = torch.randn(29, cfg.hidden_size, generator=torch.Generator().manual_seed(layer))
    positions = torch.arange(100, 129)  # SSMax scale ~5.5 (base 4); RoPE angles well mixed
    g = attn.g_proj(x)
    qkvg = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), g], dim=-1)
    q, k, v = prep_qkv(qkvg, positions[None], attn.q_norm.weight, attn.k_norm.weight,
                       cfg.num_key_value_heads, cfg, attn.is_full)
    rq, rk, rv, _ = attn.project(x[None], positions[None])
    for ours, ref in ((q, rq), (k, rk), (v, rv)):
        assert torch.equal(ours, ref[0].reshape(29, -1))
    window = None if attn.is_full else cfg.sliding_window
    out = attn.o_proj(apply_head_gate(_attend(q, k, v, positions, cfg, window), g,
                                      cfg.num_attention_heads))
    torch.testing.assert_close(out, attn(x[None], positions[None])[0],
                               **tol("fp32-reorder", torch.float32))


# ------------------------------------------------------------------------- KV-head duplication
def _kv_part(gen, rows, hidden):
    w = (torch.randn(rows, hidden, generator=gen) / hidden**0.5).bfloat16()
    packed, block, scale_2 = quantize_nvfp4(w.float())  # FP32: the torch path, no JIT warm-up
    return w, {"weight": packed, "weight_scale": block, "weight_scale_2": scale_2,
               "input_scale": torch.tensor(0.02), "k_scale": torch.tensor(0.07)}


def test_kv_duplication_for_tp16_gives_each_rank_its_query_heads_kv_head():
    cfg = preset("beam-1.0-501b")
    tp, d, hidden = 16, cfg.head_dim, 96
    hkv, q_per_rank = cfg.num_key_value_heads, cfg.num_attention_heads // tp
    gen = torch.Generator().manual_seed(7)
    w, nvfp4 = _kv_part(gen, hkv * d, hidden)
    bf16 = duplicate_kv_part("k_proj", {"weight": w}, hkv, tp)["weight"]
    fp4 = duplicate_kv_part("k_proj", nvfp4, hkv, tp)
    assert bf16.shape == (tp * d, hidden) and fp4["weight"].shape == (tp * d, hidden // 2)
    assert fp4["weight_scale"].shape == (tp * d, hidden // 16)
    assert fp4["weight_scale"].dtype == torch.float8_e4m3fn
    for r in range(tp):
        kv_head = {(r * q_per_rank + j) // cfg.num_queries_per_kv for j in range(q_per_rank)}
        assert len(kv_head) == 1  # a rank's query heads all read one KV head
        src, dst = slice(kv_head.pop() * d, None), slice(r * d, (r + 1) * d)
        assert torch.equal(bf16[dst], w[src][:d])
        assert torch.equal(fp4["weight"][dst], nvfp4["weight"][src][:d])
        assert torch.equal(fp4["weight_scale"][dst].view(torch.uint8),
                           nvfp4["weight_scale"][src][:d].view(torch.uint8))
    for key in ("weight_scale_2", "input_scale", "k_scale"):  # per-tensor: shared, untouched
        assert fp4[key] is nvfp4[key]
    assert duplicate_kv_part("q_proj", nvfp4, hkv, tp)["weight"] is nvfp4["weight"]


def test_kv_duplication_through_the_mapping_for_tiny_tp4(tiny):
    cfg, state = tiny  # 2 KV heads, 4 query heads: TP 4 replicates each KV head twice
    parts = module_loads(cfg, state, tp_size=4)["model.layers.4.self_attn.qkv_proj"]
    k = state["model.layers.4.self_attn.k_proj.weight"]
    d = cfg.head_dim
    assert parts[1]["weight"].shape == (4 * d, cfg.hidden_size)
    assert torch.equal(parts[1]["weight"], torch.cat([k[:d], k[:d], k[d:], k[d:]]))
    assert parts[0]["weight"] is state["model.layers.4.self_attn.q_proj.weight"]


@pytest.mark.parametrize("tp, message", [(3, "does not divide the 8 KV heads"),
                                         (12, "not a multiple of the 8 KV heads")])
def test_kv_duplication_refuses_uneven_tp(tp, message):
    with pytest.raises(WeightMappingError, match=message):
        duplicate_kv_part("v_proj", {"weight": torch.zeros(8 * 128, 16)}, 8, tp)


def test_fused_nvfp4_parts_must_share_weight_scale_2():
    gen = torch.Generator().manual_seed(11)
    parts = [_kv_part(gen, 32, 64)[1] for _ in range(2)]
    shared = fuse_parts([dict(parts[0]), {**parts[1], "weight_scale_2": parts[0]["weight_scale_2"]}],
                        "qkv_proj")
    assert shared["weight"].shape == (64, 32) and shared["weight_scale_2"].ndim == 0
    with pytest.raises(WeightMappingError, match="qkv_proj: parts have different weight_scale_2"):
        fuse_parts(parts, "qkv_proj")


# ------------------------------------------------------------------------------- HF config
def test_hf_config_reads_the_checkpoint_and_refuses_a_bad_field(tiny_dir):
    import json

    from transformers import AutoConfig

    from beam_trtllm.config import ConfigError
    from beam_trtllm.trtllm.configuration_beam import BeamHfConfig, beam_config, register_hf_config

    register_hf_config()
    hf = AutoConfig.from_pretrained(tiny_dir)
    assert isinstance(hf, BeamHfConfig) and beam_config(hf) == BeamConfig.from_hf(tiny_dir)
    assert hf.num_experts == 16 and hf.architectures == ["BeamForCausalLM"]
    assert hf.dtype == torch.bfloat16
    raw = json.loads((tiny_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="layer_types has 5 entries but num_hidden_layers is 6"):
        BeamHfConfig(**{**raw, "layer_types": raw["layer_types"][:5]})


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
    # The same numbers as dynamo_graphs/k8s.py computed (base 5 s + KV of the longest prompt at
    # 50 MiB/s), so k8s.py can import this implementation instead of its copy.
    expected_ms = int((5.0 + cfg.kv_bytes(32768, "fp8") / (50.0 * 2**20)) * 1000)
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
