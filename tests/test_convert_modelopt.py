"""`beam-trt convert` against ModelOpt 0.47's own flow (mtq.quantize with max calibration on the
same tokens + export_hf_checkpoint) on the tiny reference model: the same files, byte for byte:
hf_quant_config.json and config.json as text, every tensor's name, dtype, shape and bytes, so
weights, weight scales, input_scale (our layer-streamed calibration vs ModelOpt's whole-model
max calibration) and k/v scales are all identical."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from convert.calib_data import load_calib_tokens
from convert.pipeline import ConvertOptions, convert
from convert.plan import linear_modules
from modelopt_reference import modelopt_export

SAMPLES, SEQ = 2, 32  # the calibration batch both sides see: [2, 32] tokens of the shipped text

CASES = [  # recipe, FP8 KV, calibrated
    ("nvfp4", True, True),  # MIXED_PRECISION: FP8 attention + NVFP4 MLPs, input/k/v scales
    ("nvfp4-all", False, True),  # one format: exclude_modules summary, q/k/v fused scales
    ("fp8-block", True, True),  # fp8_pb_wo: 0-d / 4-D block scales, one-block fusion rule
    ("nvfp4", True, False),  # no calibration data: W4A16_NVFP4 + FP8 weight-only, no k/v scales
]


def _tensors(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("recipe,kv,calibrated", CASES, ids=[f"{r}-kv{k}-calib{c}" for r, k, c in CASES])
def test_same_files_as_modelopt_export(modelopt, tiny_dir, tmp_path, recipe, kv, calibrated):
    tokens = load_calib_tokens(tiny_dir, None, SAMPLES, SEQ)
    ref = modelopt_export(tiny_dir, tmp_path / "modelopt", recipe, kv, [tokens.ids] if calibrated else None)
    opts = ConvertOptions(recipe, "fp8" if kv else "none", calib_samples=SAMPLES if calibrated else 0,
                          calib_seq_len=SEQ, workers=2)
    ours = convert(tiny_dir, tmp_path / "ours", opts)
    for name in ("hf_quant_config.json", "config.json"):
        assert (ours / name).read_text() == (ref / name).read_text(), name
    a, b = _tensors(ref / "model.safetensors"), _tensors(ours / "model.safetensors")
    assert sorted(a) == sorted(b)
    for name in a:
        assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), name
        assert torch.equal(a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name
    quant = json.loads((ours / "hf_quant_config.json").read_text())["quantization"]
    has_input_scale = any(n.endswith("input_scale") for n in b)
    assert has_input_scale == (calibrated and recipe != "fp8-block")
    assert any(n.endswith("k_scale") for n in b) == (kv and calibrated)
    assert quant["kv_cache_quant_algo"] == ("FP8" if kv else None)


def test_exclude_summary_matches_modelopt_on_full_beam(modelopt):
    """The prefix-wildcard summary of exclude_modules against ModelOpt's own function, on
    Beam-501B's module names (52 layers, 256 experts) and on lists where wildcards do apply."""
    from modelopt.torch.export.quant_utils import _prefix_wildcard_summarize_exclude_modules

    from beam_trtllm.config import preset
    from convert.hfconfig import summarize_excludes

    names = list(linear_modules(preset("beam-1.0-501b")))
    cases = [
        ([n for n in names if n.endswith("g_proj")] + ["lm_head", "model.embed_tokens"],
         [n for n in names if not n.endswith("g_proj") and n != "lm_head"]),
        ([n for n in names if ".self_attn." in n or n == "lm_head"],  # experts-only recipe
         [n for n in names if ".mlp." in n]),
        (["model.layers.1.mlp.gate", "model.layers.10.mlp.gate", "model.layers.1.self_attn.o_proj"],
         ["model.layers.1.self_attn.q_proj", "model.layers.11.mlp.experts.0.up_proj"]),
    ]
    for excluded, quantized in cases:
        expected = sorted(_prefix_wildcard_summarize_exclude_modules(excluded, quantized))
        assert summarize_excludes(excluded, quantized) == expected
