"""The Triton linear_* kernels (interpreter on the CPU) against their ref_ functions: a few
tokens and many (two tile rows, the last partial), K not a multiple of the tile, N not a
multiple of the tile, per-tensor and per-row FP8 weight scales, FP32 and BF16."""

import pytest
import torch

import plugins  # noqa: F401
from _linear_testdata import linear_args
from beam_trtllm.quant_formats import quantize_fp8_activation
from conftest import tol
from kernel_cases import KERNEL_DEVICE, on_cpu
from plugins import linear_fp8, linear_fp8_block, linear_nvfp4
from plugins._common import sum_partials

pytestmark = pytest.mark.kernel


def _tol(fmt, dtype):
    # on a GPU, Hopper's FP8 MMA adds each 128-deep step with reduced precision
    gpu_fp8 = KERNEL_DEVICE == "cuda" and fmt.startswith("fp8")
    return tol("linear-fp8-mma" if gpu_fp8 else "linear", dtype)


KERNELS = {"fp8": (linear_fp8.linear_fp8_triton, linear_fp8.ref_linear_fp8),
           "fp8_block": (linear_fp8_block.linear_fp8_block_triton,
                         linear_fp8_block.ref_linear_fp8_block),
           "nvfp4": (linear_nvfp4.linear_nvfp4_triton, linear_nvfp4.ref_linear_nvfp4)}


@pytest.mark.parametrize("fmt", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [3, 131])
def test_kernel_matches_reference(fmt, dtype, t):
    x = torch.randn(t, 208, generator=torch.Generator().manual_seed(t)).to(dtype)
    args = tuple(a.to(KERNEL_DEVICE) for a in linear_args(fmt, x, n=72, seed=t))
    kernel, ref = KERNELS[fmt]
    out = kernel(*args)
    assert out.dtype == dtype and out.shape == (t, 72)
    torch.testing.assert_close(out.cpu(), ref(*on_cpu(args)), **_tol(fmt, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 131])
def test_nvfp4_whole_k_tiles(dtype, t):
    """K a multiple of every K tile: the unmasked K loop (and on a GPU in BF16 at few tokens,
    the code-pair decode into the MMA's registers)."""
    x = torch.randn(t, 256, generator=torch.Generator().manual_seed(t)).to(dtype)
    args = tuple(a.to(KERNEL_DEVICE) for a in linear_args("nvfp4", x, n=72, seed=t))
    out = linear_nvfp4.linear_nvfp4_triton(*args)
    torch.testing.assert_close(out.cpu(), linear_nvfp4.ref_linear_nvfp4(*on_cpu(args)),
                               **_tol("nvfp4", dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n", [128, 64])
def test_fp8_block_tma_prefill_bits(dtype, block_n):
    """linear_fp8_block's TMA prefill gives the per-thread kernel's bits: 131 tokens (a
    partial second tile row), K = 336 (a partial 128-deep group), N = 200 (a partial second
    scale block; with 64-row tiles two tiles a block). Few tokens cannot take it."""
    from plugins._moe_common import GemmConfig
    x = torch.randn(131, 336, generator=torch.Generator().manual_seed(5)).to(dtype)
    args = tuple(a.to(KERNEL_DEVICE) for a in linear_args("fp8_block", x, n=200, seed=5))
    cfg = GemmConfig(64, block_n, 128, 4, 2)
    out = linear_fp8_block.linear_fp8_block_triton(*args, config=cfg, tma=True)
    torch.testing.assert_close(out.cpu(), linear_fp8_block.ref_linear_fp8_block(*on_cpu(args)),
                               **_tol("fp8_block", dtype))
    assert torch.equal(out, linear_fp8_block.linear_fp8_block_triton(*args, config=cfg, tma=False))
    with pytest.raises(Exception, match="more than 64 tokens"):
        linear_fp8_block.linear_fp8_block_triton(args[0][:3], *args[1:], tma=True)


@pytest.mark.parametrize("k,split", [(400, 2), (208, 3), (1024, 4)])
@pytest.mark.parametrize("t", [1, 5])
def test_fp8_split_k_partials(k, split, t):
    """split_k: each split's FP32 partial over its 128-aligned channel range as the
    reference's (K not a multiple of the splits; with (208, 3) the last split lies past K and
    is all zeros); in order they add up to the unsplit GEMM's output."""
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(k + t)).to(torch.bfloat16)
    args = tuple(a.to(KERNEL_DEVICE) for a in linear_args("fp8", x, n=72, seed=k, per_row=True))
    parts = linear_fp8.linear_fp8_triton(*args, split_k=split)
    assert parts.shape == (split, t, 72) and parts.dtype == torch.float32
    want = linear_fp8.ref_linear_fp8(*on_cpu(args), split_k=split)
    torch.testing.assert_close(parts.cpu(), want, **_tol("fp8", torch.float32))
    whole = linear_fp8.ref_linear_fp8(x.float(), *on_cpu(args[1:]))  # x's codes, FP32 out
    torch.testing.assert_close(sum_partials(parts.cpu(), torch.float32), whole,
                               **_tol("fp8", torch.float32))


def test_fp8_per_row_scale_and_leading_dims_through_the_op():
    x = torch.randn(2, 5, 208).to(torch.bfloat16)
    args = tuple(a.to(KERNEL_DEVICE) for a in linear_args("fp8", x, n=40, seed=3, per_row=True))
    out = torch.ops.beam.linear_fp8(*args)  # TRITON_INTERPRET=1: the Triton GEMM
    assert out.shape == (2, 5, 40)
    torch.testing.assert_close(out.cpu(), linear_fp8.ref_linear_fp8(*on_cpu(args)),
                               **_tol("fp8", torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 19])
def test_fp8_codes_input_is_the_same_gemm(dtype, t):
    """x given as its FP8 codes (what the norms / attention write) + out_dtype: the same GEMM
    on the same codes as x given in `dtype`, bit for bit, and the reference's result."""
    x = torch.randn(t, 208, generator=torch.Generator().manual_seed(t)).to(dtype)
    x, w, s, xs = (a.to(KERNEL_DEVICE) for a in linear_args("fp8", x, n=72, seed=t, per_row=True))
    codes = quantize_fp8_activation(x, xs)
    out = linear_fp8.linear_fp8_triton(codes, w, s, xs, dtype)
    assert out.dtype == dtype and torch.equal(out, linear_fp8.linear_fp8_triton(x, w, s, xs))
    want = linear_fp8.ref_linear_fp8(*on_cpu((codes, w, s, xs)), dtype)
    torch.testing.assert_close(out.cpu(), want, **_tol("fp8", dtype))
