"""The per-channel FP8 ops (linear_fp8_channel, moe_fp8_channel: one weight scale per output
row, activations quantized per token on the fly; compressed-tensors FP8_DYNAMIC) in Triton's
interpreter on the CPU (on a GPU machine, there) against their ref_ functions: a few tokens
and many, K and N not multiples of any tile, experts without tokens, both routing paths,
FP32 and BF16, weights quantized by the compressed-tensors library itself."""

import pytest
import torch

import plugins  # noqa: F401
from _moe_testdata import ROUTED_SCALE, dense_experts, random_routing
from beam_trtllm.quant_formats import quantize_fp8_per_token
from conftest import tol
from ct_reference import ct_quantize_weight
from kernel_cases import KERNEL_DEVICE, on_cpu
from plugins import _moe_common, linear_fp8_channel, moe_fp8_channel
from plugins._fp8_token import quant_fp8_per_token
from plugins.registry import PluginError

pytestmark = pytest.mark.kernel
E, K = 8, 4


def _moe_tol(dtype):
    # on a GPU also Hopper's reduced-precision FP8 MMA
    return tol("moe-fp8-mma" if KERNEL_DEVICE == "cuda" else "moe-fp8", dtype)


def _channel(w: torch.Tensor):
    """A BF16 weight through compressed-tensors -> (codes, the op's FP32 [N] scale)."""
    q, s = ct_quantize_weight(w.to(torch.bfloat16))
    return q, s.float().reshape(-1)


def test_per_token_quantizer_codes_equal_the_reference():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)) * 3
    x[2] = 0  # an all-zero token: scale eps / 448, codes 0
    x[3, 7] = 1e4  # one outlier sets its row's scale
    q, s = quant_fp8_per_token(x.to(KERNEL_DEVICE))
    want_q, want_s = quantize_fp8_per_token(x)
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 131])
def test_linear_matches_reference(dtype, t):
    g = torch.Generator().manual_seed(t)
    w = torch.randn(72, 208, generator=g) * 208**-0.5
    x = (torch.randn(t, 208, generator=g) * 2).to(dtype)
    args = tuple(a.to(KERNEL_DEVICE) for a in (x, *_channel(w)))
    out = linear_fp8_channel.linear_fp8_channel_triton(*args)
    assert out.dtype == dtype and out.shape == (t, 72)
    lin = "linear-fp8-mma" if KERNEL_DEVICE == "cuda" else "linear"
    torch.testing.assert_close(out.cpu(), linear_fp8_channel.ref_linear_fp8_channel(
        *on_cpu(args)), **tol(lin, dtype))


def test_linear_reference_is_the_decoded_gemm_and_leading_dims_pass_through():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=g) * 0.1
    q, s = _channel(w)
    x = torch.randn(2, 3, 96, generator=g)
    xq, xs = quantize_fp8_per_token(x)
    want = (xq.float() * xs[..., None]) @ (q.float() * s[:, None]).t()
    got = torch.ops.beam.linear_fp8_channel(x.to(KERNEL_DEVICE), q.to(KERNEL_DEVICE),
                                            s.to(KERNEL_DEVICE))
    assert got.shape == (2, 3, 40)
    lin = "linear-fp8-mma" if KERNEL_DEVICE == "cuda" else "linear"  # Hopper's FP8 MMA
    torch.testing.assert_close(got.cpu(), want, **tol(lin, torch.float32))
    assert torch.ops.beam.linear_fp8_channel(x.to("meta"), q.to("meta"), s.to("meta")).shape \
        == (2, 3, 40)


def test_linear_refuses_a_per_tensor_or_wrong_scale():
    q, s = _channel(torch.randn(16, 32))
    for bad in (s[:1].reshape(()), s[:8], s.to(torch.bfloat16)):
        with pytest.raises(PluginError, match="weight_scale"):
            linear_fp8_channel.ref_linear_fp8_channel(torch.randn(2, 32), q, bad)


def _moe_case(dtype, t, seed, experts=None, h=80, inner=48):
    gate, up, down = dense_experts(E, h, inner, seed=seed)
    w13, s13, w2, s2 = [], [], [], []
    for e in range(E):
        (qg, sg), (qu, su), (qd, sd) = (_channel(m[e]) for m in (gate, up, down))
        w13.append(torch.cat([qg, qu]))
        s13.append(torch.cat([sg, su]))
        w2.append(qd)
        s2.append(sd)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).to(dtype)
    ids, w = random_routing(t, E, K, seed=seed, experts=experts)
    args = (x, ids, w, torch.stack(w13), torch.stack(s13), torch.stack(w2), torch.stack(s2))
    return tuple(a.contiguous().to(KERNEL_DEVICE) for a in args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,direct", [(1, True), (3, True), (17, False)])
def test_moe_matches_reference(dtype, t, direct):
    args = _moe_case(dtype, t, seed=t, experts=6)  # experts 6 and 7 get no tokens
    out = moe_fp8_channel.moe_fp8_channel_triton(*args, direct=direct, scale=ROUTED_SCALE)
    assert out.dtype == dtype and out.shape == args[0].shape
    want = moe_fp8_channel.ref_moe_fp8_channel(*on_cpu(args), scale=ROUTED_SCALE)
    torch.testing.assert_close(out.cpu(), want, **_moe_tol(dtype))


@pytest.mark.parametrize("t,direct", [(3, True), (17, False)])
def test_moe_per_slot_outputs_are_what_the_combine_adds(t, direct):
    args = _moe_case(torch.bfloat16, t, seed=t + 40, experts=6, h=136, inner=40)
    slots = moe_fp8_channel.moe_fp8_channel_triton(*args, direct=direct, per_slot=True)
    assert slots.shape == (t, K, 136)
    torch.testing.assert_close(slots.cpu(), moe_fp8_channel.ref_moe_fp8_channel(
        *on_cpu(args), per_slot=True), **_moe_tol(torch.bfloat16))
    combined = _moe_common.combine(slots.reshape(t * K, -1), args[2], t, ROUTED_SCALE)
    assert torch.equal(combined, moe_fp8_channel.moe_fp8_channel_triton(
        *args, direct=direct, scale=ROUTED_SCALE))
    meta = torch.ops.beam.moe_fp8_channel(*(a.to("meta") for a in args), per_slot=True)
    assert meta.shape == slots.shape


def test_moe_all_tokens_on_one_expert_through_the_op():
    t = 19  # 76 pairs: the op takes the sorted path on its own
    args = list(_moe_case(torch.bfloat16, t, seed=5))
    rest = torch.stack([torch.randperm(E - 1)[: K - 1] + 1 for _ in range(t)])
    args[1] = torch.cat([torch.zeros(t, 1, dtype=torch.int64), rest], 1).to(torch.int32).to(
        KERNEL_DEVICE)
    out = torch.ops.beam.moe_fp8_channel(*args, scale=ROUTED_SCALE)
    torch.testing.assert_close(out.cpu(), moe_fp8_channel.ref_moe_fp8_channel(
        *on_cpu(args), scale=ROUTED_SCALE), **_moe_tol(torch.bfloat16))


def test_moe_refuses_a_per_tensor_scale():
    x, ids, w, w13, s13, w2, s2 = _moe_case(torch.float32, 2, seed=9)
    with pytest.raises(PluginError, match="w2_scale"):
        moe_fp8_channel.ref_moe_fp8_channel(x.cpu(), ids.cpu(), w.cpu(), w13.cpu(), s13.cpu(),
                                            w2.cpu(), s2[:, :1].cpu())
