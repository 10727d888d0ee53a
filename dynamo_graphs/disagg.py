"""Disaggregated prefill -> decode on top of the engine's transport-agnostic hooks and NIXL.

Prefill worker: the prompt runs as a prefill-only request; its KV stays pinned in the
engine; `PrefillSide.export()` turns the engine's `KVHandle` into the JSON handle that rides
in `disaggregated_params` (NIXL agent, metadata, descriptors, the sampled first token). The
pin is released when the decode side's READ completes (NIXL notification `done:`), when it
reports a failure (`fail:`), or when the handle's TTL runs out (decode side dead).

Decode worker: `DecodeSide.pull()` reserves blocks and a ring row (retrying while the cache is
full, within the budget), READs the handle with a timeout derived from the bytes to move,
and returns the reservation with the first token set for `add_request(kv_reserved=...)`. On
any failure the reservation is released before the error propagates: no leaked blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

from .graph import Timeouts
from .nixl_kv import CacheTensor, KvTransferError, NixlKvTransport

log = logging.getLogger("beam.worker")


def cache_tensors(engine) -> list[CacheTensor]:
    """Every layer's K and V cache, in layer order: paged blocks or sliding rings; then the
    drafter's paged K and V (speculative decoding: the prompt's drafter context goes with
    the handoff, in the same block ids)."""
    out = []
    for layer in (engine.kv_layers() if hasattr(engine, "kv_layers") else engine.kv.layers()):
        kind = "block" if layer.kind == "full" else "ring"
        out += [CacheTensor(kind, layer.k), CacheTensor(kind, layer.v)]
    return out


class PrefillSide:
    def __init__(self, engine, transport: NixlKvTransport, ttl_s: float):
        self.engine, self.transport, self.ttl_s = engine, transport, ttl_s
        self.pinned: dict[str, float] = {}  # request id -> release deadline
        self._lock = threading.Lock()  # NIXL agents are not thread-safe (sync mode NONE)
        self.stats = {"exported": 0, "released_done": 0, "released_failed": 0,
                      "released_ttl": 0}

    def export(self, request_id: str) -> dict:
        handle = self.engine.kv_export(request_id)
        with self._lock:
            params = self.transport.export(request_id, handle.block_ids, handle.ring_row)
            self.pinned[request_id] = time.monotonic() + self.ttl_s
        params.update(first_token=handle.first_token, num_tokens=handle.num_tokens,
                      block_size=handle.block_size, kv_dtype=handle.kv_dtype)
        self.stats["exported"] += 1
        return params

    def poll(self) -> None:
        """Release the pins whose transfers finished, failed or expired."""
        with self._lock:
            events = self.transport.poll()
        for ok, rid in events:
            self._release(rid, "released_done" if ok else "released_failed")
        now = time.monotonic()
        for rid, deadline in list(self.pinned.items()):
            if now > deadline:
                log.warning("KV handle %s: no decode worker read it within %.0f s; releasing",
                            rid, self.ttl_s)
                self._release(rid, "released_ttl")

    def _release(self, rid: str, why: str) -> None:
        if self.pinned.pop(rid, None) is not None:
            self.engine.release(rid)
            self.stats[why] += 1

    def release_all(self) -> None:
        for rid in list(self.pinned):
            self._release(rid, "released_ttl")

    async def run_poller(self, stop: asyncio.Event, period_s: float = 0.002) -> None:
        while not stop.is_set():
            self.poll()
            await asyncio.sleep(period_s if self.pinned else 0.05)


class DecodeSide:
    def __init__(self, engine, transport: NixlKvTransport, timeouts: Timeouts):
        self.engine, self.transport, self.timeouts = engine, transport, timeouts
        self._lock = threading.Lock()
        self._progress_until = 0.0
        self.stats = {"pulled": 0, "failed": 0, "declined": 0, "in_flight": 0, "bytes": 0,
                      "seconds": 0.0}

    async def decline(self, params: dict) -> None:
        """Tell the prefill worker to free a handle this worker will never read (a refused or
        cancelled request), at once instead of after its TTL. Best effort: a dead peer's own
        TTL, or its death, frees it anyway."""
        if not params.get("agent") or not params.get("handle_id"):
            return
        self.stats["declined"] += 1
        self._progress_until = time.monotonic() + 2.0  # run_progress keeps UCX moving
        await asyncio.to_thread(self._decline, params)

    async def run_progress(self, stop: asyncio.Event, period_s: float = 0.002) -> None:
        """After a decline, progress the transport for a while so the message is delivered."""
        while not stop.is_set():
            busy = time.monotonic() < self._progress_until
            if busy:
                with self._lock:
                    self.transport.progress()
            await asyncio.sleep(period_s if busy else 0.05)

    def _decline(self, params: dict) -> None:
        with self._lock:
            try:
                agent = self.transport._connect(params)
                handle_id = str(params["handle_id"])
            except (KvTransferError, KeyError, TypeError, ValueError):
                return  # unreachable or too malformed to name: the prefill side's TTL frees it
            self.transport.notify_failure(agent, handle_id)

    async def pull(self, request_id: str, prompt: list[int], params: dict):
        """Reserve, READ and return the handle to continue from; raises KvTransferError."""
        from beam_trtllm.engine.types import KVCapacityError

        try:
            if params.get("num_tokens") != len(prompt):
                raise KvTransferError(f"KV handle {params.get('handle_id')}: it holds "
                                      f"{params.get('num_tokens')} tokens, the prompt has "
                                      f"{len(prompt)}")
            budget = self.timeouts.kv_transfer_s(int(params["nbytes"]))
            deadline = time.monotonic() + self.timeouts.kv_handoff_ttl_s
            while True:
                try:
                    reserved = self.engine.kv_reserve(request_id, len(prompt))
                    break
                except KVCapacityError:
                    if time.monotonic() > deadline:  # the prefill side has released it by now
                        raise KvTransferError(f"KV handle {params.get('handle_id')}: no room "
                                              "to receive it before its TTL") from None
                    await asyncio.sleep(0.01)
        except BaseException:  # refused, cancelled or out of time before the READ: free the
            await asyncio.shield(self.decline(params))  # source now, not at its TTL
            raise
        read = asyncio.ensure_future(asyncio.to_thread(self._read, params, reserved, budget))
        self.stats["in_flight"] += 1
        try:
            seconds = await asyncio.shield(read)
        except BaseException:
            # A cancelled request must not free blocks a READ may still be writing: wait for
            # the READ to end (it is bounded by `budget`), then release the reservation.
            await asyncio.wait([read])
            self.engine.release(request_id)
            self.stats["failed"] += 1
            raise
        finally:
            self.stats["in_flight"] -= 1
        self.stats["pulled"] += 1
        self.stats["bytes"] += int(params["nbytes"])
        self.stats["seconds"] += seconds
        return dataclasses.replace(reserved, first_token=int(params["first_token"]))

    def _read(self, params: dict, reserved, budget: float) -> float:
        with self._lock:
            return self.transport.read(params, reserved.block_ids, reserved.ring_row, budget)


def handoff_failed(rid: str, exc: Exception) -> Exception:
    """Decode side: the error of a request whose KV never arrived (its prefill worker died, or the handle
    expired): it must be prefilled again. In a worker, Dynamo 1.6.1 maps `Disconnected` to
    `backend.disconnected`, which the frontend's request migration re-sends (prefill on a live
    worker, then decode) without quarantining this healthy decode worker; past
    `migration_limit` the client gets a 503. Its `WorkerUnavailable` is for frontend engines:
    raised here it becomes `backend.unknown`, a plain 500 (measured, 2026-12-02). A malformed
    handle (KeyError / TypeError / ValueError reading it) is not retried: `Unknown`, naming it."""
    from dynamo.llm.exceptions import Disconnected, Unknown

    if not isinstance(exc, KvTransferError):  # a handle missing or mistyping a field: a
        # prefill worker of another version or a bug; a fresh prefill would fail the same way
        log.error("request %s: malformed KV handle from the prefill worker (%s: %s)", rid,
                  type(exc).__name__, exc)
        return Unknown(f"request {rid}: the KV handle from the prefill worker is malformed "
                       f"({type(exc).__name__}: {exc}); are the prefill and decode workers "
                       "of one beam-trt version?")
    log.warning("request %s: KV handoff failed (%s); ending it for the frontend to migrate",
                rid, exc)
    return Disconnected(f"request {rid}: KV handoff from the prefill worker failed: {exc}; "
                        "retry the request")
