"""Tensor, expert and attention-data parallelism of the engine over torch.distributed
(docs/ENGINE.md "Parallelism"): the layout (mapping.py), per-rank checkpoint pieces
(shard.py), per-rank engine dirs (build.py), the collectives (comm.py), what a rank adds to
the forward (rank.py) and the rank launcher (launch.py)."""

from __future__ import annotations

from .mapping import PARALLEL_FILE, ParallelMapping


def rank_of(spec, device):
    """The ParallelRank of a loaded rank dir (torch.distributed must be initialized)."""
    from .comm import Comm
    from .rank import ParallelRank

    return ParallelRank(spec.parallel, Comm(spec.parallel, device), spec.cfg)


__all__ = ["PARALLEL_FILE", "ParallelMapping", "rank_of"]
