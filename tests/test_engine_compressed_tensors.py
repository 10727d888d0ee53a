"""Engines built from compressed-tensors FP8_DYNAMIC checkpoints written by the
compressed-tensors library itself (tests/ct_reference.py, nothing of beam-trt's), against
transformers' BeamForCausalLM on the exactly decoded weights with the engine's dynamic
per-token activation quantizer where the engine applies it; the decode against the library's
own decompression; the schemes and tensors a build refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from ct_reference import ct_decompress, ct_export
from engine_helpers import TINY_OPTS, drive, greedy, one_thread, prompts  # noqa: F401
from safetensors.torch import load_file, save_file

from beam_trtllm.config import BeamConfig
from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.types import EngineError, SamplingParams
from beam_trtllm.hf_model import logits, model_from_state_dict, stream
from beam_trtllm.quant_formats import fake_quant_fp8_per_token
from conftest import tol

pytestmark = pytest.mark.usefixtures("one_thread")
EXPERTS_BF16 = ["lm_head", r"re:.*mlp\.experts\..*"]  # as published FP8 Beam variants do


@pytest.fixture(scope="module")
def ct_ckpts(tiny_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("ct")
    return {"all": ct_export(tiny_dir, base / "ct-all", ignore=["lm_head"]),
            "experts-bf16": ct_export(tiny_dir, base / "ct-experts-bf16", ignore=EXPERTS_BF16)}


def _hook_experts(experts, quant):
    experts.register_forward_pre_hook(lambda m, args: (quant(args[0]), *args[1:]))
    apply_gate = experts._apply_gate
    experts._apply_gate = lambda gate_up: quant(apply_gate(gate_up))


def model_on_exact_weights(ckpt):
    """transformers' model (FP32) on codes x scale in FP32, each FP8 Linear (and FP8 experts)
    fed through the per-token quantizer; -> (model, quantizers hooked)."""
    from beam_trtllm.checkpoint import SafetensorsCheckpoint, expected_tensors

    src = SafetensorsCheckpoint(ckpt)
    cfg = BeamConfig.from_hf(ckpt)
    state, fp8 = {}, set()
    for name in expected_tensors(cfg):
        t = src.get(name)
        if t.dtype == torch.float8_e4m3fn:
            module = name[: -len(".weight")]
            t = t.float() * src.get(module + ".weight_scale").float()
            fp8.add(module)
        state[name] = t.float()
    model = model_from_state_dict(cfg, state, torch.float32)
    hooked = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name in fp8:
            module.register_forward_pre_hook(lambda m, args: (fake_quant_fp8_per_token(args[0]),))
            hooked += 1
        elif name.endswith("mlp.experts") and f"{name}.0.gate_proj" in fp8:
            _hook_experts(module, fake_quant_fp8_per_token)
            hooked += 2
    return model, hooked


@pytest.mark.parametrize("which, hooked, experts", [
    ("all", 6 * 5 + 2 * 3 + 4 * 2, "fp8_channel"),  # every decoder Linear FP8, experts too
    ("experts-bf16", 6 * 5 + 2 * 3, "bf16"),       # `ignore` keeps the experts BF16
])
def test_library_checkpoint_builds_and_generates_as_the_model(ct_ckpts, tmp_path, which,
                                                              hooked, experts):
    ckpt = ct_ckpts[which]
    engine_dir = build_engine(ckpt, tmp_path / "engine",
                              BuildOptions(**TINY_OPTS, dtype="float32"))
    spec = json.loads((engine_dir / "engine.json").read_text())
    assert spec["quantization"]["scheme"].startswith("compressed-tensors FP8_DYNAMIC")
    layers = spec["quantization"]["layers"]
    assert {layers[f"layer{i}"]["experts"] for i in (1, 2, 4, 5)} == {experts}
    assert layers["layer0"]["self_attn.qkvg_proj"] == [{"format": "fp8_channel", "rows": 192,
                                                         "parts": ["self_attn.q_proj",
                                                                   "self_attn.k_proj",
                                                                   "self_attn.v_proj",
                                                                   "self_attn.gate_proj"]}]
    model, n_hooked = model_on_exact_weights(ckpt)
    assert n_hooked == hooked
    engine = Engine.from_dir(engine_dir, device="cpu")
    ps = prompts(46, [7, 30])
    results = drive(engine, {0: [(f"r{k}", p, greedy(8)) for k, p in enumerate(ps)]})
    for k, p in enumerate(ps):
        assert results[f"r{k}"]["tokens"] == [int(t[0]) for t in stream(model, torch.tensor([p]), 8)]
    res = engine.generate([ps[1]], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0))[0]
    lp = logits(model, torch.tensor([ps[1] + res["token_ids"]]))[0, len(ps[1]) - 1:-1]
    want = lp.log_softmax(-1).gather(1, torch.tensor(res["token_ids"])[:, None])[:, 0]
    got = torch.tensor([x.logprob for x in res["logprobs"]])
    torch.testing.assert_close(got, want, **tol("quantized-engine-vs-model", torch.float32))


def test_bf16_engine_generates(ct_ckpts, tmp_path):
    engine = Engine.from_dir(build_engine(ct_ckpts["all"], tmp_path / "e", BuildOptions(**TINY_OPTS)),
                             device="cpu")
    out = engine.generate([prompts(45, [9])[0]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out[0]["token_ids"]) == 6


def test_decode_equals_the_library_decompression_byte_for_byte(ct_ckpts):
    from convert.dequantize import QuantizedCheckpoint

    for ckpt in ct_ckpts.values():
        library = ct_decompress(ckpt)
        q = QuantizedCheckpoint(ckpt)
        assert len(library) == sum(n.endswith(".weight_scale") for n in q.names()) > 0
        for module, want in library.items():
            got = q.dequant_tensor(module + ".weight")
            assert got.dtype == want.dtype == torch.bfloat16, module
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), module
        q.close()


def _copy(ckpt, dst, config=None, tensors=None):
    shutil.copytree(ckpt, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg["quantization_config"]["config_groups"]["group_0"])
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        state = load_file(str(dst / "model.safetensors"))
        tensors(state)
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _int8(g):
    g["weights"]["type"] = g["input_activations"]["type"] = "int"
    g["format"] = "int-quantized"


def _int8_float_format(g):
    g["weights"]["type"] = "int"


def _group(g):
    g["weights"].update(strategy="group", group_size=32)


def _static(g):
    g["input_activations"].update(dynamic=False, strategy="tensor")


def _weight_only(g):
    g["input_activations"] = None


@pytest.mark.parametrize("edit, match", [
    (_int8, "format 'int-quantized'"),
    (_int8_float_format, "weights int8"),
    (_group, "weights strategy 'group'.*group-wise"),
    (_static, r"input_activations 'tensor', dynamic False \(static activations\)"),
    (_weight_only, "weight-only"),
])
def test_unsupported_schemes_are_refused_by_name(ct_ckpts, tmp_path, edit, match):
    ckpt = _copy(ct_ckpts["all"], tmp_path / "ckpt", config=edit)
    with pytest.raises(EngineError, match=match):
        build_engine(ckpt, tmp_path / "engine", BuildOptions(**TINY_OPTS))
    assert not (tmp_path / "engine").exists()


SCALE = "model.layers.2.mlp.experts.3.down_proj.weight_scale"


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.pop(SCALE), f"no tensor {SCALE}"),
    (lambda s: s.update({SCALE: s[SCALE][:-1]}), f"tensor {SCALE} is torch.bfloat16 \\[63, 1\\]"),
    (lambda s: s.update({SCALE: s[SCALE].reshape(1, -1)}), f"tensor {SCALE} .*\\[1, 64\\]"),
    (lambda s: s.update({"lm_head.weight": s["lm_head.weight"].to(torch.float8_e4m3fn)}),
     "lm_head.weight is torch.float8_e4m3fn, but the compressed-tensors scheme leaves lm_head"),
])
def test_missing_or_misshaped_scales_name_the_tensor(ct_ckpts, tmp_path, edit, match):
    ckpt = _copy(ct_ckpts["all"], tmp_path / "ckpt", tensors=edit)
    with pytest.raises(EngineError, match=match):
        build_engine(ckpt, tmp_path / "engine", BuildOptions(**TINY_OPTS))


def test_a_quantized_module_stored_in_bf16_is_refused(ct_ckpts, tiny_dir, tmp_path):
    """experts BF16 on disk but not in `ignore`: the scheme and the tensors disagree."""
    def drop_ignore(cfg):
        cfg["quantization_config"]["ignore"] = ["lm_head"]
    ckpt = shutil.copytree(ct_ckpts["experts-bf16"], tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    drop_ignore(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError, match="experts.0.gate_proj.weight is torch.bfloat16, but "
                                          "the compressed-tensors scheme quantizes it"):
        build_engine(ckpt, tmp_path / "engine", BuildOptions(**TINY_OPTS))
