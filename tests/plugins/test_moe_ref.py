"""The moe_* references against transformers' BeamMoE (its router, experts and routed scale)
run on the decoded checkpoint weights, with the kernels' activation quantizers attached to
the experts' inputs (a forward pre-hook) and to h (BeamExperts._apply_gate's output). In FP32
the math is the same op for op, so the results are identical, per slot and combined. In BF16
transformers' eager experts round each weighted expert output and each partial sum to BF16,
where the spec pins an FP32 sum rounded once (shared/BEAM_SPEC.md "Router and experts"): the
per-slot outputs of unquantized weights are still identical and the combine is the pinned
formula's bits; the quantized references also multiply the exactly decoded FP32 values where
a BF16 BeamMoE first rounds them to BF16."""

import pytest
import torch
import torch.nn.functional as F

import hf_oracle
import plugins  # noqa: F401  (registers torch.ops.beam.*)
from _moe_testdata import (FORMATS, ROUTED_SCALE, activation_scales, decoded_experts,
                           dense_experts, moe_args, pack_experts, random_routing)
from beam_trtllm import quant_formats as qf
from beam_trtllm.config import BeamConfig
from conftest import tol
from plugins import moe_bf16, moe_fp8, moe_fp8_block, moe_nvfp4
from plugins._reference import swiglu
from plugins.registry import PluginError

REFS = {"bf16": moe_bf16.ref_moe_bf16, "fp8": moe_fp8.ref_moe_fp8,
        "fp8_block": moe_fp8_block.ref_moe_fp8_block, "nvfp4": moe_nvfp4.ref_moe_nvfp4}
CFG = BeamConfig(hidden_size=208, moe_intermediate_size=144, num_experts=16,
                 num_experts_per_tok=4, n_group=4, topk_group=2,
                 routed_scaling_factor=ROUTED_SCALE)


def _transformers_moe(cfg, experts, dtype, quant13, quant2):
    """transformers' BeamMoE (seeded router, FP32) holding `experts` [(gate, up, down)] in
    `dtype`, with quant13 on the experts' input and quant2 on h."""
    moe = hf_oracle.moe(cfg, dtype, seed=1)
    with torch.no_grad():
        moe.experts.gate_up_proj.copy_(torch.stack([torch.cat([g, u]) for g, u, _ in experts]))
        moe.experts.down_proj.copy_(torch.stack([d for _, _, d in experts]))
    moe.experts.register_forward_pre_hook(lambda mod, args: (quant13(args[0]), *args[1:]))
    apply_gate = moe.experts._apply_gate
    moe.experts._apply_gate = lambda gate_up: quant2(apply_gate(gate_up))
    return moe


def _quantizers(fmt, scales):
    identity = lambda a: a  # noqa: E731
    if fmt == "fp8":
        return (lambda a: qf.fake_quant_fp8_activation(a, scales["a13_scale"]),  # noqa: E731
                lambda a: qf.fake_quant_fp8_activation(a, scales["a2_scale"]))
    if fmt == "fp8_block":
        return qf.fake_quant_fp8_per_token_block, qf.fake_quant_fp8_per_token_block
    return identity, identity


def _per_slot(moe, x, ids):
    """BeamExperts' own output of each (token, slot) [T, k, H]: the experts run on the whole
    routing (the same GEMM rows) with weight 1 on slot j and 0 elsewhere (exact: y * 1 + 0)."""
    k = ids.shape[1]
    return torch.stack([moe.experts(x, ids, F.one_hot(torch.full_like(ids[:, 0], j), k).float())
                        for j in range(k)], 1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_equals_transformers_moe_on_decoded_weights(fmt, dtype):
    e, h, inner = CFG.num_experts, CFG.hidden_size, CFG.moe_intermediate_size
    gate, up, down = dense_experts(e, h, inner, seed=3)
    x = torch.randn(13, h, generator=torch.Generator().manual_seed(4)).to(dtype)
    scales = activation_scales(x, h_amax=3.0)
    moe = _transformers_moe(CFG, decoded_experts(fmt, gate, up, down, dtype), dtype,
                            *_quantizers(fmt, scales))
    with torch.no_grad():
        _, weights, ids = moe.gate(x)
        expected = moe(x[None])[0]
        expected_slots = _per_slot(moe, x, ids)
    packed = pack_experts(fmt, gate, up, down)
    if fmt == "bf16":  # the unquantized op takes weights in the activation dtype
        packed = {k: v.to(dtype) for k, v in packed.items()}
    args = moe_args(fmt, x, ids.to(torch.int32), weights, packed, scales)
    got = REFS[fmt](*args, scale=CFG.routed_scaling_factor)
    slots = REFS[fmt](*args, per_slot=True)
    assert torch.equal(REFS[fmt](*args, per_slot=True, scale=2.0), slots)  # (not per slot)
    if dtype == torch.float32:
        # the same FP32 GEMMs on the same rows: bit for bit where the CPU's GEMM kernel sums
        # both alike (AVX-512 machines); an AMX machine's oneDNN sums fp8_block's decoded
        # weights in another order than transformers' (1.9e-6 measured): its tolerance entry
        tol_fp32 = tol("moe-fp32-gemm-order", torch.float32)
        torch.testing.assert_close(slots, expected_slots, **tol_fp32)
        torch.testing.assert_close(got, expected, **tol_fp32)
        return
    # BF16: the pinned combine of the slots, FP32 in the experts' order, scaled, rounded once
    order = ids.argsort(dim=1)
    total = torch.zeros(x.shape)
    for r in range(ids.shape[1]):
        j = order[:, r:r + 1]
        y_j = slots.gather(1, j[..., None].expand(-1, -1, h))[:, 0]
        total = total + y_j.float() * weights.gather(1, j)
    assert torch.equal(got, (total * CFG.routed_scaling_factor).to(dtype))
    if fmt == "bf16":
        assert torch.equal(slots, expected_slots)
        torch.testing.assert_close(got, expected, **tol("moe-transformers-eager", dtype))
    else:
        torch.testing.assert_close(got, expected, **tol("moe-ref-bf16-weights", dtype))


def test_swiglu_rounds_once_like_transformers():
    """SwiGLU of BF16 gate / up GEMM outputs: silu and the product in FP32, one rounding
    (BeamExperts._apply_gate, BeamMLP), which rounding silu first would not give."""
    gen = torch.Generator().manual_seed(5)
    gate = (torch.randn(64, 256, generator=gen) * 2).to(torch.bfloat16)
    up = (torch.randn(64, 256, generator=gen) * 2).to(torch.bfloat16)
    moe = hf_oracle.moe(CFG, torch.bfloat16)
    got = swiglu(gate, up)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, moe.experts._apply_gate(torch.cat([gate, up], -1)))
    twice = F.silu(gate) * up  # BF16 silu, then a BF16 product: two roundings (v1)
    assert (twice != got).float().mean() > 0.05


@pytest.mark.parametrize("fmt", FORMATS)
def test_op_on_cpu_runs_the_reference_and_meta_gives_the_shape(fmt, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # plain CPU: the registry picks the reference
    gate, up, down = dense_experts(8, 64, 32, seed=1)
    x = torch.randn(5, 64).to(torch.bfloat16)
    ids, w = random_routing(5, 8, 2, seed=0)
    args = moe_args(fmt, x, ids, w, pack_experts(fmt, gate, up, down), activation_scales(x, 3.0))
    op = getattr(torch.ops.beam, f"moe_{fmt}")
    assert torch.equal(op(*args), REFS[fmt](*args))
    assert torch.equal(op(*args, scale=ROUTED_SCALE), REFS[fmt](*args, scale=ROUTED_SCALE))
    meta = op(*(a.to("meta") for a in args), scale=ROUTED_SCALE)
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
