"""What a worker tells the outside: KV events for the router, load snapshots, a status file.

- `KvEventForwarder` is the engine's KV-event sink. The engine reports stored blocks (its
  block hash, parent hash and the block's real token ids) and removed hashes; Dynamo's
  `publish_stored` takes one parent per call, so a batch is split into parent-linked chains.
  The router hashes the token ids itself (docs/DESIGN.md §3).
- `LoadReporter` pushes `ComponentSnapshot`s (used / total blocks) to the router and writes
  the worker's counters to a JSON status file (atomic rename) that tests and operators read:
  that is how "all KV blocks are free" is counted, not assumed.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("beam.worker")


def chains(blocks) -> list[list]:
    """Split stored blocks into runs where each block's parent is the previous block."""
    out: list[list] = []
    for b in blocks:
        if out and b.parent_hash == out[-1][-1].block_hash:
            out[-1].append(b)
        else:
            out.append([b])
    return out


class KvEventForwarder:
    """Engine KV-event sink -> Dynamo `KvEventPublisher` (set once the Worker hands it over)."""

    def __init__(self):
        self.publisher = None
        self._lock = threading.Lock()
        self.counts = {"stored": 0, "removed": 0}

    def set_publisher(self, publisher) -> None:
        self.publisher = publisher

    def stored(self, blocks) -> None:
        with self._lock:
            self.counts["stored"] += len(blocks)
            if self.publisher is None:
                return
            for run in chains(blocks):
                token_ids = [t for b in run for t in b.token_ids]
                self.publisher.publish_stored(
                    token_ids=token_ids, num_block_tokens=[len(b.token_ids) for b in run],
                    block_hashes=[b.block_hash for b in run], parent_hash=run[0].parent_hash)

    def removed(self, block_hashes) -> None:
        with self._lock:
            self.counts["removed"] += len(block_hashes)
            if self.publisher is not None and block_hashes:
                self.publisher.publish_removed(list(block_hashes))


class LoadReporter:
    """Load snapshots to the router and the status file, from the engine's own counters."""

    def __init__(self, engine, status_file: Path | None, extra: Callable[[], dict[str, Any]]):
        self.engine = engine
        self.status_file = Path(status_file) if status_file else None
        self.extra = extra
        self.publisher = None
        self._last: str | None = None
        self._last_write = 0.0

    def snapshot(self) -> dict[str, Any]:
        usage = self.engine.kv_usage()
        snap = dict(self.engine.load_snapshot())
        snap.update(kv_used_blocks=usage.used_blocks, kv_total_blocks=usage.total_blocks)
        snap.update(self.extra())
        return snap

    def __call__(self) -> None:
        snap = self.snapshot()
        if self.publisher is not None:
            from dynamo.common.backend.publisher import ComponentSnapshot

            total = max(1, snap["kv_total_blocks"])
            self.publisher.publish(0, ComponentSnapshot(
                kv_used_blocks=snap["kv_used_blocks"], kv_total_blocks=snap["kv_total_blocks"],
                gpu_cache_usage=snap["kv_used_blocks"] / total, dp_rank=0,
                kv_cache_hit_rate=None))
        # The file is for people and tests: at most 4 writes a second while busy, and at once
        # when the engine goes idle (the state "all blocks free" is never stale).
        idle = not (snap["num_running"] or snap["num_waiting"])
        if idle or time.monotonic() - self._last_write >= 0.25:
            self._write(snap)

    def _write(self, snap: dict[str, Any]) -> None:
        if self.status_file is None:
            return
        self._last_write = time.monotonic()
        text = json.dumps(snap, sort_keys=True, default=str)
        if text == self._last:
            return
        tmp = self.status_file.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.status_file)
        self._last = text
