"""The TensorRT-LLM adapter's pure parts (beam_trtllm/trtllm): weight mapping, the attention's
and the model's data flow against transformers' Beam, KV-head duplication, lazy imports (the
HF config and the engine args: test_trtllm_llm_args.py). TensorRT-LLM itself is not installed
here; where its kernels run, the tests put plain torch (or transformers' eager attention) and
say so."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from beam_trtllm.checkpoint import load_state_dict
from beam_trtllm.config import BeamConfig, preset
from beam_trtllm.hf_model import fuse_experts, model_from_state_dict
from beam_trtllm.quant_formats import (dequantize_fp8, dequantize_nvfp4, nvfp4_scale_2,
                                       quantize_fp8, quantize_nvfp4)
from beam_trtllm.trtllm import WeightMappingError
from beam_trtllm.trtllm.weight_mapper import (duplicate_kv_part, fuse_parts, gate_bias_shard,
                                              merge_gate_into_q, module_loads, plan_weights)
from conftest import tol
from trtllm_emulation import emulated_attention, emulated_logits, transformers_attention

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


@pytest.fixture(scope="module")
def hf_tiny(tiny):
    """transformers' BeamForCausalLM (eager, FP32) on the tiny checkpoint: the oracle."""
    return model_from_state_dict(*tiny, dtype=torch.float32)


def test_every_tiny_tensor_is_consumed_exactly_once(tiny):
    cfg, state = tiny
    plan = plan_weights(cfg, state)
    placed = [name for parts in plan.values() for keys in parts.values() for name in keys.values()]
    assert sorted(placed) == sorted(state) and len(placed) == len(set(placed))
    p = "model.layers.1."  # sparse in the tiny's D S S D S S pattern
    qkv = plan[p + "self_attn.qkv_proj"]
    assert qkv["gate_proj"] == {"weight": p + "self_attn.gate_proj.weight"}  # the output gate
    assert plan[p + "self_attn"][None] == {"gate_bias": p + "self_attn.gate_bias"}
    assert plan[p + "mlp.experts"][None]["15.up_proj.weight"] == p + "mlp.experts.15.up_proj.weight"
    assert set(plan[p + "mlp.gate"][None]) == {"weight", "e_score_correction_bias"}
    dense = plan["model.layers.3.mlp.gate_up_proj"]  # dense after sparse layers
    assert dense["gate_proj"] == {"weight": "model.layers.3.mlp.gate_proj.weight"}


def test_fused_modules_have_the_right_shapes_and_contents(tiny):
    cfg, state = tiny
    loads = module_loads(cfg, state)
    h, d, hq = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    q, kv = cfg.q_size, cfg.kv_size
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = fuse_parts(loads[p + "self_attn.qkv_proj"], p + "qkv_proj")["weight"]
        assert qkv.shape == (cfg.qkv_gate_size, h)
        for head in range(hq):  # [q_h; g_h] per head: TRT-LLM's attn_output_gate layout
            rows = slice(head * d, (head + 1) * d)
            assert torch.equal(qkv[2 * head * d:][:d], state[p + "self_attn.q_proj.weight"][rows])
            assert torch.equal(qkv[(2 * head + 1) * d:][:d],
                               state[p + "self_attn.gate_proj.weight"][rows])
        assert torch.equal(qkv[2 * q:2 * q + kv], state[p + "self_attn.k_proj.weight"])
        assert loads[p + "self_attn"] == [{"gate_bias": state[p + "self_attn.gate_bias"]}]
        if cfg.is_moe(i):
            experts = loads[p + "mlp.experts"][0]
            assert len(experts) == 3 * cfg.num_experts
            assert torch.equal(experts["7.w1.weight"], state[p + "mlp.experts.7.gate_proj.weight"])
            assert experts["7.w2.weight"].shape == (h, cfg.moe_intermediate_size)
            assert loads[p + "mlp.gate"][0]["weight"].dtype == torch.float32
        else:
            gate_up = fuse_parts(loads[p + "mlp.gate_up_proj"], p + "gate_up_proj")["weight"]
            assert gate_up.shape == (2 * cfg.intermediate_size, h)
            assert torch.equal(gate_up[cfg.intermediate_size:], state[p + "mlp.up_proj.weight"])


def test_fused_experts_map_like_per_expert_ones(tiny):
    cfg, state = tiny
    fused = fuse_experts(state, cfg)  # transformers' in-memory form, which vLLM also reads
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    per_expert, from_fused = module_loads(cfg, state), module_loads(cfg, fused)
    for i in cfg.moe_layers:
        name = f"model.layers.{i}.mlp.experts"
        a, b = per_expert[name][0], from_fused[name][0]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    both = {**fused, "model.layers.1.mlp.experts.3.up_proj.weight": torch.zeros(1)}
    with pytest.raises(WeightMappingError, match="both hold model.layers.1.mlp.experts.3.up_proj"):
        plan_weights(cfg, both)


@pytest.mark.parametrize("name, why", [
    ("model.layers.0.self_attn.q_proj.pre_quant_scale", "not a Beam tensor of layer 0"),
    ("model.layers.6.input_layernorm.weight", "the config has 6 layers"),
    ("model.layers.1.mlp.gate_proj.weight", "not a Beam tensor of layer 1 (MoE)"),
    ("model.layers.0.mlp.gate.weight", "not a Beam tensor of layer 0 (dense)"),
    ("model.layers.2.mlp.experts.16.up_proj.weight", "not a Beam tensor of layer 2"),
    ("model.layers.3.self_attn.q_proj.k_scale", "not a Beam tensor of layer 3"),
    ("model.layers.3.self_attn.gate_bias.weight", "not a Beam tensor of layer 3"),
    ("model.layers.0.self_attn.g_proj.weight", "is the per-head g_proj gate of .*v1"),
])
def test_unknown_and_v1_tensors_are_refused_by_name(tiny, name, why):
    cfg, state = tiny
    with pytest.raises(WeightMappingError, match=f"tensor {name}:? .*{why}".replace("(", r"\(")
                       .replace(")", r"\)")):
        plan_weights(cfg, [*state, name])


@pytest.mark.parametrize("dropped", ["model.layers.2.mlp.gate.e_score_correction_bias",
                                     "model.layers.4.self_attn.gate_bias",
                                     "model.layers.0.self_attn.gate_proj.weight"])
def test_missing_tensor_is_refused_unless_partial(tiny, dropped):
    cfg, state = tiny
    names = [n for n in state if n != dropped]
    with pytest.raises(WeightMappingError, match=f"lacks tensor {dropped}$"):
        plan_weights(cfg, names)
    plan_weights(cfg, names, complete=False)  # layer-wise partial loads: names only


# ------------------------------------------------------------- numerics against transformers
@pytest.mark.parametrize("tp", [1, 2, 4])  # tiny: 4 query / 2 KV heads; TP 4 replicates KV
@pytest.mark.parametrize("layer", [1, 2])  # tiny: layer 1 full (NoPE + SSMax), 2 sliding
def test_attention_per_rank_matches_transformers(tiny, hf_tiny, layer, tp):
    """Each TP rank's steps (its rows of the mapped qkv_proj, as TRT-LLM's loader splits them
    -> beam::qk_prep -> attention -> element-wise gate with the rank's gate_bias -> its o_proj
    columns), summed over ranks as the all-reduce does, give transformers' BeamAttention.
    Positions 2030..2058 cross SSMax's 2047 and put the window far from position 0."""
    cfg, state = tiny
    loads = module_loads(cfg, state, tp_size=tp)
    x = torch.randn(29, cfg.hidden_size, generator=torch.Generator().manual_seed(layer))
    positions = torch.arange(2030, 2059)
    ours, qkv = emulated_attention(cfg, loads, layer, x, positions, tp)
    expected, expected_qkv = transformers_attention(hf_tiny, layer, x, positions)
    torch.testing.assert_close(ours, expected, **tol("fp32-reorder", torch.float32))
    if tp == 1:  # q, k, v as transformers' attention function receives them, bit for bit
        for got, ref in zip(qkv, expected_qkv):
            assert torch.equal(got, ref)


def test_bf16_attention_rounds_where_transformers_rounds(tiny):
    """In BF16 (TP 1, the CPU's GEMMs): the packed projection, beam::qk_prep's norms, RoPE or
    SSMax and gate rnd(sigmoid(rnd(g + b))), and rnd(o * gate) give transformers' BF16
    BeamAttention output bit for bit."""
    cfg, state = tiny
    hf_bf16 = model_from_state_dict(cfg, state, dtype=torch.bfloat16)
    loads = module_loads(cfg, state)
    for layer in (1, 2):
        x = torch.randn(29, cfg.hidden_size, generator=torch.Generator().manual_seed(layer))
        positions = torch.arange(2030, 2059)
        ours, _ = emulated_attention(cfg, loads, layer, x.bfloat16(), positions, 1)
        expected, _ = transformers_attention(hf_bf16, layer, x.bfloat16(), positions)
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, expected)


def test_whole_model_data_flow_matches_transformers_logits(tiny, hf_tiny):
    """TRT-LLM's BeamForCausalLM data flow at TP 1 (the mapped weights; beam::rmsnorm, the
    attention of the test above, beam::add_rmsnorm with (a_k, b_k) at every boundary, the FP32
    SwiGLU, TRT-LLM's routed-scale placement, the FP32 softcap) gives transformers' logits,
    softcap included, over a prompt 5x the window, with the tiny's non-prefix dense layers."""
    cfg, state = tiny
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    loads = module_loads(cfg, state)
    ours = emulated_logits(cfg, loads, ids)
    with torch.inference_mode():
        expected = hf_tiny(input_ids=ids[None], use_cache=False).logits[0].float()
    assert cfg.final_logit_softcapping == 30.0 and expected.abs().max() < 30
    torch.testing.assert_close(ours, expected, **tol("fp32-reorder", torch.float32))
    uncapped = emulated_logits(cfg.replace(final_logit_softcapping=None), loads, ids)
    assert (uncapped - ours).abs().max() > 1e-2  # the softcap really acts at these logits


# -------------------------------------------------------------- the gate in the q part (quant)
def _q_and_gate(seed: int, heads: int = 4, d: int = 16, hidden: int = 64):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(heads * d, hidden, generator=gen) * s / hidden**0.5).bfloat16()
            for s in (1.0, 3.0)]


def test_nvfp4_gate_is_interleaved_with_its_block_scales():
    q, g = _q_and_gate(1)
    shared = torch.maximum(nvfp4_scale_2(q), nvfp4_scale_2(g))  # ModelOpt's fused-input rule
    keys = ("weight", "weight_scale", "weight_scale_2")
    parts = [dict(zip(keys, quantize_nvfp4(w.float(), shared)), input_scale=torch.tensor(0.01))
             for w in (q, g)]
    merged = merge_gate_into_q(parts[0], parts[1], 4, "qkv_proj")
    deq = dequantize_nvfp4(merged["weight"], merged["weight_scale"], merged["weight_scale_2"])
    rows = [dequantize_nvfp4(p["weight"], p["weight_scale"], p["weight_scale_2"]) for p in parts]
    for head in range(4):
        for j in range(2):  # q then gate rows of each head
            assert torch.equal(deq[(2 * head + j) * 16:][:16], rows[j][head * 16:][:16])
    assert merged["weight_scale_2"] is parts[0]["weight_scale_2"]
    parts[1]["weight_scale_2"] = shared * 2
    with pytest.raises(WeightMappingError, match="different weight_scale_2"):
        merge_gate_into_q(parts[0], parts[1], 4, "qkv_proj")


def test_fp8_gate_and_q_are_requantized_to_one_scale():
    q, g = _q_and_gate(2)
    parts = [dict(zip(("weight", "weight_scale"), quantize_fp8(w)), input_scale=torch.tensor(s))
             for w, s in ((q, 0.02), (g, 0.03))]
    top = torch.maximum(parts[0]["weight_scale"], parts[1]["weight_scale"])
    assert parts[1]["weight_scale"] == top  # the gate was made 3x larger
    merged = merge_gate_into_q(parts[0], parts[1], 4, "qkv_proj")
    assert merged["weight_scale"] == top and merged["input_scale"] == torch.tensor(0.03)
    deq = dequantize_fp8(merged["weight"], merged["weight_scale"]).view(4, 2, 16, -1)
    orig = [dequantize_fp8(p["weight"], p["weight_scale"]).view(4, 16, -1) for p in parts]
    assert torch.equal(deq[:, 1], orig[1])  # the part already at the larger scale: exact
    err = (deq[:, 0] - orig[0]).abs()  # the other: re-rounded once, half an E4M3 step at most
    assert (err <= orig[0].abs() * 2**-4 + top * 2**-10).all() and err.max() > 0
    del parts[1]["input_scale"]
    with pytest.raises(WeightMappingError, match="differ in tensor input_scale"):
        merge_gate_into_q(parts[0], parts[1], 4, "qkv_proj")


def test_gate_bias_is_split_by_heads():
    bias = torch.arange(48.0)
    assert torch.equal(gate_bias_shard(bias, 48, 8, 3), bias[18:24])
    with pytest.raises(WeightMappingError, match="self_attn.gate_bias of shape \\[48\\]"):
        gate_bias_shard(bias, 48, 5, 0)


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
