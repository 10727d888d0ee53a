"""The moe_* references against reference.py's BeamMoE (router included) run on the decoded
checkpoint weights, with the kernels' activation quantizers attached as forward pre-hooks on
the expert Linears. In FP32 (and for unquantized weights in BF16) the math is the same op for
op, so the results must be identical; in BF16 the quantized references multiply the exactly
decoded FP32 values while a BF16 BeamMoE first rounds them to BF16."""

import pytest
import torch

import plugins  # noqa: F401  (registers torch.ops.beam.*)
from _moe_testdata import FORMATS, activation_scales, decoded_experts, dense_experts, pack_experts
from _moe_testdata import moe_args, random_routing
from beam_trtllm import quant_formats as qf
from beam_trtllm.config import BeamConfig
from beam_trtllm.reference import BeamMoE
from conftest import tol
from plugins import moe_bf16, moe_fp8, moe_fp8_block, moe_nvfp4
from plugins.registry import PluginError

REFS = {"bf16": moe_bf16.ref_moe_bf16, "fp8": moe_fp8.ref_moe_fp8,
        "fp8_block": moe_fp8_block.ref_moe_fp8_block, "nvfp4": moe_nvfp4.ref_moe_nvfp4}


def _beam_moe(cfg, experts, dtype, quant13, quant2):
    moe = BeamMoE(cfg).eval().requires_grad_(False)
    torch.nn.init.normal_(moe.gate.weight, std=cfg.hidden_size**-0.5)
    torch.nn.init.normal_(moe.gate.e_score_correction_bias, std=0.1)
    moe.experts.to(dtype)
    for mlp, (g, u, d) in zip(moe.experts, experts):
        mlp.gate_proj.weight.copy_(g)
        mlp.up_proj.weight.copy_(u)
        mlp.down_proj.weight.copy_(d)
        for lin, quant in ((mlp.gate_proj, quant13), (mlp.up_proj, quant13), (mlp.down_proj, quant2)):
            lin.register_forward_pre_hook(lambda mod, args, q=quant: (q(args[0]),))
    return moe


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_equals_beam_moe_on_decoded_weights(fmt, dtype):
    cfg = BeamConfig(hidden_size=208, moe_intermediate_size=144, n_routed_experts=16,
                     num_experts_per_tok=4, n_group=4, topk_group=2)
    e, h, inner = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gate, up, down = dense_experts(e, h, inner, seed=3)
    x = torch.randn(13, h).to(dtype)
    scales = activation_scales(x, h_amax=3.0)
    identity = lambda a: a  # noqa: E731
    quant13 = quant2 = identity
    if fmt == "fp8":
        quant13 = lambda a: qf.fake_quant_fp8_activation(a, scales["a13_scale"])  # noqa: E731
        quant2 = lambda a: qf.fake_quant_fp8_activation(a, scales["a2_scale"])  # noqa: E731
    elif fmt == "fp8_block":
        quant13 = quant2 = qf.fake_quant_fp8_per_token_block
    moe = _beam_moe(cfg, decoded_experts(fmt, gate, up, down, dtype), dtype, quant13, quant2)
    with torch.no_grad():
        ids, weights = moe.gate(x)
        expected = moe(x)
    packed = pack_experts(fmt, gate, up, down)
    if fmt == "bf16":  # the unquantized op takes weights in the activation dtype
        packed = {k: v.to(dtype) for k, v in packed.items()}
    args = moe_args(fmt, x, ids.to(torch.int32), weights, packed, scales)
    got = REFS[fmt](*args)
    if dtype == torch.float32 or fmt == "bf16":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, **tol("moe-ref-bf16-weights", dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_op_on_cpu_runs_the_reference_and_meta_gives_the_shape(fmt, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # plain CPU: the registry picks the reference
    gate, up, down = dense_experts(8, 64, 32, seed=1)
    x = torch.randn(5, 64).to(torch.bfloat16)
    ids, w = random_routing(5, 8, 2, seed=0)
    args = moe_args(fmt, x, ids, w, pack_experts(fmt, gate, up, down), activation_scales(x, 3.0))
    op = getattr(torch.ops.beam, f"moe_{fmt}")
    assert torch.equal(op(*args), REFS[fmt](*args))
    meta = op(*(a.to("meta") for a in args))
    assert meta.shape == x.shape and meta.dtype == x.dtype and meta.device.type == "meta"


def test_bad_inputs_name_the_tensor():
    gate, up, down = dense_experts(4, 32, 16, seed=1)
    packed = pack_experts("bf16", gate, up, down)
    x = torch.randn(3, 32).to(torch.bfloat16)
    ids, w = random_routing(3, 4, 2, seed=0)
    with pytest.raises(PluginError, match="w2 has shape"):
        moe_bf16.ref_moe_bf16(x, ids, w, packed["w13"], packed["w2"][:, :, :8])
    with pytest.raises(PluginError, match="topk_weights has dtype"):
        moe_bf16.ref_moe_bf16(x, ids, w.to(torch.bfloat16), packed["w13"], packed["w2"])
    with pytest.raises(PluginError, match=r"outside \[0, 4\)"):
        moe_bf16.ref_moe_bf16(x, ids + 3, w, packed["w13"], packed["w2"])
