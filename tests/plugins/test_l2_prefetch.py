"""beam::l2_prefetch changes nothing (it only asks for lines in L2), refuses what it cannot
prefetch with the op's name, and runs inside a CUDA graph. Its effect is speed only:
bench/engine_bench.py --chain-ab 'default;default/noprefetch' on the H200."""

from __future__ import annotations

import pytest
import torch

import plugins  # noqa: F401  (registers torch.ops.beam.*)
from plugins.registry import PluginError


def test_l2_prefetch_is_a_no_op_on_the_cpu_and_checks_its_input():
    t = torch.randn(64, 48)
    before = t.clone()
    assert torch.ops.beam.l2_prefetch(t, 1 << 20) is None
    assert torch.equal(t, before)
    with pytest.raises(PluginError, match="beam::l2_prefetch: t must be contiguous"):
        torch.ops.beam.l2_prefetch(t.t(), 1 << 20)
    with pytest.raises(PluginError, match="max_bytes must be >= 0"):
        torch.ops.beam.l2_prefetch(t, -1)


@pytest.mark.kernel
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("shape, dtype", [((5120, 6144), torch.float8_e4m3fn),
                                          ((3, 1000), torch.bfloat16), ((0,), torch.float32)])
def test_l2_prefetch_leaves_the_tensor_as_it_was_and_replays_in_a_graph(shape, dtype):
    t = torch.randn(shape, device="cuda").to(dtype)
    before = t.clone()
    torch.ops.beam.l2_prefetch(t, 40 << 20)  # (compile outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.beam.l2_prefetch(t, 40 << 20)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(t.view(torch.uint8), before.view(torch.uint8))
