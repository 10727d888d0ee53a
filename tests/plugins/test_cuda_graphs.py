"""The decode-path ops are CUDA-graph safe: captured once, replayed on new data in the same
buffers (new queries, shorter or longer cached lengths), they give what eager calls give.
GPU only (there are no CUDA graphs in the interpreter)."""

from __future__ import annotations

import pytest
import torch

import plugins  # noqa: F401  (registers torch.ops.beam.*)
from kernel_cases import Seq, attention_case

pytestmark = [pytest.mark.kernel,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _decode_ops(case, router, norm):
    out = torch.ops.beam.attention(**case)
    ids, weights = torch.ops.beam.group_router(*router)
    h_new, x = torch.ops.beam.add_rmsnorm(*norm)
    return out, ids, weights, h_new, x


@pytest.mark.parametrize("window", [0, 64])
def test_decode_step_replays_in_a_cuda_graph(window):
    seqs = [Seq(300, 1), Seq(1000, 1, hist=40), Seq(77, 1)]
    case = attention_case(seqs, 48, 8, 128, window, 16, torch.bfloat16, torch.bfloat16,
                          seed=1, device="cuda")
    x = torch.randn(3, 5120, device="cuda", dtype=torch.bfloat16)
    router = (x, torch.randn(256, 5120, device="cuda") / 40, torch.randn(256, device="cuda") / 20,
              8, 4, 8, True)
    ones = torch.ones(5120, device="cuda", dtype=torch.bfloat16)
    norm = (x, torch.randn_like(x), ones, ones, 0.9, 0.4, 1e-6)
    _decode_ops(case, router, norm)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _decode_ops(case, router, norm)
    for starts in ([5, 999, 76], [300, 512, 1]):  # the cache holds [hist, old start) already
        fresh = attention_case(seqs, 48, 8, 128, window, 16, torch.bfloat16, torch.bfloat16,
                               seed=len(starts) + starts[0], device="cuda")
        for name in ("q", "k_new", "v_new", "gate"):
            case[name].copy_(fresh[name])
        case["q_start"].copy_(torch.tensor(starts, dtype=torch.int32))
        x.copy_(torch.randn_like(x))
        graph.replay()
        eager = _decode_ops(case, router, norm)
        for got, want in zip(captured, eager):
            # bitwise: with window 64 these starts read ring slots the case never wrote
            # (kernel_cases fills them with NaN), so some outputs are NaN, as in the reference
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("t", [1, 3])
def test_moe_nvfp4_combine_replays_in_a_cuda_graph(t):
    """moe_nvfp4 on direct pairs combines in its down GEMM through ticket counters that its
    programs put back to zero: captured once and replayed on new x and routing, it gives
    the eager call's bits every time, and every ticket is back at zero after."""
    from _moe_testdata import (dense_experts, moe_args, pack_experts, random_routing,
                               sync_counters_all_zero)

    e, k, h, inner = 8, 4, 256, 128
    packed = pack_experts("nvfp4", *dense_experts(e, h, inner, seed=3))
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ids, w = random_routing(t, e, k, seed=5)
    args = tuple(a.cuda() for a in moe_args("nvfp4", x, ids, w, packed))
    torch.ops.beam.moe_nvfp4(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.beam.moe_nvfp4(*args)
    for seed in (6, 7, 8):
        new_ids, new_w = random_routing(t, e, k, seed=seed)
        args[0].copy_(torch.randn(t, h, generator=torch.Generator().manual_seed(seed)))
        args[1].copy_(new_ids)
        args[2].copy_(new_w)
        graph.replay()
        eager = torch.ops.beam.moe_nvfp4(*args)
        assert torch.equal(captured, eager)
        torch.cuda.synchronize()
        assert sync_counters_all_zero()


def _chain_inputs(seed: int):
    """One batch-1 decode layer's attention half on random weights at Beam's widths (FP8 GEMMs
    split in two over K, a paged FP8 cache holding 300 positions)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hq, hkv, d, h = 48, 8, 128, 5120
    fp8 = lambda *shape: (torch.randn(*shape, device="cuda", generator=gen) / 8).to(  # noqa: E731
        torch.float8_e4m3fn)
    case = attention_case([Seq(300, 1)], hq, hkv, d, 0, 16, torch.bfloat16, torch.float8_e4m3fn,
                          seed=seed, device="cuda")
    pos = 300
    block = case["cache_index"][0, pos // 16].long()
    ones = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(0.05, device="cuda")
    return dict(
        case=case, slot=(block * 16 + pos % 16).view(1), pos=case["q_start"].long(),
        h=torch.randn(1, h, device="cuda", dtype=torch.bfloat16, generator=gen),
        y=torch.randn(1, h, device="cuda", dtype=torch.bfloat16, generator=gen), norm_w=ones,
        scale=scale, w_qkv=fp8(2 * hq * d + 2 * hkv * d, h), w_o=fp8(h, hq * d),
        ws_qkv=torch.full((2 * hq * d + 2 * hkv * d,), 0.02, device="cuda"),
        gate_bias=0.5 * torch.randn(hq, device="cuda", generator=gen).to(torch.bfloat16),
        ws_o=torch.full((h,), 0.02, device="cuda"), qk_w=torch.ones(d, device="cuda",
                                                                    dtype=torch.bfloat16),
        router=(torch.randn(256, h, device="cuda", generator=gen) / 40,
                torch.randn(256, device="cuda", generator=gen) / 20))


def _chain_ops(a):
    """add_rmsnorm_fp8 -> q/k/v -> qk_prep -> attention -> o_proj -> add_rmsnorm_fp8 -> router:
    the kernels the decode chain launches early (plugins/_pdl.py)."""
    ops, c, bf16 = torch.ops.beam, a["case"], torch.bfloat16
    h, _, xq = ops.add_rmsnorm_fp8(a["h"], a["y"], a["norm_w"], a["norm_w"], a["scale"], 0.9, 0.4,
                                   1e-6)
    qkvg = ops.linear_fp8(xq, a["w_qkv"], a["ws_qkv"], a["scale"], bf16, 2)  # (as the engine)
    q, k, v, gate = ops.qk_prep(qkvg, a["pos"], a["qk_w"], a["qk_w"], a["gate_bias"],
                                c["k_cache"], c["v_cache"], a["slot"], c["k_scale"], c["v_scale"],
                                True, 1e-6, 1e4, out_dtype=bf16)
    o = ops.attention(q, k, v, gate, c["k_cache"], c["v_cache"], c["cu_seqlens_q"], c["q_start"],
                      c["hist_start"], c["cache_index"], 0, c["k_scale"], c["v_scale"],
                      a["scale"])
    y = ops.linear_fp8(o, a["w_o"], a["ws_o"], a["scale"], bf16, 3)
    h, x, xq = ops.add_rmsnorm_fp8(h, y, a["norm_w"], a["norm_w"], a["scale"], 0.9, 0.4, 1e-6)
    ids, weights = ops.group_router(x, *a["router"], 8, 4, 8, True)
    return q, gate, o, h, xq, ids, weights


@pytest.mark.parametrize("links", [True, "all"])
def test_decode_chain_replays_bit_equal_to_serial_launches(links):
    """The decode chain (kernels launched early by PDL, waiting for their inputs; the default
    links, then all) captured in a CUDA graph gives the serial launches' bits, replay after
    replay on new inputs."""
    from plugins import _pdl

    a = _chain_inputs(3)
    try:
        _pdl.set_decode_chain(links)
        _chain_ops(a)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _chain_ops(a)
        for seed in range(20):
            fresh = _chain_inputs(100 + seed)
            for name in ("h", "y"):
                a[name].copy_(fresh[name])
            graph.replay()
            _pdl.set_decode_chain(False)
            serial = _chain_ops(a)
            _pdl.set_decode_chain(links)
            for got, want in zip(captured, serial):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    finally:
        _pdl.set_decode_chain(True)
