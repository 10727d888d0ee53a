"""KV offload tiers behind the engine's secondary-tier hooks: host memory, then disk.

When the engine evicts a reusable full-attention block it calls `offload(hash, parent,
token_ids, kv)`; the block goes to the host tier (an LRU of CPU tensors within a byte
budget). Blocks pushed out of the host tier are written to the disk tier (one file per
block, an LRU within its own budget); blocks pushed out of the disk tier are dropped. On a
prefix miss the engine calls `fetch(hash)`: a host hit is returned as is, a disk hit is
read, promoted to the host tier and returned. The engine writes the block back and
registers it, so the router learns of it through the usual `stored` event.

Why our own tier: Dynamo's KVBM allocates even host memory through CUDA (it panics without
libcuda, shared/research/dynamo-local.md §5); on GPUs, KVBM as the TRT-LLM connector is the
supported path and `beam-trt k8s` leaves the door open to it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections import OrderedDict
from pathlib import Path

import torch

log = logging.getLogger("beam.worker")


class KvTiers:
    def __init__(self, host_bytes: int, disk_bytes: int = 0, disk_dir: str | Path | None = None):
        if disk_bytes and disk_dir is None:
            raise ValueError("a disk tier needs a folder")
        self.host_bytes, self.disk_bytes = host_bytes, disk_bytes
        self.disk_dir = Path(disk_dir) if disk_dir else None
        if self.disk_dir is not None:
            # Blocks left by an earlier run may come from another engine build: start empty.
            shutil.rmtree(self.disk_dir, ignore_errors=True)
            self.disk_dir.mkdir(parents=True)
        self._host: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._disk: OrderedDict[int, int] = OrderedDict()  # hash -> bytes on disk
        self._host_used = self._disk_used = 0
        self._shape: tuple[int, ...] | None = None
        self._dtype: torch.dtype | None = None
        self._lock = threading.Lock()
        self.stats = {"offloaded": 0, "spilled_to_disk": 0, "dropped": 0, "host_hits": 0,
                      "disk_hits": 0, "misses": 0}

    # ------------------------------------------------------------------ engine hooks
    def offload(self, block_hash: int, parent_hash, token_ids, kv: torch.Tensor) -> None:
        kv = kv.detach().to("cpu", copy=True).contiguous()
        with self._lock:
            self._shape, self._dtype = tuple(kv.shape), kv.dtype
            self.stats["offloaded"] += 1
            self._put_host(block_hash, kv)

    def fetch(self, block_hash: int) -> torch.Tensor | None:
        with self._lock:
            kv = self._host.get(block_hash)
            if kv is not None:
                self._host.move_to_end(block_hash)
                self.stats["host_hits"] += 1
                return kv.clone()
            if block_hash in self._disk:
                kv = self._read_disk(block_hash)
                self.stats["disk_hits"] += 1
                self._put_host(block_hash, kv)
                return kv.clone()
            self.stats["misses"] += 1
            return None

    # ------------------------------------------------------------------ tiers
    def _put_host(self, h: int, kv: torch.Tensor) -> None:
        nbytes = kv.numel() * kv.element_size()
        if nbytes > self.host_bytes:
            return
        old = self._host.pop(h, None)
        if old is not None:
            self._host_used -= old.numel() * old.element_size()
        self._host[h] = kv
        self._host_used += nbytes
        while self._host_used > self.host_bytes:
            victim, vkv = self._host.popitem(last=False)
            self._host_used -= vkv.numel() * vkv.element_size()
            self._put_disk(victim, vkv)

    def _path(self, h: int) -> Path:
        return self.disk_dir / f"{h:016x}.kv"

    def _put_disk(self, h: int, kv: torch.Tensor) -> None:
        nbytes = kv.numel() * kv.element_size()
        if self.disk_dir is None or nbytes > self.disk_bytes:
            self.stats["dropped"] += 1
            return
        if h not in self._disk:
            tmp = self._path(h).with_suffix(".tmp")
            kv.view(torch.uint8).numpy().tofile(tmp)
            os.replace(tmp, self._path(h))  # a crash never leaves a torn block under its name
            self._disk[h] = nbytes
            self._disk_used += nbytes
            self.stats["spilled_to_disk"] += 1
        self._disk.move_to_end(h)
        while self._disk_used > self.disk_bytes:
            victim, vbytes = self._disk.popitem(last=False)
            self._path(victim).unlink(missing_ok=True)
            self._disk_used -= vbytes
            self.stats["dropped"] += 1

    def _read_disk(self, h: int) -> torch.Tensor:
        raw = torch.from_file(str(self._path(h)), size=self._disk[h], dtype=torch.uint8)
        return raw.clone().view(self._dtype).view(self._shape)

    # ------------------------------------------------------------------ accounting
    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"host_blocks": len(self._host), "host_bytes": self._host_used,
                    "disk_blocks": len(self._disk), "disk_bytes": self._disk_used, **self.stats}

    def contains(self, block_hash: int) -> str | None:
        with self._lock:
            return "host" if block_hash in self._host else "disk" if block_hash in self._disk else None
