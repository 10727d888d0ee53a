"""The NCCL path of the parallel engine with a world of one rank on one GPU (skipped without
CUDA): its MoE goes through the pair dispatch and NCCL's all-reduce (TP layout) or all-gather
and reduce-scatter (attention DP), the same code as at any world size, against the plain
single-GPU engine.

    .venv/bin/python -m pytest -q tests/test_parallel_nccl.py      # on a GPU machine
"""

from __future__ import annotations

import pytest
import torch

from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.parallel import ParallelMapping
from beam_trtllm.engine.parallel.launch import launch
from beam_trtllm.engine.plan import BuildOptions
from conftest import tol
from engine_helpers import TINY_OPTS, all_logits, greedy, prompts

import parallel_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA GPU")


def _target() -> str:
    major = torch.cuda.get_device_capability()[0]
    if major not in (9, 10):
        pytest.skip(f"engine targets are sm90 and sm100, this GPU is sm{major}x")
    return "sm90" if major == 9 else "sm100"


@pytest.mark.parametrize("attention_dp", [False, True], ids=["tp1-nccl", "dp1-nccl"])
def test_nccl_world_of_one_generates_the_single_gpu_engines_tokens(tiny_dir, tmp_path,
                                                                    attention_dp):
    opts = BuildOptions(**TINY_OPTS, target=_target(), autotune="off")
    batch = prompts(9, (21, 7, 16, 30, 11, 25, 9, 18))
    single = Engine.from_dir(build_engine(tiny_dir, tmp_path / "one", opts), use_cuda_graphs=False)
    want_logits, _ = all_logits(single, batch[0], 8)
    want = [r["token_ids"] for r in single.generate(batch, greedy(8))]
    del single
    par = build_engine(tiny_dir, tmp_path / "par", opts,
                       parallel=ParallelMapping(1, 1, attention_dp))
    got = launch(1, parallel_ranks.nccl_rank, str(par), batch, 8, device="cuda", timeout_s=300)[0]
    assert got["backend"] == "nccl"
    assert [got["tokens"][i] for i in range(len(batch))] == want
    assert got["used_blocks"] == 0
    # the attention and dense layers are the single engine's; the experts run one (token,
    # expert) pair a row, whose launch shapes may sum in another order (docs/ENGINE.md)
    diff = (got["logits"] - want_logits.cpu()).abs().max().item()
    print(f"max |logit difference| {diff:.3g} over {want_logits.numel()} logits")
    torch.testing.assert_close(got["logits"], want_logits.cpu(),
                               **tol("parallel-vs-single", torch.bfloat16))
