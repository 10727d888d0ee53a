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
              8, 4, 8, 2.5, True)
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
