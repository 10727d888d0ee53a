"""Engines built from quantized checkpoints (the converter's ModelOpt format) against
transformers' BeamForCausalLM on the exactly decoded weights, with the engine's activation
quantizers put where the engine applies them.

Both sides run in FP32 (the engine as a `--dtype float32` build), so what is compared is the
quantized model itself, not BF16 rounding: the canonical model's Linears get the exact FP32
decode of the stored weights (`QuantizedCheckpoint.dequant_tensor`), a forward pre-hook hands
FP8 W8A8 Linears their input through the static `input_scale` quantizer, and the fused experts
(`BeamExperts`) get theirs before the experts (the layer's shared gate/up scale) and after the
SwiGLU (the shared down scale). NVFP4 runs W4A16 (on Hopper and on the CPU): no activation
quantizer. An FP8 KV cache is a transformers cache that stores each key and value as the
engine's cache does (fp8(clamp(x / s)) * s) and attends over what it stores, the step's own
keys included (beam::attention's contract)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TINY_OPTS, drive, greedy, one_thread, prompts  # noqa: F401

from beam_trtllm.config import BeamConfig
from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.types import SamplingParams
from beam_trtllm.hf_model import logits, model_from_state_dict, stream
from beam_trtllm.quant_formats import fake_quant_fp8_activation
from conftest import tol

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def quantized(tiny_dir, tmp_path_factory):
    """name -> (checkpoint dir, FP32 engine dir); the NVFP4 checkpoint carries FP8 KV scales,
    used by one engine (--kv-dtype fp8, whole prompts in one chunk) and ignored by the other."""
    from convert import ConvertOptions, convert

    base = tmp_path_factory.mktemp("quantized")
    ckpts = {recipe: convert(tiny_dir, base / f"tiny-{recipe}", ConvertOptions(
        recipe, kv_cache=kv, calib_samples=2, calib_seq_len=48, workers=1))
        for recipe, kv in (("nvfp4", "fp8"), ("fp8", "none"))}
    engines = {"nvfp4": ("nvfp4", {"kv_dtype": "fp32"}), "fp8": ("fp8", {}),
               "nvfp4-kv-fp8": ("nvfp4", {"kv_dtype": "fp8", "max_num_tokens": 160})}
    return {name: (ckpts[recipe], build_engine(ckpts[recipe], base / f"engine-{name}",
                                               BuildOptions(**{**TINY_OPTS, **opts,
                                                               "dtype": "float32"})))
            for name, (recipe, opts) in engines.items()}


def _input_quantizer(q, module: str):
    """The engine's activation quantizer of a stored Linear: FP8 W8A8's static scale, or None
    (NVFP4 W4A16, BF16)."""
    if module + ".input_scale" not in q.where or q.tensor(module + ".weight").dtype != torch.float8_e4m3fn:
        return None
    scale = q.tensor(module + ".input_scale")
    return lambda x: fake_quant_fp8_activation(x, scale)


def _hook_experts(experts, quant13, quant2) -> None:
    """Quantize the fused experts' input before them and the SwiGLU output before down_proj."""
    experts.register_forward_pre_hook(lambda m, args: (quant13(args[0]), *args[1:]))
    apply_gate = experts._apply_gate
    experts._apply_gate = lambda gate_up: quant2(apply_gate(gate_up))


def model_on_exact_weights(ckpt):
    """transformers' model (FP32) on the exact decode, with the engine's quantizers; returns
    (model, number of quantizers hooked)."""
    from convert.dequantize import QuantizedCheckpoint

    q = QuantizedCheckpoint(ckpt)
    cfg = BeamConfig.from_hf(ckpt)
    state = {name: q.dequant_tensor(name).float() for name in _expected(cfg)}
    model = model_from_state_dict(cfg, state, torch.float32)
    hooked = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (quant := _input_quantizer(q, name)):
            module.register_forward_pre_hook(lambda m, args, f=quant: (f(args[0]),))
            hooked += 1
        elif name.endswith("mlp.experts"):
            quant13 = _input_quantizer(q, f"{name}.0.gate_proj")  # shared by the layer's experts
            quant2 = _input_quantizer(q, f"{name}.0.down_proj")
            if quant13 is not None:
                _hook_experts(module, quant13, quant2)
                hooked += 2
    q.close()
    return model, hooked


def _expected(cfg):
    from beam_trtllm.checkpoint import expected_tensors

    return expected_tensors(cfg)


@pytest.mark.parametrize("name, hooked", [
    ("nvfp4", 6 * 5),              # FP8 q/k/v/gate/o of 6 layers; NVFP4 MLPs W4A16
    ("fp8", 6 * 5 + 2 * 3 + 4 * 2),  # FP8 everywhere but lm_head: 2 dense MLPs, 4 MoE layers
])
def test_quantized_engine_matches_the_model_on_its_weights(quantized, name, hooked):
    ckpt, engine_dir = quantized[name]
    model, n_hooked = model_on_exact_weights(ckpt)
    assert n_hooked == hooked
    engine = Engine.from_dir(engine_dir, device="cpu")
    ps = prompts(40, [6, 23, 41])
    n = 8
    results = drive(engine, {0: [(f"r{k}", p, greedy(n)) for k, p in enumerate(ps)]})
    for k, p in enumerate(ps):
        want = [int(t[0]) for t in stream(model, torch.tensor([p]), n)]
        assert results[f"r{k}"]["tokens"] == want, f"{name}: prompt of {len(p)}"
    # and the distributions, not just the argmax
    res = engine.generate([ps[2]], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0))[0]
    lp = logits(model, torch.tensor([ps[2] + res["token_ids"]]))[0, len(ps[2]) - 1:-1]
    want = lp.log_softmax(-1).gather(1, torch.tensor(res["token_ids"])[:, None])[:, 0]
    got = torch.tensor([x.logprob for x in res["logprobs"]])
    torch.testing.assert_close(got, want, **tol("quantized-engine-vs-model", torch.float32))


def fp8_kv_cache(model, ckpt):
    """A transformers cache holding what the engine's FP8 cache holds."""
    from transformers import DynamicCache

    from convert.dequantize import QuantizedCheckpoint

    q = QuantizedCheckpoint(ckpt)
    scales = {i: tuple(q.tensor(f"model.layers.{i}.self_attn.{n}_proj.{n}_scale").float()
                       for n in "kv") for i in range(model.config.num_hidden_layers)}
    q.close()

    def fq(x, s):
        return ((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(x.dtype)

    class FP8Cache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            ks, vs = scales[layer_idx]
            return super().update(fq(key_states, ks), fq(value_states, vs), layer_idx, *args,
                                  **kwargs)

    return FP8Cache(config=model.config)


def test_fp8_kv_cache_engine_matches_the_model_with_an_fp8_cache(quantized):
    ckpt, engine_dir = quantized["nvfp4-kv-fp8"]
    engine = Engine.from_dir(engine_dir, device="cpu")
    assert engine.kv.full.dtype == torch.float8_e4m3fn and engine.kv.k_scale[1] != 1.0
    model, _ = model_on_exact_weights(ckpt)
    ps = prompts(42, [9, 37])  # longer than the window: the rings wrap in FP8
    results = drive(engine, {0: [(f"r{k}", p, greedy(10)) for k, p in enumerate(ps)]})
    for k, p in enumerate(ps):
        cache, feed, want = fp8_kv_cache(model, ckpt), torch.tensor([p]), []
        with torch.inference_mode():
            for _ in range(10):
                token = model(input_ids=feed, cache=cache, use_cache=True).logits[0, -1].argmax()
                want.append(int(token))
                feed = token.view(1, 1)
        assert results[f"r{k}"]["tokens"] == want


def test_fp8_engine_with_split_projections_matches_the_model(quantized, monkeypatch):
    """The GPU's batch-1 q/k/v/gate and o_proj splits (two FP32 partial sums that qk_prep and
    the boundary's add_rmsnorm add) forced at every step on the CPU: the same greedy tokens."""
    from beam_trtllm.engine.model import BeamModel

    calls = []
    monkeypatch.setattr(BeamModel, "split_k", lambda self, t, n, k: calls.append(t) or 2)
    ckpt, engine_dir = quantized["fp8"]
    model, _ = model_on_exact_weights(ckpt)
    engine = Engine.from_dir(engine_dir, device="cpu")
    ps = prompts(43, [5, 29])
    results = drive(engine, {0: [(f"r{k}", p, greedy(8)) for k, p in enumerate(ps)]})
    assert len(calls) >= 2 * 6 * 8  # both projections of every layer of every step split
    for k, p in enumerate(ps):
        assert results[f"r{k}"]["tokens"] == [int(t[0]) for t in stream(model, torch.tensor([p]), 8)]
