"""`beam-trt convert` against ModelOpt 0.47's own flow (mtq.quantize with max calibration on the
same tokens + export_hf_checkpoint) on transformers' BeamForCausalLM of the tiny checkpoint: the
same files: hf_quant_config.json as text, config.json as the same JSON (ModelOpt's is
transformers' save_pretrained output, which adds `transformers_version`), every tensor's name,
dtype, shape and bytes, so weights, weight scales, input_scale (our layer-streamed calibration
vs ModelOpt's whole-model max calibration) and k/v scales are all identical."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from convert.calib_data import load_calib_tokens
from convert.pipeline import ConvertOptions, convert
from modelopt_reference import modelopt_export

SAMPLES, SEQ = 2, 32  # the calibration batch both sides see: [2, 32] tokens of the shipped text

CASES = [  # recipe, FP8 KV, calibrated
    ("nvfp4", True, True),  # MIXED_PRECISION: FP8 attention + NVFP4 MLPs, input/k/v scales
    ("nvfp4-all", False, True),  # one format: exclude_modules summary, q/k/v/gate fused scales
    ("fp8", True, True),  # per-tensor FP8: an expert's gate/up share one weight_scale
    ("fp8-block", True, True),  # fp8_pb_wo: 0-d / 4-D block scales, one-block fusion rule
    ("nvfp4", True, False),  # no calibration data: W4A16_NVFP4 + FP8 weight-only, no k/v scales
]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _tensors(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _assert_same_as_modelopt(ckpt, tmp_path, recipe, kv, calibrated):
    tokens = load_calib_tokens(ckpt, None, SAMPLES, SEQ)
    batches = [tokens.ids] if calibrated else None
    ref = modelopt_export(ckpt, tmp_path / "modelopt", recipe, kv, batches)
    opts = ConvertOptions(recipe, "fp8" if kv else "none", calib_seq_len=SEQ, workers=2,
                          calib_samples=SAMPLES if calibrated else 0)
    ours = convert(ckpt, tmp_path / "ours", opts)
    assert (ours / "hf_quant_config.json").read_text() == (ref / "hf_quant_config.json").read_text()
    ref_config = json.loads((ref / "config.json").read_text())
    ref_config.pop("transformers_version")
    ours_config = json.loads((ours / "config.json").read_text())
    ours_config.pop("transformers_version", None)
    assert ours_config == ref_config
    a, b = _tensors(ref / "model.safetensors"), _tensors(ours / "model.safetensors")
    assert sorted(a) == sorted(b)
    for name in a:
        assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), name
        assert torch.equal(_bytes(a[name]), _bytes(b[name])), name
    return b


@pytest.mark.parametrize("recipe,kv,calibrated", CASES,
                         ids=[f"{r}-kv{k}-calib{c}" for r, k, c in CASES])
def test_same_files_as_modelopt_export(modelopt, tiny_dir, tmp_path, recipe, kv, calibrated):
    b = _assert_same_as_modelopt(tiny_dir, tmp_path, recipe, kv, calibrated)
    has_input_scale = any(n.endswith("input_scale") for n in b)
    assert has_input_scale == (calibrated and recipe != "fp8-block")
    assert any(n.endswith("k_scale") for n in b) == (kv and calibrated)


def test_same_files_as_modelopt_on_a_transformers_fp32_checkpoint(modelopt, hf_checkpoints,
                                                                  tmp_path):
    """A checkpoint saved by transformers in FP32 (sharded, its own config.json): ModelOpt
    quantizes it loaded in BF16, we cast it to BF16 at read: the same files."""
    _assert_same_as_modelopt(hf_checkpoints["fp32"], tmp_path, "nvfp4", True, True)


def test_layer_module_order_is_transformers_order():
    """hf_quant_config lists modules in transformers' order, written out in hfconfig."""
    from beam_trtllm.config import preset
    from convert.hfconfig import LAYER_MODULES, transformers_layer_modules

    cfg = preset("tiny")
    for i, kind in enumerate(cfg.mlp_layer_types[:2]):
        assert transformers_layer_modules(cfg, i) == LAYER_MODULES[kind], kind


def test_exclude_summary_matches_modelopt_on_full_beam(modelopt):
    """The prefix-wildcard summary of exclude_modules against ModelOpt's own function, on the
    module names ModelOpt reports for Beam-501B (52 layers; a layer's 256 experts are one
    `mlp.experts` module) and on lists where wildcards do apply."""
    from modelopt.torch.export.quant_utils import _prefix_wildcard_summarize_exclude_modules

    from beam_trtllm.config import preset
    from convert.hfconfig import modelopt_modules, summarize_excludes
    from convert.plan import make_plan
    from convert.recipe import load_recipe

    plan = make_plan(preset("beam-1.0-501b"), load_recipe("nvfp4-all"), True, False)
    names = [m for m, _ in modelopt_modules(plan)]
    kept = ("lm_head", "model.embed_tokens")
    routers = [n for n in names if n.endswith(".mlp.gate")]
    cases = [
        # a recipe that keeps the attention's output gate in BF16
        ([n for n in names if n.endswith("self_attn.gate_proj")] + list(kept) + routers,
         [n for n in names
          if not n.endswith(("self_attn.gate_proj", ".mlp.gate")) and n not in kept]),
        ([n for n in names if ".self_attn." in n or n in kept] + routers,  # experts-only recipe
         [n for n in names if ".mlp." in n and n not in routers]),
        (["model.layers.1.mlp.gate", "model.layers.10.mlp.gate", "model.layers.1.self_attn.o_proj"],
         ["model.layers.1.self_attn.q_proj", "model.layers.11.mlp.experts"]),
    ]
    for excluded, quantized in cases:
        expected = sorted(_prefix_wildcard_summarize_exclude_modules(excluded, quantized))
        assert summarize_excludes(excluded, quantized) == expected
