"""Host-side staging of a step's small inputs for the CUDA-graph steps (graphs.py,
draft_graphs.py).

A step's index tensors are filled on the host and copied into the graphs' static device
buffers. `torch.tensor(list, device="cuda")` or a copy from pageable memory waits for every
kernel queued before it (a pageable host-to-device copy synchronizes the stream), so a step
that makes several of them serializes the host with the GPU several times over. `Staging`
keeps one pinned host buffer per device buffer (numpy views for cheap element writes) and
copies with `non_blocking=True`; an event after the copies keeps the next fill from
overwriting a buffer whose copy has not run yet. On the CPU the buffers are plain tensors.

`HostTable` is a block table kept on the host whose rows are rewritten only when their
request or its block count changed (a 1M-token sequence's table is 32K entries: rebuilding
it every step cost more than the step's GPU time).
"""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    def __init__(self, device_buffers: dict[str, torch.Tensor], device: torch.device):
        self.dev = device_buffers
        self.cuda = device.type == "cuda"
        self.host = {k: torch.zeros(t.shape, dtype=t.dtype, pin_memory=self.cuda)
                     for k, t in device_buffers.items()}
        self.np = {k: t.numpy() for k, t in self.host.items()}
        self._copied: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Before writing the host buffers: the last copies out of them have run."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def copy(self, rows: int) -> None:
        """The first `rows` rows of each buffer to the device."""
        for k in self.dev:
            self.dev[k][:rows].copy_(self.host[k][:rows], non_blocking=self.cuda)
        if self.cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()


class HostTable:
    """Block-table rows on the host (`table`: [rows, width] int32, a Staging buffer's)."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        # per row: (request, its preemptions, blocks written, rows in its group)
        self._rows: list = [(None, -1, 0, 1)] * table.shape[0]

    def set(self, row: int, req, rows: int = 1) -> None:
        """Rows [row, row + rows) hold `req`'s block ids (a verify step's rows of one sequence
        share them): written from where they last left off, copied to the group's other rows."""
        # blocks past the width hold positions past max_seq_len (the drafter's block of a
        # request at its length limit): this table's step never reads them
        n = min(len(req.block_ids), self.table.shape[1])
        held, preempts, have, group = self._rows[row]
        same = held is req and preempts == req.num_preemptions and have <= n and group == rows
        lo = have if same else 0
        if lo == 0 and held is not None:  # another request (or its blocks were dropped)
            self.table[row].zero_()
        if lo < n:  # a request's blocks only grow while it runs: write the new ones
            self.table[row, lo:n] = torch.from_numpy(np.asarray(req.block_ids[lo:n], np.int32))
        if rows > 1 and (lo < n or not same):  # the group's rows: the new columns, or all
            cols = slice(lo, n) if same else slice(None)
            self.table[row + 1:row + rows, cols] = self.table[row, cols]
        self._rows[row] = (req, req.num_preemptions, n, rows)
        if not same:  # the group's other rows: rewritten when used alone (marked once)
            for other in range(row + 1, row + rows):
                self._rows[other] = (self, -1, 0, 0)
