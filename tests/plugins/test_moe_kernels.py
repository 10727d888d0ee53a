"""The Triton moe_* kernels (in Triton's interpreter on the CPU) against their ref_ functions:
odd token counts, experts with no tokens, every token on one expert, K not a multiple of the
tile, I not a multiple of 128 (block FP8), FP32 and BF16, both routing paths (direct pairs for
decode, sorted blocks for prefill), and the token sort checked exactly. On a GPU machine they
run there instead (KERNEL_DEVICE)."""

import pytest
import torch

import plugins  # noqa: F401
from _moe_testdata import activation_scales, dense_experts, moe_args, pack_experts, random_routing
from beam_trtllm.quant_formats import quantize_fp8_activation
from conftest import tol
from kernel_cases import KERNEL_DEVICE, on_cpu
from plugins import _moe_common, moe_bf16, moe_fp8, moe_fp8_block, moe_nvfp4

pytestmark = pytest.mark.kernel

KERNELS = {"bf16": (moe_bf16.moe_bf16_triton, moe_bf16.ref_moe_bf16),
           "fp8": (moe_fp8.moe_fp8_triton, moe_fp8.ref_moe_fp8),
           "fp8_block": (moe_fp8_block.moe_fp8_block_triton, moe_fp8_block.ref_moe_fp8_block),
           "nvfp4": (moe_nvfp4.moe_nvfp4_triton, moe_nvfp4.ref_moe_nvfp4)}
# Block FP8 gets two 128-groups with a partial last one in both GEMMs (H=200, I=144); the
# others a K that is not a multiple of any tile (H=80 < BLOCK_K, I=48).
SHAPES = {"bf16": (80, 48), "fp8": (80, 48), "fp8_block": (200, 144), "nvfp4": (80, 48)}
E, K = 8, 4


def _tolerance(fmt, dtype):
    if fmt.startswith("fp8"):  # on a GPU also Hopper's reduced-precision FP8 MMA
        return tol("moe-fp8-mma" if KERNEL_DEVICE == "cuda" else "moe-fp8", dtype)
    return tol("moe", dtype)


def _case(fmt, dtype, t, seed, experts=None, ids=None, shape=None):
    h, inner = shape or SHAPES[fmt]
    gate, up, down = dense_experts(E, h, inner, seed=seed)
    packed = pack_experts(fmt, gate, up, down)
    if fmt == "bf16":
        packed = {k: v.to(dtype) for k, v in packed.items()}
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).to(dtype)
    rid, w = random_routing(t, E, K, seed=seed, experts=experts)
    args = moe_args(fmt, x, rid if ids is None else ids, w, packed, activation_scales(x, 3.0))
    return tuple(a.to(KERNEL_DEVICE) for a in args)


@pytest.mark.parametrize("fmt", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,direct", [(3, True), (17, False)])
def test_kernel_matches_reference(fmt, dtype, t, direct):
    # experts 6 and 7 get no tokens
    args = _case(fmt, dtype, t, seed=t, experts=6)
    kernel, ref = KERNELS[fmt]
    out = kernel(*args, direct=direct)
    assert out.dtype == dtype and out.shape == args[0].shape
    torch.testing.assert_close(out.cpu(), ref(*on_cpu(args)), **_tolerance(fmt, dtype))


@pytest.mark.parametrize("fmt", sorted(KERNELS))
def test_all_tokens_on_one_expert_through_the_op(fmt):
    t = 19  # 76 pairs: the op takes the sorted path on its own
    ids = torch.stack([torch.randperm(E - 1)[: K - 1] + 1 for _ in range(t)])
    ids = torch.cat([torch.zeros(t, 1, dtype=torch.int64), ids], 1).to(torch.int32)
    args = _case(fmt, torch.bfloat16, t, seed=5, ids=ids)
    out = getattr(torch.ops.beam, f"moe_{fmt}")(*args)  # TRITON_INTERPRET=1: the Triton kernel
    torch.testing.assert_close(out.cpu(), KERNELS[fmt][1](*on_cpu(args)),
                               **_tolerance(fmt, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,direct", [(3, True), (17, False)])
def test_fp8_codes_input_is_the_same_moe(dtype, t, direct):
    """moe_fp8 given x's FP8 codes (what add_rmsnorm_fp8 writes with a13_scale) + out_dtype:
    the same kernels on the same codes as x given in `dtype`, bit for bit, and the reference
    on the codes equals the reference on x."""
    x, *rest = _case("fp8", dtype, t, seed=t + 1, experts=6)
    codes = quantize_fp8_activation(x, rest[6])  # rest[6]: a13_scale
    out = moe_fp8.moe_fp8_triton(codes, *rest, out_dtype=dtype, direct=direct)
    assert out.dtype == dtype and torch.equal(out, moe_fp8.moe_fp8_triton(x, *rest, direct=direct))
    want = moe_fp8.ref_moe_fp8(*on_cpu((codes, *rest)), out_dtype=dtype)
    assert torch.equal(want, moe_fp8.ref_moe_fp8(*on_cpu((x, *rest))))
    torch.testing.assert_close(out.cpu(), want, **_tolerance("fp8", dtype))
    with pytest.raises(Exception, match="out_dtype"):
        moe_fp8.moe_fp8_triton(codes, *rest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,direct", [(3, True), (17, False)])
def test_nvfp4_whole_k_tiles(dtype, t, direct):
    """H and I multiples of the 128-deep K tile: the unmasked K loop (scales in the pipelined
    copies) and, on a GPU in BF16, the per-byte decode into the MMA's registers."""
    args = _case("nvfp4", dtype, t, seed=t + 2, experts=6, shape=(256, 128))
    out = moe_nvfp4.moe_nvfp4_triton(*args, direct=direct)
    torch.testing.assert_close(out.cpu(), moe_nvfp4.ref_moe_nvfp4(*on_cpu(args)),
                               **_tolerance("nvfp4", dtype))


def test_single_token_and_empty_batch():
    args = _case("nvfp4", torch.bfloat16, 1, seed=9)
    kernel, ref = KERNELS["nvfp4"]
    torch.testing.assert_close(kernel(*args).cpu(), ref(*on_cpu(args)),
                               **_tolerance("nvfp4", torch.bfloat16))
    empty = [a[:0] if i < 3 else a for i, a in enumerate(args)]
    assert kernel(*empty).shape == (0, args[0].shape[1])


@pytest.mark.parametrize("t,experts,one_program", [(1, None, 4096), (37, 5, 4096), (40, 1, 4096),
                                                  (37, 5, 16), (300, None, 64)])
def test_align_places_every_pair_exactly_once(t, experts, one_program, monkeypatch):
    # one_program < T*k takes the many-program path (count, then scatter) used for prefill
    monkeypatch.setattr(_moe_common, "ONE_PROGRAM_ALIGN", one_program)
    k, block_m = (1, 16) if experts == 1 else (K, 16)
    ids, _ = random_routing(t, E, k, seed=t, experts=experts)
    r = _moe_common.plan_routing(ids.to(KERNEL_DEVICE), E, block_m, direct=False)
    r = _moe_common.Routing(r.direct, r.block_m, r.m_blocks, r.rows, r.ids.cpu(),
                            r.sorted_slots.cpu(), r.block_expert.cpu(), r.num_rows.cpu())
    numel = ids.numel()
    assert r.rows == _moe_common.max_sorted_rows(numel, E, block_m)
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(r.num_rows) == int(padded.sum())
    starts = torch.cumsum(padded, 0) - padded
    slots, owners = r.sorted_slots.long(), r.block_expert.long()
    for e in range(E):
        rows = slots[starts[e]: starts[e] + padded[e]]
        want = (ids.flatten() == e).nonzero().flatten()
        assert sorted(rows[rows < numel].tolist()) == want.tolist()
        assert (rows[rows >= numel] == numel).all()  # padding holds the sentinel
        assert (owners[starts[e] // block_m: (starts[e] + padded[e]) // block_m] == e).all()
    assert (slots[int(r.num_rows):] == numel).all()
    assert (owners[int(r.num_rows) // block_m:] == -1).all()
