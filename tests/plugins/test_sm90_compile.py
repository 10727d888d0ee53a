"""The attention-side kernels, and the FP8 GEMMs of a decode step, compile for the H200 (sm_90)
at Beam-1.0 shapes, without spilling registers, with their K/V loads software-pipelined
(cp.async) and the prefill's matrix products on Hopper's warpgroup MMA. Also the variants that
fuse a decode step's FP8 quantizers into their producers (norms with FP8 codes, attention
writing o_proj's FP8 input) and qk_prep's element-wise output gate. No GPU needed: see
sm90.py."""

from __future__ import annotations

import re

import pytest
import torch

import plugins  # noqa: F401
from plugins import _pdl
from beam_trtllm.config import PRESETS
from kernel_cases import Seq, attention_case
from plugins._attention_decode import launch_decode
from plugins.add_rmsnorm import _launch_add_rmsnorm
from plugins.add_rmsnorm_fp8 import _launch_add_rmsnorm_fp8
from plugins.attention import _launch_attention
from plugins.cache_write import _launch_cache_write
from plugins.group_router import _launch_group_router
from plugins.linear_fp8 import linear_fp8_triton
from plugins.linear_fp8_block import linear_fp8_block_triton
from plugins.linear_nvfp4 import linear_nvfp4_triton
from plugins.moe_fp8 import moe_fp8_triton
from plugins.moe_nvfp4 import moe_nvfp4_triton
from plugins.qk_prep import _launch_qk_prep
from plugins.rmsnorm_fp8 import _launch_rmsnorm_fp8
from sm90 import compile_instead_of_launch, in_loops, resource_usage, spill_bytes, spills_in_loops

BEAM = PRESETS["beam-1.0-501b"]
HQ, HKV, D, H = BEAM.num_attention_heads, BEAM.num_key_value_heads, BEAM.head_dim, BEAM.hidden_size
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _attention(kv_dtype, new, fp8_out=False):
    case = attention_case([Seq(300, new), Seq(70, new, hist=3)], HQ, HKV, D, 0, 64, BF16, kv_dtype)
    _launch_attention(**case, out_scale=torch.ones(()) if fp8_out else None)


def _attention_decode_one_tile():
    """Batch-1 decode whose splits hold one tile each (ONE_TILE), read before the wait in the
    decode chain, with FP8 output codes; and the combine over 16 head dims a program."""
    case = attention_case([Seq(2200, 1)], HQ, HKV, D, 0, 32, BF16, FP8)
    case.pop("cu_seqlens_q")
    capacity = case["cache_index"].shape[1] * 32  # > short_capacity: 128-key tiles
    launch_decode(**case, out_scale=torch.ones(()), config={"splits": -(-capacity // 128)})


def _qk_prep(kv_dtype, full, t=3):
    """qk_prep at Beam's widths: q, k, v and the element-wise gate (Hq·D) from one packed
    projection, a per-head gate bias."""
    one = torch.ones(())
    cache = torch.zeros(2, 64, HKV, D, dtype=kv_dtype)
    _launch_qk_prep(torch.randn(t, BEAM.qkv_gate_size, dtype=BF16), torch.arange(t),
                    torch.ones(D, dtype=BF16), torch.ones(D, dtype=BF16),
                    torch.zeros(HQ, dtype=BF16), cache, cache.clone(), torch.arange(t), one, one,
                    full, 1e-6, 1e4)


def _fp8_norms():
    x, w, s = torch.randn(2, H, dtype=BF16), torch.ones(H, dtype=BF16), torch.ones(())
    _launch_rmsnorm_fp8(x, w, s, 1e-6)
    _launch_add_rmsnorm_fp8(x, x, w, w, s, 0.9, 0.4, 1e-6)
    prefill = torch.zeros(1024, H, dtype=BF16)  # add_rmsnorm's chunked kernel
    _launch_add_rmsnorm_fp8(prefill, prefill, w, w, s, 0.9, 0.4, 1e-6)
    _launch_add_rmsnorm(prefill, prefill, w, w, 0.9, 0.4, 1e-6)


def _fp8_gemms_decode():
    """q/k/v/gate and o_proj at M = 1 on FP8 codes (the Triton swap-AB path CUDA takes there; o_proj
    also split in two over K, as the engine runs it), and the MoE GEMMs whose K loop they
    share."""
    one = torch.ones(())
    for n, k in ((BEAM.qkv_gate_size, H), (H, HQ * D)):
        x = torch.zeros(1, k, dtype=FP8)
        linear_fp8_triton(x, torch.zeros(n, k, dtype=FP8), torch.ones(n), one, BF16)
    linear_fp8_triton(x, torch.zeros(n, k, dtype=FP8), torch.ones(n), one, BF16, split_k=2)
    e, inner = 8, BEAM.moe_intermediate_size  # the expert count is no compile-time constant
    moe_fp8_triton(torch.randn(1, H, dtype=BF16), torch.arange(8, dtype=torch.int32)[None],
                   torch.rand(1, 8), torch.zeros(e, 2 * inner, H, dtype=FP8),
                   torch.ones(e, 2 * inner),
                   torch.zeros(e, H, inner, dtype=FP8), torch.ones(e, H), one, one)


def _moe_fp8_prefill():
    """The sorted-rows path at 128 rows per expert (prefill launch shapes: 8-warp swapped
    gate/up, 4-warp down, 64-row tail blocks, every operand loaded by the TMA; 254 registers
    each)."""
    t, e, inner, one = 128, 8, BEAM.moe_intermediate_size, torch.ones(())
    moe_fp8_triton(torch.zeros(t, H, dtype=FP8), torch.arange(8, dtype=torch.int32).repeat(t, 1),
                   torch.rand(t, 8), torch.zeros(e, 2 * inner, H, dtype=FP8),
                   torch.ones(e, 2 * inner), torch.zeros(e, H, inner, dtype=FP8),
                   torch.ones(e, H), one, one, BF16)


def _fp8_block_prefill():
    """linear_fp8_block's TMA GEMM at 128 tokens. (moe_fp8_block's TMA prefill is not here:
    at its measured-fastest shapes both GEMMs spill, 156 and 144 bytes at 255 registers; see
    moe_fp8_block.PREFILL_TMA.)"""
    t = 128
    kb = lambda k: -(-k // 128)  # noqa: E731
    n = BEAM.qkv_gate_size
    linear_fp8_block_triton(torch.randn(t, H, dtype=BF16), torch.zeros(n, H, dtype=FP8),
                            torch.ones(kb(n), kb(H)))


def _nvfp4_decode():
    """The NVFP4 decode GEMMs at Beam shapes (whole 128-deep K tiles, BF16: the code-pair PTX
    decode into the MMA's registers)."""
    e, inner = 8, BEAM.moe_intermediate_size
    one = torch.ones(e)
    scales = lambda rows, k: torch.ones(e, rows, k // 16).to(FP8)  # noqa: E731
    moe_nvfp4_triton(torch.randn(1, H, dtype=BF16), torch.arange(8, dtype=torch.int32)[None],
                     torch.rand(1, 8), torch.zeros(e, 2 * inner, H // 2, dtype=torch.uint8),
                     scales(2 * inner, H), one, torch.zeros(e, H, inner // 2, dtype=torch.uint8),
                     scales(H, inner), one)
    n = BEAM.qkv_gate_size
    linear_nvfp4_triton(torch.randn(1, H, dtype=BF16), torch.zeros(n, H // 2, dtype=torch.uint8),
                        torch.ones(n, H // 16).to(FP8), torch.ones(()))


def _misc():
    x = torch.randn(2, H, dtype=BF16)
    w = torch.ones(H, dtype=BF16)
    _launch_add_rmsnorm(x, x, w, w, 0.9, 0.4, 1e-6)
    cache = torch.zeros(2, 64, HKV, D, dtype=FP8)
    k = torch.randn(3, HKV, D, dtype=BF16)
    _launch_cache_write(k, k, cache, cache.clone(), torch.arange(3), torch.ones(()), torch.ones(()))
    router = (torch.randn(256, H), torch.zeros(256), 8, 4, 8, True)
    _launch_group_router(x[:1], *router)
    _launch_group_router(torch.randn(40, H, dtype=BF16), *router)  # the tiled FP32-dot path


BUILDS = {
    "attention-decode-bf16": lambda: _attention(BF16, 1),
    "attention-decode-fp8": lambda: _attention(FP8, 1),
    "attention-prefill-bf16": lambda: _attention(BF16, 5),
    "attention-prefill-fp8": lambda: _attention(FP8, 5),
    "qk_prep-full-fp8": lambda: _qk_prep(FP8, True),
    "qk_prep-sliding-bf16": lambda: _qk_prep(BF16, False),
    "norm-cache-router": _misc,
    "attention-decode-fp8-out": lambda: _attention(FP8, 1, fp8_out=True),
    "attention-decode-one-tile": _attention_decode_one_tile,
    "attention-prefill-fp8-out": lambda: _attention(BF16, 5, fp8_out=True),
    "qk_prep-decode-full-fp8": lambda: _qk_prep(FP8, True, 1),
    "qk_prep-decode-sliding-fp8": lambda: _qk_prep(FP8, False, 1),
    "norms-fp8-out": _fp8_norms,
    "fp8-gemms-decode": _fp8_gemms_decode,
    "moe-fp8-prefill": _moe_fp8_prefill,
    "fp8-block-prefill": _fp8_block_prefill,
    "nvfp4-decode": _nvfp4_decode,
}


# Spills tolerated outside every loop: moe_nvfp4's TMA decode (one activation row for the
# MMA's 8 token columns) keeps five epilogue values in local memory across its K loop, a few
# loads a program (H200, T=1: 68.5 us against 71.5 with the 8-row activation tile, which
# does not spill; H200, 2026-11-30, commit 960c289: docs/benchmarks-history.md). The decode attention's split kernel,
# launched early with an FP8 cache and FP8 output codes: 20 bytes (five values, stored once
# before the wait and loaded once before the K/V loop), at 168 registers, while it holds its
# first K/V tile across the wait. (It holds the tile as FP8 codes; converted to BF16 before
# the wait, the tile also made the FP8 cache's BF16-output build spill 8 bytes. It was 8 bytes
# with the per-head gate; the element-wise gate's [16, 128] tile in the epilogue adds three
# values, measured on the CPU's sm_90 build: a 32-bit offset base or a later gate load does
# not remove them.)
OUTSIDE_LOOP_SPILLS = {"_moe_nvfp4_kernel": 32, "_decode_split_kernel": 20}


@pytest.mark.parametrize("build", list(BUILDS))
def test_kernels_compile_for_hopper_without_spills(build, monkeypatch):
    # the target has PDL (the CPU box, where it builds, not): the decode chain's forms
    monkeypatch.setattr(_pdl, "has_pdl", lambda device: True)
    with compile_instead_of_launch() as compiled:
        BUILDS[build]()
    assert compiled
    for name, kernel in compiled:
        # (local memory without spills is a stack frame: libdevice's sinf/cosf slow path)
        spilled = spill_bytes(kernel)
        allowed = OUTSIDE_LOOP_SPILLS.get(name, 0)
        assert spilled <= allowed, f"{name} spills {spilled} bytes: {resource_usage(kernel)}"
        if allowed:
            assert not spills_in_loops(kernel), f"{name} spills inside its K loop"
        if name == "_decode_split_kernel":  # (one tile a split: no loop to pipeline)
            one_tile = constexpr(kernel, "ONE_TILE")
            assert ("cp.async.cg.shared.global" in kernel.asm["ptx"]) != one_tile, \
                f"K/V loads pipelined: {not one_tile}"
        if build == "attention-decode-one-tile":
            assert name != "_decode_split_kernel" or constexpr(kernel, "ONE_TILE"), name
        if name == "_prefill_kernel":
            assert "warp_group_dot" in kernel.asm["ttgir"], "prefill does not use wgmma"
        if name in ("_moe_nvfp4_kernel", "_linear_nvfp4_kernel"):  # decoded tile: registers only
            # (one small store per 8 MMAs may remain in the K loop: the per-word scales' layout
            # change, 2 a 256-deep tile; the decoded BF16 tile itself took 16 stores a
            # 128-deep tile (8 MMAs) before the register decode; the epilogue's are outside
            # the loop)
            stores, mmas = in_loops(kernel, r"\bSTS\b"), in_loops(kernel, r"\bHMMA\b")
            assert stores <= mmas // 8, \
                f"{name} stages the decoded tile in shared memory ({stores} stores, {mmas} MMAs)"
        if build == "nvfp4-decode" and name == "_moe_nvfp4_kernel":  # words by the TMA
            assert in_loops(kernel, r"\bUTMALDG\b"), f"{name}: weight words not loaded by the TMA"
            # direct pairs overlap the GEMMs: gate/up lets the down GEMM launch early (PDL),
            # the down GEMM the boundary norm
            assert "griddepcontrol.launch_dependents" in kernel.asm["ptx"], name
        if name in ("_linear_fp8_kernel", "_moe_fp8_kernel"):  # swap-AB: weights on wgmma's M
            # (but one token's gate/up, moe_fp8.DECODE_GATE_UP: 32-row weight tiles, mma.sync)
            decode_gate_up = (build == "fp8-gemms-decode" and name == "_moe_fp8_kernel"
                              and constexpr(kernel, "GATED"))
            assert ("warp_group_dot" in kernel.asm["ttgir"]) != bool(decode_gate_up), \
                f"{name}: wgmma use differs from its tile's (gate/up: {decode_gate_up})"
        if build == "moe-fp8-prefill" and name == "_moe_fp8_kernel":  # TMA loads, no cp.async
            assert in_loops(kernel, r"\bUTMALDG\b") and not in_loops(kernel, r"\bLDGSTS\b"), \
                f"{name}: prefill operands not loaded by the TMA"


def constexpr(kernel, name: str):
    """The value a compiled kernel's constexpr argument `name` was specialised to."""
    return kernel.src.constants[(kernel.src.fn.arg_names.index(name),)]


def _decode_chain():
    """A batch-1 decode layer's kernels in the decode chain (plugins/_pdl.py), in order."""
    w, one = torch.ones(H, dtype=BF16), torch.ones(())
    _launch_add_rmsnorm_fp8(torch.randn(1, H, dtype=BF16), torch.randn(1, H, dtype=BF16), w, w,
                            one, 0.9, 0.4, 1e-6)
    n = BEAM.qkv_gate_size  # q/k/v and the output gate: one packed FP8 GEMM
    linear_fp8_triton(torch.zeros(1, H, dtype=FP8), torch.zeros(n, H, dtype=FP8), torch.ones(n),
                      one, BF16, split_k=2)
    _qk_prep(FP8, False, 1)
    case = attention_case([Seq(300, 1)], HQ, HKV, D, 0, 64, BF16, FP8)
    case.pop("cu_seqlens_q")
    launch_decode(**case, out_scale=one, config={"splits": 4})  # split (+ combine), as at batch 1
    linear_fp8_triton(torch.zeros(1, HQ * D, dtype=FP8), torch.zeros(H, HQ * D, dtype=FP8),
                      torch.ones(H), one, BF16, split_k=2)
    _launch_group_router(torch.randn(1, H, dtype=BF16), torch.randn(256, H), torch.zeros(256), 8,
                         4, 8, True)


CHAIN_KERNELS = ["_add_rmsnorm_kernel", "_linear_fp8_kernel", "_qk_prep_kernel",
                 "_decode_split_kernel", "_decode_combine_kernel", "_linear_fp8_kernel",
                 "_router_logits_kernel", "_router_select_kernel"]
# Kernels of the chain that let their successor launch early (all but the router's selection,
# whose successor, the MoE's gate/up GEMM, has nothing to do before the routing exists).
LETS_NEXT_LAUNCH = {"_add_rmsnorm_kernel", "_linear_fp8_kernel", "_qk_prep_kernel",
                    "_decode_split_kernel", "_decode_combine_kernel", "_router_logits_kernel"}

# Kernels of the chain that read their weights (or weight scales) before the wait.
PRELOADS_BEFORE_WAIT = {"_router_logits_kernel", "_add_rmsnorm_kernel", "_linear_fp8_kernel",
                       "_qk_prep_kernel", "_decode_split_kernel"}


# With the folds (_pdl.FOLDS) the combine and the selection are no launches of their own.
FOLDED_CHAIN_KERNELS = [n for n in CHAIN_KERNELS
                        if n not in ("_decode_combine_kernel", "_router_select_kernel")]
# (mnemonics, not substrings: "ld.shared" holds "red.")
WRITES = r"(?<![\w.])(st\.global|atom\.|red\.|cp\.async)"


@pytest.mark.parametrize("chain", ["links", "links and folds"])
def test_decode_chain_kernels_launch_early_and_wait_before_they_write(monkeypatch, chain):
    """On sm_90, with every link of the chain on, each of its kernels is launched with PDL and,
    before its griddepcontrol.wait, neither stores nor starts an asynchronous copy (its
    predecessor may still read that memory or write its inputs); with the folds too, the
    combine and the selection are done by the kernels before them, after their wait."""
    monkeypatch.setattr(_pdl, "has_pdl", lambda device: True)
    try:
        _pdl.set_decode_chain(_pdl.LINKS if chain == "links" else "all")
        with compile_instead_of_launch() as compiled:
            _decode_chain()
    finally:
        _pdl.set_decode_chain(True)
    names = [name for name, _ in compiled]
    assert names == (CHAIN_KERNELS if chain == "links" else FOLDED_CHAIN_KERNELS), names
    for name, kernel in compiled:
        ptx = kernel.asm["ptx"]
        assert kernel.metadata.launch_pdl, f"{name} is not launched early"
        assert ("griddepcontrol.launch_dependents" in ptx) == (name in LETS_NEXT_LAUNCH), name
        before_wait, after_wait = ptx.split("griddepcontrol.wait", 1)
        for op in re.findall(WRITES, before_wait):
            raise AssertionError(f"{name}: {op} before griddepcontrol.wait")
        if name in PRELOADS_BEFORE_WAIT:  # its weights stream in while its predecessor runs
            assert "ld.global" in before_wait, f"{name} reads no weights before its wait"
        if chain != "links" and name in ("_decode_split_kernel", "_router_logits_kernel"):
            assert "atom.global.gpu.acq_rel.add" in after_wait, f"{name} draws no ticket"


def test_default_decode_chain(monkeypatch):
    """The default links (_pdl.DEFAULT_LINKS): every kernel of the chain is launched early.
    The norms and qk_prep let their successors launch only once their own wait has returned
    (_pdl.LATE: else the router's GEMV, the next q/k/v GEMM or the attention's split would
    sit on the SMs while the o_proj, the MoE's down GEMM or the q/k/v GEMM still stream their
    weights); the other kernels at their start. Nothing is folded."""
    monkeypatch.setattr(_pdl, "has_pdl", lambda device: True)
    with compile_instead_of_launch() as compiled:
        _decode_chain()
    assert [name for name, _ in compiled] == CHAIN_KERNELS
    late = {"_add_rmsnorm_kernel", "_qk_prep_kernel"}
    for name, kernel in compiled:
        assert kernel.metadata.launch_pdl, f"{name} is not launched early"
        if name not in LETS_NEXT_LAUNCH:
            continue
        before_wait, after_wait = kernel.asm["ptx"].split("griddepcontrol.wait", 1)
        trigger = "griddepcontrol.launch_dependents"
        assert (trigger in before_wait) == (name not in late), f"{name}: trigger before wait"
        assert (trigger in after_wait) == (name in late), f"{name}: trigger after wait"


def test_without_pdl_no_kernel_waits(monkeypatch):
    """Off the chain (pre-Hopper GPUs; here the CPU's compile, which has no PDL) the same
    kernels are plain launches without griddepcontrol."""
    monkeypatch.setattr(_pdl, "has_pdl", lambda device: False)
    with compile_instead_of_launch() as compiled:
        _decode_chain()
    for name, kernel in compiled:
        assert not kernel.metadata.launch_pdl, name
        assert "griddepcontrol" not in kernel.asm["ptx"], name


def test_chain_modes(monkeypatch):
    """_pdl.chain_mode: 0 off the chain, 1 for a kernel that lets its successor launch at its
    start, 2 for one of _pdl.LATE; set_decode_chain refuses names it does not know."""
    monkeypatch.setattr(_pdl, "has_pdl", lambda device: True)
    cuda = torch.device("cuda")
    try:
        assert [_pdl.chain_mode(cuda, k) for k in ("norm", "qk_prep", "linear")] == [2, 2, 1]
        _pdl.set_decode_chain(["norm", "late_linear"])
        assert [_pdl.chain_mode(cuda, k) for k in ("norm", "linear")] == [1, 2]
        _pdl.set_decode_chain(False)
        assert _pdl.chain_mode(cuda, "norm") == 0
        with pytest.raises(ValueError, match="late_router"):
            _pdl.set_decode_chain(["norm", "late_router"])
    finally:
        _pdl.set_decode_chain(True)
    monkeypatch.setattr(_pdl, "has_pdl", lambda device: False)
    assert _pdl.chain_mode(cuda, "norm") == 0
