"""One thread that drives `Engine.step()` and fans each request's outputs out to asyncio.

The engine is synchronous and batches every running request into one step; the Dynamo
worker is asyncio and serves many concurrent `generate()` calls. `EngineLoop` joins the two:
`submit()` queues a request (the step thread adds it, so the engine is only ever called
from one thread besides its own lock-protected entry points), each step's `RequestOutput`s go
to that request's asyncio queue, and the step thread sleeps on a condition while idle.
KV events reach the installed sink from the step thread (see worker_events.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("beam.worker")


class Aborted:
    """The queue item of a request aborted by `EngineLoop.abort` (its KV is already freed)."""

    def __repr__(self) -> str:
        return "ABORTED"


ABORTED = Aborted()


@dataclass
class Pending:
    """One request between submit() and its last output."""

    request_id: str
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    add: Callable[[], None]  # calls engine.add_request (in the step thread)
    done: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


class EngineLoop:
    def __init__(self, engine, on_step: Callable[[], None] | None = None, idle_s: float = 0.05):
        self.engine = engine
        self.on_step = on_step  # e.g. publish a load snapshot; runs in the step thread
        self.idle_s = idle_s
        self._pending: dict[str, Pending] = {}
        self._incoming: list[Pending] = []
        self._aborts: list[str] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="beam-engine-step", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ asyncio side
    def submit(self, request_id: str, add: Callable[[], None]) -> Pending:
        """Queue `add()` (which must call engine.add_request(request_id, ...)); outputs of the
        request then arrive on the returned Pending's queue (an exception item = failed)."""
        if self.error is not None:
            raise RuntimeError(f"the engine step loop died: {self.error}")
        loop = asyncio.get_running_loop()
        p = Pending(request_id, asyncio.Queue(), loop, add)
        with self._cond:
            self._incoming.append(p)
            self._cond.notify_all()
        return p

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify_all()

    # ------------------------------------------------------------------ step thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stop or self._incoming or self._aborts
                               or self.engine.has_unfinished()):
                        self._cond.wait(self.idle_s)
                        if self.on_step is not None:
                            self.on_step()
                    if self._stop:
                        break
                    incoming, self._incoming = self._incoming, []
                    aborts, self._aborts = self._aborts, []
                self._admit(incoming)
                for rid in aborts:
                    self.engine.abort(rid)
                    # Wake its waiter: a generate() whose client left must still run its
                    # cleanup instead of waiting on the queue forever (the in-flight leak).
                    self._finish(rid, ABORTED)
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    self._deliver(outputs)
                    if not outputs and not self.engine.scheduler.running:
                        self._wait_blocked()
                if self.on_step is not None:
                    self.on_step()
        except BaseException as exc:  # noqa: BLE001 - fail every waiter loudly, not hang them
            log.exception("engine step loop died")
            self.error = exc
            for p in list(self._pending.values()):
                self._put(p, RuntimeError(f"the engine step loop died: {exc}"))

    def _wait_blocked(self, wait_s: float = 0.005) -> None:
        """Requests wait for KV or a ring row and none runs: sleep a little instead of
        spinning a core until an abort, a release or a new request changes that."""
        with self._cond:
            if not (self._stop or self._incoming or self._aborts):
                self._cond.wait(wait_s)

    def _admit(self, incoming: list[Pending]) -> None:
        for p in incoming:
            try:
                p.add()
            except Exception as exc:  # noqa: BLE001 - EngineError etc. go to the caller
                self._put(p, exc)
                continue
            self._pending[p.request_id] = p

    def _deliver(self, outputs) -> None:
        # One wake-up of each event loop per step, not one per token (the loop thread and this
        # one share the GIL and, on small machines, the cores).
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            p = self._pending.get(out.request_id)
            if p is None:
                continue  # aborted meanwhile
            batches.setdefault(p.loop, []).append((p.queue, out))
            if out.finished:
                self._pending.pop(out.request_id, None)
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed: the worker is shutting down
                pass

    def _finish(self, rid: str, item) -> None:
        p = self._pending.pop(rid, None)
        if p is not None and item is not None:
            self._put(p, item)

    @staticmethod
    def _put(p: Pending, item) -> None:
        try:
            p.loop.call_soon_threadsafe(p.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the worker is shutting down
            pass

    @property
    def num_pending(self) -> int:
        return len(self._pending)


def _put_all(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class RateLimiter:
    """Calls `fn` at most every `period_s` (load snapshots must not cost a step)."""

    def __init__(self, fn: Callable[[], None], period_s: float):
        self.fn, self.period_s, self._last = fn, period_s, 0.0

    def __call__(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.period_s:
            self._last = now
            self.fn()
