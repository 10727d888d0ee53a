"""Engines built from quantized checkpoints (the converter's ModelOpt format) against the
reference model run on `convert.dequant`'s BF16 weights.

Where the engine quantizes activations (FP8 W8A8 Linears and experts: static per-tensor
input scales), the reference gets the same fake quantization through forward pre-hooks
(`quant_formats.fake_quant_fp8_activation` with each Linear's own `input_scale`); NVFP4 runs
W4A16 on Hopper and on the CPU, so its Linears get no hook."""

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
    """recipe -> (checkpoint dir, engine dir), converted once per module."""
    from convert import ConvertOptions, convert

    out = {}
    base = tmp_path_factory.mktemp("quantized")
    for recipe in ("nvfp4", "fp8"):
        ckpt = convert(tiny_dir, base / f"tiny-{recipe}", ConvertOptions(
            recipe, calib_samples=2, calib_seq_len=48, workers=1))
        out[recipe] = (ckpt, build_engine(ckpt, base / f"engine-{recipe}", BuildOptions(**TINY_OPTS)))
    return out


def reference_on_dequant(ckpt) -> BeamForCausalLM:
    from convert import dequant

    model = BeamForCausalLM.from_state_dict(BeamConfig.from_hf(ckpt), dequant(ckpt), torch.bfloat16)
    files = weight_map(ckpt)
    hooked = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or f"{name}.input_scale" not in files:
            continue
        with safe_open(str(files[f"{name}.weight"]), "pt") as f:
            if f.get_slice(f"{name}.weight").get_dtype() != "F8_E4M3":
                continue  # NVFP4: W4A16, activations stay BF16
        with safe_open(str(files[f"{name}.input_scale"]), "pt") as f:
            scale = f.get_tensor(f"{name}.input_scale")
        module.register_forward_pre_hook(
            lambda m, args, s=scale: (fake_quant_fp8_activation(args[0], s),))
        hooked += 1
    model.hooked = hooked
    return model


@pytest.mark.parametrize("recipe, hooked", [
    ("nvfp4", 6 * 4),               # FP8 q/k/v/o of 6 layers; NVFP4 MLPs unhooked
    ("fp8", 6 * 4 + 3 + 5 * 16 * 3),  # FP8 everywhere (g_proj and lm_head stay BF16)
])
def test_quantized_engine_matches_reference_on_dequantized_weights(quantized, recipe, hooked):
    ckpt, engine_dir = quantized[recipe]
    ref = reference_on_dequant(ckpt)
    assert ref.hooked == hooked
    engine = Engine.from_dir(engine_dir, device="cpu")
    ps = prompts(40, [6, 23, 41])
    n = 8
    results = drive(engine, {0: [(f"r{k}", p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0))
                                 for k, p in enumerate(ps)]})
    for k, p in enumerate(ps):
        want = ref.generate(torch.tensor([p]), n)[0, len(p):].tolist()
        assert results[f"r{k}"]["tokens"] == want, f"{recipe}: prompt of {len(p)}"
    # and the distributions, not just the argmax
    res = engine.generate([ps[2]], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0))[0]
    lp = ref(torch.tensor([ps[2] + res["token_ids"]]))[0, len(ps[2]) - 1:-1].log_softmax(-1)
    want = lp.gather(1, torch.tensor(res["token_ids"])[:, None])[:, 0]
    got = torch.tensor([x.logprob for x in res["logprobs"]])
    torch.testing.assert_close(got, want, **tol("engine-vs-reference", torch.bfloat16))
