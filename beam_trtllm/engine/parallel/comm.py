"""The collectives of a parallel engine over torch.distributed (NCCL on GPUs, gloo on the CPU).

All of them run over the whole world (tp = world: the attention's TP group and the MoE's
EP x TP group are both every rank). Sums that feed a rounding are taken in FP32 so that a
split GEMM still rounds once (docs/ENGINE.md "Parallelism").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..types import EngineError
from .mapping import ParallelMapping


# torch 2.13's names (its *_tensor forms are deprecated); older torch has only those
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    def __init__(self, mapping: ParallelMapping, device: torch.device):
        if not dist.is_available() or not dist.is_initialized():
            raise EngineError(f"a rank of a parallel engine ({mapping.describe()}) needs "
                              "torch.distributed initialized: start it with "
                              "beam_trtllm.engine.parallel.launch (or `beam-trt generate`)")
        world, rank = dist.get_world_size(), dist.get_rank()
        if (world, rank) != (mapping.world, mapping.rank):
            raise EngineError(f"engine dir of rank {mapping.rank} of {mapping.world} "
                              f"({mapping.describe()}) "
                              f"loaded by rank {rank} of a world of {world}")
        self.mapping, self.device = mapping, device
        self.backend = dist.get_backend()
        self.world = world
        self.counts: list[int] | None = None  # attention DP: every rank's tokens this step

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every rank -> [world * n, ...] in rank order."""
        out = torch.empty((self.world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        _ALL_GATHER(out, t.contiguous())
        return out

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """[world * n, ...] -> this rank's n rows of the sum over ranks."""
        out = torch.empty((t.shape[0] // self.world, *t.shape[1:]), dtype=t.dtype, device=t.device)
        _REDUCE_SCATTER(out, t.contiguous())
        return out

    def exchange_counts(self, tokens: int) -> list[int]:
        """Attention DP: every rank's token count of this step (one small all-gather)."""
        t = torch.tensor([tokens], dtype=torch.int64, device=self.device)
        self.counts = [int(c) for c in self.all_gather(t).tolist()]
        return self.counts

    def any(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        return bool(self.all_reduce(t).item())
