"""Weights into the GPU's L2 ahead of their GEMM, on a side stream (beam::l2_prefetch).

A batch-1 decode layer runs long stretches of latency-bound kernels (qk_prep and the attention,
the boundary norm) that leave HBM idle, each just before a weight-streaming GEMM (o_proj, the
next layer's q/k/v). Prefetching that GEMM's weights on a side stream during the stretch lets
it read them from L2. The side stream forks from the step's stream after the kernel that must
finish first (so the prefetch does not compete with that kernel's own reads) and joins back at
the next fork or at the end of the step (CUDA-graph capture needs every forked stream joined);
a join only makes later kernels wait for the prefetch *launch* to finish, microseconds after
it started, never for the lines themselves.
"""

from __future__ import annotations

import torch

# At most this many bytes of a weight are prefetched: the H200's L2 holds 50 MB, shared with
# the step's activations and KV reads.
MAX_BYTES = 40 << 20


class L2Prefetch:
    """Side-stream prefetches of one device; `enabled` only on CUDA (bench/ turns it off for
    its A/B)."""

    def __init__(self, device: torch.device, ops):
        self.ops, self.device = ops, device
        self.enabled = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.enabled else None
        self.pending = False

    def start(self, weight: torch.Tensor | None) -> None:
        """Prefetch `weight` after the work issued so far on the current stream (None: none)."""
        if not self.enabled or weight is None:
            return
        self.join()
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            self.ops.l2_prefetch(weight, MAX_BYTES)
        self.pending = True

    def join(self) -> None:
        """Later work on the current stream waits for the side stream's launches."""
        if self.pending:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            self.pending = False
