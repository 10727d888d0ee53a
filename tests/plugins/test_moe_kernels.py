"""The Triton moe_* kernels (in Triton's interpreter on the CPU) against their ref_ functions:
odd token counts, experts with no tokens, every token on one expert, K not a multiple of the
tile, I not a multiple of 128 (block FP8), FP32 and BF16, both routing paths (direct pairs for
decode, sorted blocks for prefill), and the token sort checked exactly. On a GPU machine they
run there instead (KERNEL_DEVICE)."""

import dataclasses

import pytest
import torch

import plugins  # noqa: F401
import triton
import triton.language as tl

from _moe_testdata import (ROUTED_SCALE, activation_scales, dense_experts,
                           ids_with_counts, moe_args, pack_experts, random_routing,
                           sync_counters_all_zero)
from beam_trtllm.quant_formats import quantize_fp8_activation
from conftest import tol
from kernel_cases import KERNEL_DEVICE, on_cpu
from plugins import _fp8_act, _moe_common, moe_bf16, moe_fp8, moe_fp8_block, moe_nvfp4
from plugins._gemm import silu_mul
from plugins._reference import swiglu

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
    # experts 6 and 7 get no tokens; the routed scale on the summed output
    args = _case(fmt, dtype, t, seed=t, experts=6)
    kernel, ref = KERNELS[fmt]
    out = kernel(*args, direct=direct, scale=ROUTED_SCALE)
    assert out.dtype == dtype and out.shape == args[0].shape
    torch.testing.assert_close(out.cpu(), ref(*on_cpu(args), scale=ROUTED_SCALE),
                               **_tolerance(fmt, dtype))


@pytest.mark.parametrize("fmt", sorted(KERNELS))
@pytest.mark.parametrize("t,direct", [(3, True), (17, False)])
def test_per_slot_outputs_are_what_the_combine_adds(fmt, t, direct):
    """per_slot=True: each (token, slot)'s unweighted expert output [T, k, H] as the
    reference's, unscaled; the combine of those outputs (the FP32 weighted sum times the
    routed scale, rounded once) is bit for bit the op's combined output; the op's meta shape
    follows."""
    args = _case(fmt, torch.bfloat16, t, seed=t + 40, experts=6)
    kernel, ref = KERNELS[fmt]
    slots = kernel(*args, direct=direct, per_slot=True, scale=ROUTED_SCALE)
    assert slots.shape == (t, K, args[0].shape[1]) and slots.dtype == torch.bfloat16
    torch.testing.assert_close(slots.cpu(), ref(*on_cpu(args), per_slot=True),
                               **_tolerance(fmt, torch.bfloat16))
    combined = _moe_common.combine(slots.reshape(t * K, -1), args[2], t, ROUTED_SCALE)
    assert torch.equal(combined, kernel(*args, direct=direct, scale=ROUTED_SCALE))
    want = (sum(slots[:, j].float().cpu() * args[2][:, j:j + 1].cpu() for j in range(K))
            * ROUTED_SCALE).to(torch.bfloat16)
    if KERNEL_DEVICE == "cpu":
        assert torch.equal(combined.cpu(), want)
    else:  # compiled, the combine's multiply-adds are fused (FMA: one rounding less each)
        torch.testing.assert_close(combined.cpu(), want, **tol("bf16-1ulp", torch.bfloat16))
    meta = getattr(torch.ops.beam, f"moe_{fmt}")(*(a.to("meta") for a in args), per_slot=True)
    assert meta.shape == slots.shape


@pytest.mark.parametrize("fmt", sorted(KERNELS))
def test_all_tokens_on_one_expert_through_the_op(fmt):
    t = 19  # 76 pairs: the op takes the sorted path on its own
    ids = torch.stack([torch.randperm(E - 1)[: K - 1] + 1 for _ in range(t)])
    ids = torch.cat([torch.zeros(t, 1, dtype=torch.int64), ids], 1).to(torch.int32)
    args = _case(fmt, torch.bfloat16, t, seed=5, ids=ids)
    op = getattr(torch.ops.beam, f"moe_{fmt}")  # TRITON_INTERPRET=1: the Triton kernel
    out = op(*args, scale=ROUTED_SCALE)
    torch.testing.assert_close(out.cpu(), KERNELS[fmt][1](*on_cpu(args), scale=ROUTED_SCALE),
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
@pytest.mark.parametrize("inner", [128, 48])
def test_nvfp4_whole_k_tiles(dtype, t, direct, inner):
    """H (and I = 128) multiples of the 128-deep K tile: the unmasked K loop (scales in the
    pipelined copies; I = 48: gate/up's second 32-row weight block half empty), and on a GPU in
    BF16 the code-pair decode into the MMA's registers."""
    args = _case("nvfp4", dtype, t, seed=t + 2, experts=6, shape=(256, inner))
    out = moe_nvfp4.moe_nvfp4_triton(*args, direct=direct)
    torch.testing.assert_close(out.cpu(), moe_nvfp4.ref_moe_nvfp4(*on_cpu(args)),
                               **_tolerance("nvfp4", dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("direct", [True, False])
def test_nvfp4_tma_loads_match_per_thread_copies(dtype, direct):
    """Decode launch shapes over whole K tiles load the weight words (and over 256-deep tiles
    the block scales too) by the TMA, direct pairs' activations as one row; the per-thread
    copies give the same bits. H = 256: gate/up on DECODE_TMA (words and scales), I = 128:
    down on DECODE (words only); 3 tokens, 12 pairs, direct or sorted."""
    args = _case("nvfp4", dtype, 3, seed=21, experts=6, shape=(256, 128))
    c13, c2 = moe_nvfp4.launch_configs(1, E, k13=256, k2=128, tma=True)
    assert (c13, c2) == (moe_nvfp4.DECODE_TMA, moe_nvfp4.DECODE)
    assert moe_nvfp4.launch_configs(12, E, k13=256, k2=128, tma=True)[0] == \
        moe_nvfp4.DECODE_TMA_SORTED  # sorted blocks: 32-row tiles
    assert moe_nvfp4.launch_configs(1, E, k13=256, k2=128, tma=False)[0] == moe_nvfp4.DECODE
    assert moe_nvfp4.takes_tma(args[0], 256, c13, args[3], args[4]) == (True, True)
    assert moe_nvfp4.takes_tma(args[0], 128, c2, args[6], args[7]) == (True, False)
    assert moe_nvfp4.takes_tma(args[0], 80, c2, args[6], args[7]) == (False, False)  # K tail
    assert moe_nvfp4.takes_tma(args[0], 128, dataclasses.replace(c2, swap=False), args[6],
                               args[7]) == (False, False)  # weights on the B side (prefill)
    out = moe_nvfp4.moe_nvfp4_triton(*args, direct=direct, config13=c13, config2=c2)
    torch.testing.assert_close(out.cpu(), moe_nvfp4.ref_moe_nvfp4(*on_cpu(args)),
                               **_tolerance("nvfp4", dtype))
    copies = moe_nvfp4.moe_nvfp4_triton(*args, direct=direct, config13=c13, config2=c2,
                                        tma=False)
    assert torch.equal(out, copies)


def _pairs_position(k: torch.Tensor) -> torch.Tensor:
    """plugins._tiles.pairs_position restated: k = 8w + c + 4j goes to d = 8w + 2c + j, then
    d's bits within its 64-chunk (h, t, r1, r0, e) to (r1, t, r0, h, e)."""
    d = (k & ~7) | ((k & 3) << 1) | ((k >> 2) & 1)
    return ((d & ~63) | (((d >> 2) & 1) << 5) | (d & 24) | (((d >> 1) & 1) << 2)
            | (((d >> 5) & 1) << 1) | (d & 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("direct", [True, False])
def test_nvfp4_h_in_the_code_pairs_order(dtype, direct):
    """With a code-pair down GEMM and I a multiple of 64, gate/up stores h at pairs_position
    (a permutation within 64-column chunks): the same bits as h in order, moved; the op's
    output (down taking h so) matches the reference. I = 48 keeps h in order."""
    inner = 128
    args = _case("nvfp4", dtype, 3, seed=31, experts=6, shape=(256, inner))
    x, ids = args[0], args[1]
    c13, c2 = moe_nvfp4.launch_configs(1 if direct else 12, E, k13=256, k2=inner, tma=True)
    assert moe_nvfp4.takes_pairs_order(c2, inner) and not moe_nvfp4.takes_pairs_order(c2, 48)
    assert not moe_nvfp4.takes_pairs_order(dataclasses.replace(c2, block_m=16), inner)
    routing = _moe_common.plan_routing(ids, E, c13.block_m, direct)

    def h_of(pairs_order):
        h = torch.full((routing.rows, inner), float("nan"), dtype=dtype, device=x.device)
        moe_nvfp4._gemm(x, *args[3:6], h, routing, ids.numel(), K, inner, 256, True, c13, True,
                        pairs_order)
        return h

    pos = _pairs_position(torch.arange(inner))
    assert torch.equal(pos.sort().values, torch.arange(inner))
    plain, ordered = h_of(False), h_of(True)
    used = plain[:, 0] == plain[:, 0]  # rows the sort filled (padding rows stay NaN in both)
    assert torch.equal(ordered[used][:, pos.to(x.device)], plain[used])
    out = moe_nvfp4.moe_nvfp4_triton(*args, direct=direct, config13=c13, config2=c2)
    torch.testing.assert_close(out.cpu(), moe_nvfp4.ref_moe_nvfp4(*on_cpu(args)),
                               **_tolerance("nvfp4", dtype))


def test_nvfp4_down_gemm_combines_direct_pairs():
    """Direct pairs: the down GEMM's last program of each (token, column tile) combines the
    token's slots (no combine launch), bit for bit what the combine kernel makes of the
    per-slot outputs, with the routed scale (and without: 1.0); again at another top_k and
    token count, and every ticket counter is back at zero after each call."""
    for t, top_k, seed, scale in ((3, K, 51, ROUTED_SCALE), (5, 2, 52, 1.0),
                                  (1, K, 53, ROUTED_SCALE)):
        x, _, _, *weights = _case("nvfp4", torch.bfloat16, t, seed=seed)
        ids, w = random_routing(t, E, top_k, seed=seed)
        args = (x, ids.to(x.device), w.to(x.device), *weights)
        slots = moe_nvfp4.moe_nvfp4_triton(*args, direct=True, per_slot=True)
        fused = moe_nvfp4.moe_nvfp4_triton(*args, direct=True, scale=scale)
        assert torch.equal(fused, _moe_common.combine(slots.reshape(t * top_k, -1), args[2], t,
                                                      scale))
        assert sync_counters_all_zero()


def test_nvfp4_overlapped_gemms_match_the_serial_ones():
    """Direct pairs run the two GEMMs overlapped (the down GEMM launched early, each of its
    programs waiting for its own pair's h tiles): the same bits as the down GEMM after all of
    gate/up, per slot and combined, call after call on a GPU (where they really run at once),
    and every pair counter back at zero."""
    for fmt, t, top_k, seed in (("nvfp4", 3, K, 61), ("nvfp4", 2, 3, 62), ("fp8", 3, K, 63)):
        x, _, _, *weights = _case(fmt, torch.bfloat16, t, seed=seed)
        ids, w = random_routing(t, E, top_k, seed=seed)
        args = (x, ids.to(x.device), w.to(x.device), *weights)
        kernel = moe_nvfp4.moe_nvfp4_triton if fmt == "nvfp4" else moe_fp8.moe_fp8_triton
        for per_slot in (True, False):
            serial = kernel(*args, direct=True, per_slot=per_slot, overlap=False)
            for _ in range(20 if x.is_cuda else 1):
                assert torch.equal(kernel(*args, direct=True, per_slot=per_slot), serial)
        assert sync_counters_all_zero()


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    gate = tl.load(g_ptr + i, mask=i < N)
    up = tl.load(u_ptr + i, mask=i < N)
    tl.store(out_ptr + i, silu_mul(gate, up, out_ptr.dtype.element_ty), mask=i < N)


def test_swiglu_kernel_rounds_gate_and_up_then_once():
    """The MoE kernels' SwiGLU (`_gemm.silu_mul`) on FP32 GEMM accumulators: gate and up rounded
    to BF16, silu and the product in FP32, one rounding (`_reference.swiglu`, transformers'):
    equal but for the FP32 exp's last ULPs (a rare one-ULP flip), where rounding silu to BF16
    first (v1) moves many elements."""
    gen = torch.Generator().manual_seed(6)
    n = 1 << 14
    gate, up = (torch.randn(2, n, generator=gen) * 3).unbind()
    out = torch.empty(n, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate.to(KERNEL_DEVICE), up.to(KERNEL_DEVICE), out,
                                              n, BLOCK=1024)
    got = out.cpu()
    g16, u16 = gate.to(torch.bfloat16), up.to(torch.bfloat16)
    want = swiglu(g16, u16)
    torch.testing.assert_close(got, want, **tol("bf16-1ulp", torch.bfloat16))
    twice = torch.nn.functional.silu(g16) * u16  # silu rounded to BF16, then the product
    flips, moved = int((got != want).sum()), int((twice != want).sum())
    assert moved > n // 20 and flips * 100 < moved, (flips, moved)


def test_single_token_and_empty_batch():
    args = _case("nvfp4", torch.bfloat16, 1, seed=9)
    kernel, ref = KERNELS["nvfp4"]
    torch.testing.assert_close(kernel(*args).cpu(), ref(*on_cpu(args)),
                               **_tolerance("nvfp4", torch.bfloat16))
    empty = [a[:0] if i < 3 else a for i, a in enumerate(args)]
    assert kernel(*empty).shape == (0, args[0].shape[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codes", [False, True])
def test_fp8_tail_blocks(dtype, codes):
    """moe_fp8 on the tail-block layout (prefill's): an expert's last <= 16 rows on a 16-row
    tile with the weights on the MMA's M side, the other blocks on 32-row tiles, both GEMMs.
    Counts: 40 = 32 + 8 (tail), 22 (padded whole), 12 and 16 (tails), 38 = 32 + 6, 5, 27.
    The launcher loads this layout by the TMA (activations gathered into sorted rows); the
    per-thread loads of the other layouts must give the same bits. K = 80 ends in a partial
    64-deep tile (the TMA's zero fill); `codes`: x given as FP8 codes already."""
    ids = ids_with_counts([40, 22, 12, 16, 0, 38, 5, 27], K)
    args = _case("fp8", dtype, ids.shape[0], seed=11, ids=ids)
    if codes:
        args = (quantize_fp8_activation(args[0].cpu(), args[7].cpu()).to(KERNEL_DEVICE),
                *args[1:], dtype)
    gemm = _moe_common.GemmConfig
    c13, c2 = gemm(32, 32, 64, 4, 2, tail_m=16), gemm(32, 32, 64, 4, 2, tail_m=16)
    routing = _moe_common.plan_routing(args[1], E, 32, False, 16)
    assert moe_fp8.takes_tma(args[0], routing, (c13, c2), args[0], args[3], args[5])
    wide = _moe_common.GemmConfig(32, 32, 512, 4, 2, tail_m=16)  # K tile past one TMA copy
    assert not moe_fp8.takes_tma(args[0], routing, (c13, wide), args[0], args[3], args[5])
    out = moe_fp8.moe_fp8_triton(*args, direct=False, config13=c13, config2=c2)
    torch.testing.assert_close(out.cpu(), moe_fp8.ref_moe_fp8(*on_cpu(args)),
                               **_tolerance("fp8", dtype))
    per_thread = moe_fp8.moe_fp8_triton(*args, direct=False, config13=c13, config2=c2, tma=False)
    assert torch.equal(out, per_thread)


def test_fp8_sorted_row_quantizer_writes_each_token_to_its_rows():
    """Token t's codes land in rows slot_rows[t*k + j] (the same bits as
    quant_fp8_per_tensor), for floating x and for x given as codes; 333 channels: a partial
    column tile; rows no slot maps to are not written."""
    t, h, k, rows = 29, 333, 3, 100
    x = (torch.randn(t, h, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    scale = torch.tensor(0.02)
    slot_rows = torch.randperm(rows, generator=torch.Generator().manual_seed(3))[:t * k]
    dev = [v.to(KERNEL_DEVICE) for v in (x, scale, slot_rows.int())]
    codes = _fp8_act.quant_fp8_per_tensor(dev[0], dev[1]).cpu().view(torch.uint8)
    for given in (dev[0], codes.view(torch.float8_e4m3fn).to(KERNEL_DEVICE)):
        got = _fp8_act.quant_fp8_sorted_rows(given, dev[1], dev[2], rows).cpu().view(torch.uint8)
        assert got.shape == (rows, h)
        assert torch.equal(got[slot_rows], codes.repeat_interleave(k, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("swap", [False, True])
def test_fp8_block_tma_prefill(dtype, swap):
    """moe_fp8_block's TMA prefill (sorted-row activations, tail blocks, one weight scale per
    128x128 block a step) gives the reference's values, and the per-thread kernel's within
    the same tolerance; gate/up with the tokens or the weights on the MMA's M side. (Not bit
    for bit, in the interpreter either: numpy sums a tile's FP32 products in an order its
    BLAS picks by tile shape and instruction set; on an AVX2-only box, 2026-12-04, the two
    tile shapes parted in the last bits.)
    H = 144: gate/up's K ends in a 16-deep partial scale group and down's second 128-row tile
    is partial; I = 128. Counts as test_fp8_tail_blocks (16-row tails, 32-row blocks)."""
    ids = ids_with_counts([40, 22, 12, 16, 0, 38, 5, 27], K)
    args = _case("fp8_block", dtype, ids.shape[0], seed=12, ids=ids, shape=(144, 128))
    gemm = _moe_common.GemmConfig
    c13, c2 = gemm(32, 128, 128, 4, 2, swap=swap, tail_m=16), gemm(32, 128, 128, 4, 2, tail_m=16)
    out = moe_fp8_block.moe_fp8_block_triton(*args, tma=True, config13=c13, config2=c2)
    torch.testing.assert_close(out.cpu(), moe_fp8_block.ref_moe_fp8_block(*on_cpu(args)),
                               **_tolerance("fp8_block", dtype))
    per_thread = moe_fp8_block.moe_fp8_block_triton(*args, direct=False, tma=False)
    torch.testing.assert_close(out.cpu(), per_thread.cpu(), **_tolerance("fp8_block", dtype))
    uneven = _case("fp8_block", dtype, 17, seed=4)  # I = 144: scale blocks cross the tiles
    with pytest.raises(Exception, match="I % 128 == 0"):
        moe_fp8_block.moe_fp8_block_triton(*uneven, tma=True)


def test_fp8_block_sorted_row_quantizer():
    """Token t's per-128-channel codes land in rows slot_rows[t*k + j] and its scales in
    column slot_rows[t*k + j] of the group-major scales, the bits of
    quant_fp8_per_token_block; 333 channels: a partial last group."""
    t, h, k, rows = 29, 333, 3, 100
    x = (torch.randn(t, h, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    slot_rows = torch.randperm(rows, generator=torch.Generator().manual_seed(3))[:t * k]
    dev_x, dev_rows = x.to(KERNEL_DEVICE), slot_rows.int().to(KERNEL_DEVICE)
    codes, scales = (v.cpu() for v in _fp8_act.quant_fp8_per_token_block(dev_x))
    got, got_s = (v.cpu() for v in _fp8_act.quant_fp8_block_sorted_rows(dev_x, dev_rows, rows))
    assert got.shape == (rows, h) and got_s.shape == (3, rows)
    assert torch.equal(got.view(torch.uint8)[slot_rows],
                       codes.view(torch.uint8).repeat_interleave(k, 0))
    assert torch.equal(got_s[:, slot_rows], scales.repeat_interleave(k, 0).T)


@pytest.mark.parametrize("fmt,c13,c2,reason", [
    ("nvfp4", (64, 32, 64, 4, 2, 16), (64, 32, 64, 4, 2, 16), "no tail blocks"),
    ("fp8", (64, 32, 64, 4, 2, 16), (64, 32, 64, 4, 2, 0), "tail_m 16 != 0"),
    ("fp8", (64, 32, 64, 4, 2, 24), (64, 32, 64, 4, 2, 24), "power of two from 16"),
    ("fp8", (32, 32, 64, 4, 2, 32), (32, 32, 64, 4, 2, 32), "below block_m=32"),
])
def test_tail_block_configs_are_checked(fmt, c13, c2, reason):
    args = _case(fmt, torch.bfloat16, 17, seed=4)
    gemm = lambda *c: _moe_common.GemmConfig(*c[:5], tail_m=c[5])  # noqa: E731
    with pytest.raises(Exception, match=reason):
        KERNELS[fmt][0](*args, direct=False, config13=gemm(*c13), config2=gemm(*c2))


def test_nvfp4_open_gemm_shares_the_token_sort():
    """One GEMM's shape given, the other left to DECODE: DECODE takes the given block_m, so
    both GEMMs read the one token sort (sorted path, checked against the reference)."""
    args = _case("nvfp4", torch.bfloat16, 3, seed=4)  # 12 pairs, sorted below: swap defaults
    given = _moe_common.GemmConfig(16, 32, 128, 2, 3, swap=True)
    following = dataclasses.replace(moe_nvfp4.DECODE, block_m=16)
    assert moe_nvfp4.launch_configs(1, E, given, None) == (given, following)
    assert moe_nvfp4.launch_configs(1, E, None, given) == (following, given)
    assert moe_nvfp4.launch_configs(1, E) == (moe_nvfp4.DECODE, moe_nvfp4.DECODE)
    out = moe_nvfp4.moe_nvfp4_triton(*args, direct=False, config13=given)
    torch.testing.assert_close(out.cpu(), moe_nvfp4.ref_moe_nvfp4(*on_cpu(args)),
                               **_tolerance("nvfp4", torch.bfloat16))
