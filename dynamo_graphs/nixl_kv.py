"""Moving one request's KV cache between two engines with NIXL (UCX; CPU DRAM here, VRAM on GPUs).

Both sides register their engine's cache tensors once. Every tensor is a stack of equal
units: a *block* tensor (a full-attention layer's paged K or V cache, one unit per block)
or a *ring* tensor (a sliding layer's K or V ring, one unit per sequence row). A request's
KV is a set of block ids plus one ring row, so its descriptors are one (address, bytes)
region per block per block tensor and one per ring tensor.

Protocol (the handle is a small JSON dict that rides in Dynamo's `disaggregated_params`):
1. The prefill side `export()`s a handle: agent name, agent metadata, the layout, each
   tensor's base address and unit size, the block ids, the ring row, the byte count.
2. The decode side `read()`s it into blocks it reserved, with a timeout derived from the
   bytes to move; the READ carries the notification `done:<handle id>`.
3. The prefill side `poll()`s notifications and releases the request's KV on `done:` (and
   on `fail:`, sent by a decode side that gave up) or when the handle's TTL runs out.
A READ that errors or times out is released and raises `KvTransferError`; nothing waits
forever.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Sequence

import torch

DONE, FAIL = b"done:", b"fail:"


class KvTransferError(RuntimeError):
    """A KV transfer that failed or timed out; the message names the request handle."""


@dataclass(frozen=True)
class CacheTensor:
    kind: str  # "block" or "ring"
    tensor: torch.Tensor  # [units, ...], contiguous

    @property
    def unit_bytes(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()


def layout_of(tensors: Sequence[CacheTensor]) -> list[list]:
    """What both sides must agree on: kind, unit count and unit bytes of every tensor."""
    return [[t.kind, t.tensor.shape[0], t.unit_bytes, str(t.tensor.dtype)] for t in tensors]


class NixlKvTransport:
    """One NIXL agent over one engine's cache tensors."""

    def __init__(self, name: str, tensors: Sequence[CacheTensor]):
        from nixl._api import nixl_agent, nixl_agent_config  # lazy: optional at import time

        for t in tensors:
            if t.kind not in ("block", "ring") or not t.tensor.is_contiguous():
                raise ValueError(f"cache tensor of kind {t.kind!r} must be contiguous block/ring")
        self.name = name
        self.tensors = list(tensors)
        self.layout = layout_of(self.tensors)
        self.mem_type = "DRAM" if self.tensors[0].tensor.device.type == "cpu" else "VRAM"
        self.device_id = max(0, self.tensors[0].tensor.get_device())
        # No progress thread: it busy-polls a core even when idle. Progress is driven by our
        # own calls instead (the READ loop on the decode side, poll() on the prefill side).
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False,
                                                        backends=["UCX"]))
        self._reg = self.agent.register_memory([t.tensor for t in self.tensors])
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self._known_agents: set[str] = set()

    # ------------------------------------------------------------------ descriptors
    def _regions(self, bases: Sequence[int], block_ids: Sequence[int], ring_row: int | None):
        regions = []
        for t, base in zip(self.tensors, bases):
            units = block_ids if t.kind == "block" else ([] if ring_row is None else [ring_row])
            regions += [(base + u * t.unit_bytes, t.unit_bytes, self.device_id) for u in units]
        return regions

    def _bases(self) -> list[int]:
        return [t.tensor.data_ptr() for t in self.tensors]

    def nbytes(self, n_blocks: int, has_ring: bool) -> int:
        return sum(t.unit_bytes * (n_blocks if t.kind == "block" else int(has_ring))
                   for t in self.tensors)

    # ------------------------------------------------------------------ prefill side
    def export(self, handle_id: str, block_ids: Sequence[int], ring_row: int | None) -> dict:
        """The JSON-safe handle of one request's KV held here."""
        return {
            "agent": self.name, "metadata": self.metadata, "layout": self.layout,
            "bases": self._bases(), "handle_id": handle_id, "block_ids": list(block_ids),
            "ring_row": ring_row, "nbytes": self.nbytes(len(block_ids), ring_row is not None),
        }

    def poll(self) -> list[tuple[bool, str]]:
        """Finished handles since the last poll: (True, id) for done, (False, id) for failed."""
        out = []
        for msgs in self.agent.get_new_notifs().values():
            for msg in msgs:
                if msg.startswith(DONE):
                    out.append((True, msg[len(DONE):].decode()))
                elif msg.startswith(FAIL):
                    out.append((False, msg[len(FAIL):].decode()))
        return out

    # ------------------------------------------------------------------ decode side
    def read(self, handle: dict, block_ids: Sequence[int], ring_row: int | None,
             timeout_s: float) -> float:
        """Pull `handle`'s KV into local `block_ids` / `ring_row`; returns seconds taken."""
        hid = handle.get("handle_id", "?")
        if handle.get("layout") != self.layout:
            raise KvTransferError(
                f"KV handle {hid}: the prefill engine's cache layout {handle.get('layout')} "
                f"differs from this engine's {self.layout} (different engine dirs or builds?)")
        if len(block_ids) != len(handle["block_ids"]):
            raise KvTransferError(f"KV handle {hid}: {len(handle['block_ids'])} blocks to read "
                                  f"but {len(block_ids)} reserved")
        if (ring_row is None) != (handle["ring_row"] is None):
            raise KvTransferError(f"KV handle {hid}: ring row present on one side only")
        remote_agent = self._connect(handle)
        remote = self._regions(handle["bases"], handle["block_ids"], handle["ring_row"])
        local = self._regions(self._bases(), block_ids, ring_row)
        if not local:
            return 0.0
        start = time.monotonic()
        try:
            xfer = self.agent.initialize_xfer(
                "READ", self.agent.get_xfer_descs(local, self.mem_type),
                self.agent.get_xfer_descs(remote, self.mem_type), remote_agent,
                DONE + hid.encode())
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
            self.notify_failure(remote_agent, hid)
            raise KvTransferError(f"KV handle {hid}: NIXL refused the READ from {remote_agent}: "
                                  f"{type(exc).__name__} {exc}") from exc
        try:
            state = self.agent.transfer(xfer)
            while state == "PROC" and time.monotonic() - start < timeout_s:
                time.sleep(0.0005)
                state = self.agent.check_xfer_state(xfer)
        except Exception as exc:  # noqa: BLE001 - a backend error mid-transfer
            state = f"ERR ({type(exc).__name__} {exc})"
        finally:
            self._release(xfer)
        if state != "DONE":
            why = "timed out" if state == "PROC" else f"failed: {state}"
            self.notify_failure(remote_agent, hid)
            raise KvTransferError(
                f"KV handle {hid}: NIXL READ of {handle['nbytes']} bytes from {remote_agent} "
                f"{why} after {time.monotonic() - start:.2f} s (limit {timeout_s:.2f} s)")
        return time.monotonic() - start

    def notify_failure(self, remote_agent: str, handle_id: str) -> None:
        """Tell the prefill side to free a handle this side gave up on (best effort)."""
        try:
            self.agent.send_notif(remote_agent, FAIL + handle_id.encode())
        except Exception:  # noqa: BLE001 - the peer may be gone; its TTL frees the KV then
            pass

    def progress(self) -> None:
        """Drive UCX on this side (no NIXL progress thread, and no READ running): without it
        a sent notification can sit in the queue (DecodeSide runs this after a decline)."""
        self.agent.get_new_notifs()

    def _connect(self, handle: dict) -> str:
        agent = handle["agent"]
        if agent not in self._known_agents:
            try:
                name = self.agent.add_remote_agent(base64.b64decode(handle["metadata"]))
            except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
                raise KvTransferError(f"KV handle {handle.get('handle_id')}: cannot load the "
                                      f"metadata of agent {agent}: {exc}") from exc
            self._known_agents.add(name.decode() if isinstance(name, bytes) else name)
        return agent

    def _release(self, xfer) -> None:
        try:
            xfer.release()
        except Exception:  # noqa: BLE001 - an in-flight READ that cannot be cancelled
            # NIXL keeps the handle on its leaked list and frees it with the agent.
            pass

    def close(self) -> None:
        if getattr(self, "agent", None) is None:
            return
        for name in list(self._known_agents):
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - already disconnected
                pass
        self.agent.deregister_memory(self._reg)
        self.agent = None
