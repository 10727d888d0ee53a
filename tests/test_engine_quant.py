"""Engines built from quantized checkpoints (the converter's ModelOpt format) against the
reference model run on the dequantized weights.

The `beam::` GEMMs multiply the exactly decoded weights in FP32 and round each module output to
BF16 (plugins/_moe_common.ref_moe), so the reference's quantized Linears get the same: their
weight is the exact FP32 decode (`convert.dequantize.QuantizedCheckpoint.dequant_tensor`;
`convert.dequant` itself rounds to the BF16 layout), a forward pre-hook hands them the FP32
input, fake-quantized where the engine quantizes activations (FP8 W8A8: static per-tensor
`input_scale`, `quant_formats.fake_quant_fp8_activation`), and a forward hook rounds the output
to BF16. NVFP4 runs W4A16 (on Hopper and on the CPU), so its inputs are not quantized.
Everything else is reference.py in BF16 on `convert.dequant`'s state dict."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TINY_OPTS, drive, greedy, one_thread, prompts  # noqa: F401
from safetensors import safe_open
from torch import nn

from beam_trtllm.checkpoint import weight_map
from beam_trtllm.config import BeamConfig
from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.types import SamplingParams
from beam_trtllm.quant_formats import fake_quant_fp8_activation
from beam_trtllm.reference import BeamForCausalLM
from conftest import tol

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def quantized(tiny_dir, tmp_path_factory):
    """name -> (checkpoint dir, engine dir); the NVFP4 checkpoint carries FP8 KV scales, used
    by one engine (--kv-dtype fp8, whole prompts in one chunk) and ignored by the other."""
    from convert import ConvertOptions, convert

    base = tmp_path_factory.mktemp("quantized")
    ckpts = {recipe: convert(tiny_dir, base / f"tiny-{recipe}", ConvertOptions(
        recipe, kv_cache=kv, calib_samples=2, calib_seq_len=48, workers=1))
        for recipe, kv in (("nvfp4", "fp8"), ("fp8", "none"))}
    engines = {"nvfp4": ("nvfp4", {"kv_dtype": "bf16"}), "fp8": ("fp8", {}),
               "nvfp4-kv-fp8": ("nvfp4", {"kv_dtype": "fp8", "max_num_tokens": 160})}
    return {name: (ckpts[recipe], build_engine(ckpts[recipe], base / f"engine-{name}",
                                               BuildOptions(**{**TINY_OPTS, **opts})))
            for name, (recipe, opts) in engines.items()}


def reference_on_dequant(ckpt) -> BeamForCausalLM:
    from convert import dequant
    from convert.dequantize import QuantizedCheckpoint

    model = BeamForCausalLM.from_state_dict(BeamConfig.from_hf(ckpt), dequant(ckpt), torch.bfloat16)
    files = weight_map(ckpt)
    exact = QuantizedCheckpoint(ckpt)
    hooked = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or f"{name}.weight_scale" not in files:
            continue
        module.weight.data = exact.dequant_tensor(f"{name}.weight")  # FP32, exact
        with safe_open(str(files[f"{name}.weight"]), "pt") as f:
            fp8 = f.get_slice(f"{name}.weight").get_dtype() == "F8_E4M3"
        if fp8:
            with safe_open(str(files[f"{name}.input_scale"]), "pt") as f:
                scale = f.get_tensor(f"{name}.input_scale")
            module.register_forward_pre_hook(
                lambda m, args, s=scale: (fake_quant_fp8_activation(args[0].float(), s),))
            hooked += 1
        else:  # NVFP4: W4A16
            module.register_forward_pre_hook(lambda m, args: (args[0].float(),))
        module.register_forward_hook(lambda m, args, out: out.to(torch.bfloat16))
    exact.close()
    model.hooked = hooked
    return model


@pytest.mark.parametrize("name, hooked", [
    ("nvfp4", 6 * 4),               # FP8 q/k/v/o of 6 layers; NVFP4 MLPs unhooked
    ("fp8", 6 * 4 + 3 + 5 * 16 * 3),  # FP8 everywhere (g_proj and lm_head stay BF16)
])
def test_quantized_engine_matches_reference_on_dequantized_weights(quantized, name, hooked):
    ckpt, engine_dir = quantized[name]
    ref = reference_on_dequant(ckpt)
    assert ref.hooked == hooked
    engine = Engine.from_dir(engine_dir, device="cpu")
    ps = prompts(40, [6, 23, 41])
    n = 8
    results = drive(engine, {0: [(f"r{k}", p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0))
                                 for k, p in enumerate(ps)]})
    for k, p in enumerate(ps):
        want = ref.generate(torch.tensor([p]), n)[0, len(p):].tolist()
        assert results[f"r{k}"]["tokens"] == want, f"{name}: prompt of {len(p)}"
    # and the distributions, not just the argmax
    res = engine.generate([ps[2]], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0))[0]
    lp = ref(torch.tensor([ps[2] + res["token_ids"]]))[0, len(ps[2]) - 1:-1].log_softmax(-1)
    want = lp.gather(1, torch.tensor(res["token_ids"])[:, None])[:, 0]
    got = torch.tensor([x.logprob for x in res["logprobs"]])
    torch.testing.assert_close(got, want, **tol("engine-vs-reference", torch.bfloat16))


def fp8_kv_reference(monkeypatch, ref: BeamForCausalLM, ckpt) -> None:
    """Make the reference's KV cache hold what an FP8 cache holds: keys and values stored as
    fp8(clamp(x / scale)) * scale (FP32), read back for later steps; the step's own keys stay
    unquantized (the engine's attention takes them from k_new)."""
    from beam_trtllm import reference

    files = weight_map(ckpt)
    scales = {}
    for i in range(ref.config.num_hidden_layers):
        for kind in ("k", "v"):
            name = f"model.layers.{i}.self_attn.{kind}_proj.{kind}_scale"
            with safe_open(str(files[name]), "pt") as f:
                scales[i, kind] = f.get_tensor(name).float()

    def fq(x, s):
        return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s

    empty = reference.KVCache.empty

    def empty_fp8(cfg):
        cache = empty(cfg)
        for i, layer in enumerate(cache.layers):
            layer.scales = (scales[i, "k"], scales[i, "v"])
        return cache

    def append(self, k, v, pos):
        qk, qv = fq(k, self.scales[0]), fq(v, self.scales[1])
        if self.k is None:
            self.k, self.v, self.pos = qk, qv, pos
            return k, v, pos
        out = torch.cat([self.k, k.float()], 1), torch.cat([self.v, v.float()], 1)
        self.k, self.v = torch.cat([self.k, qk], 1), torch.cat([self.v, qv], 1)
        self.pos = torch.cat([self.pos, pos], 1)
        return (*out, self.pos)

    monkeypatch.setattr(reference.KVCache, "empty", staticmethod(empty_fp8))
    monkeypatch.setattr(reference.LayerKV, "append", append)


def test_fp8_kv_cache_engine_matches_reference_with_fp8_kv(quantized, monkeypatch):
    ckpt, engine_dir = quantized["nvfp4-kv-fp8"]
    engine = Engine.from_dir(engine_dir, device="cpu")
    assert engine.kv.full.dtype == torch.float8_e4m3fn and engine.kv.k_scale[1] != 1.0
    ref = reference_on_dequant(ckpt)
    fp8_kv_reference(monkeypatch, ref, ckpt)
    ps = prompts(42, [9, 37])  # longer than the window: the rings wrap in FP8
    results = drive(engine, {0: [(f"r{k}", p, greedy(10)) for k, p in enumerate(ps)]})
    for k, p in enumerate(ps):
        assert results[f"r{k}"]["tokens"] == ref.generate(torch.tensor([p]), 10)[0, len(p):].tolist()


def test_fp8_engine_with_split_projections_matches_reference(quantized, monkeypatch):
    """The GPU's batch-1 q/k/v and o_proj splits (two FP32 partial sums that qk_prep and the
    boundary's add_rmsnorm add) forced at every step on the CPU: the same greedy tokens as the
    reference."""
    from beam_trtllm.engine.model import BeamModel

    calls = []
    monkeypatch.setattr(BeamModel, "split_k", lambda self, t, n, k: calls.append(t) or 2)
    ckpt, engine_dir = quantized["fp8"]
    ref = reference_on_dequant(ckpt)
    engine = Engine.from_dir(engine_dir, device="cpu")
    ps = prompts(43, [5, 29])
    results = drive(engine, {0: [(f"r{k}", p, greedy(8)) for k, p in enumerate(ps)]})
    assert len(calls) >= 2 * 6 * 8  # both projections of every layer of every step split
    for k, p in enumerate(ps):
        assert results[f"r{k}"]["tokens"] == ref.generate(torch.tensor([p]), 8)[0, len(p):].tolist()
