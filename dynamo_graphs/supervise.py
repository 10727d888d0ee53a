"""Keeping a launched graph serving: a dead worker is restarted, bounded, with backoff, logged.

Once the graph is ready the launcher's `Supervisor` watches every process. A worker that
exits is restarted under the same name, system port, log file and status file after
`restarts.backoff_s` (doubled each time, capped at `max_backoff_s`), at most `restarts.max`
times per `restarts.window_s`; meanwhile the graph serves on the other workers (Dynamo's
request migration re-sends the streams the dead worker held, `frontend.migration_limit`).
Before the restart its discovery entries are removed, so the router stops picking a dead
instance at once and the new one is counted only once it has registered itself. The frontend
is not restarted (clients hold connections to it): its death, a worker past its restart
budget, or a restart that does not register within `startup_s`, stop the graph with an error
naming the component and showing its log tail.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from .commands import count_instances, signal_group


def forget_instance(discovery: Path, worker_id: int) -> int:
    """Remove a dead worker's file-discovery entries (keys end with its id in hex)."""
    suffix = f"{worker_id:x}"
    removed = 0
    for path in list(discovery.rglob("*")):
        if path.is_file() and unquote(path.name).rsplit("/", 1)[-1] == suffix:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _status(run_dir: Path, name: str) -> dict:
    try:
        return json.loads((run_dir / "status" / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}


@dataclass
class Revival:
    """One dead worker on its way back."""

    comp: object  # the dead (or restarting) launch.Component
    died: float  # when the first death was seen
    due: float = 0.0  # when to start it again (backoff)
    started: float | None = None  # when the new process was started


class Supervisor:
    """One thread does it all, because PR_SET_PDEATHSIG ties a child to the thread that
    started it: a process started from a short-lived thread is killed when that thread ends."""

    def __init__(self, running, poll_s: float = 0.1):
        self.running, self.poll_s = running, poll_s
        self.policy = running.graph.restarts
        self.history: dict[str, deque] = {}  # worker -> times of its restarts
        self.events: list[dict] = []  # one per restart: worker, exit code, seconds to be back
        self._reviving: dict[str, Revival] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="beam-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    @property
    def restarting(self) -> list[str]:
        return sorted(self._reviving)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s) and self.running.failure is None:
            now = time.monotonic()
            for comp in list(self.running.components.values()):
                if comp.name in self._reviving or comp.proc.poll() is None:
                    continue
                if comp.name == "frontend":
                    self.running.death_error(comp, "; the frontend is not restarted")
                    return
                self._schedule(Revival(comp, now))
            for rev in list(self._reviving.values()):
                self._advance(rev, now)

    def _schedule(self, rev: Revival) -> None:
        """Plan the next start of a dead worker after its backoff, or fail the graph."""
        comp, now = rev.comp, time.monotonic()
        times = self.history.setdefault(comp.name, deque())
        while times and now - times[0] > self.policy.window_s:
            times.popleft()
        if len(times) >= self.policy.max:
            self.running.death_error(comp, f"; not restarted: {len(times)} restarts within "
                                     f"{self.policy.window_s:.0f} s (restarts.max "
                                     f"{self.policy.max})")
            return
        times.append(now)
        delay = min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** (len(times) - 1))
        rev.due, rev.started = now + delay, None
        self._reviving[comp.name] = rev
        self._forget(comp)
        self.running.echo_line(f"worker {comp.name} exited with code {comp.proc.returncode}; "
                               f"restart {len(times)}/{self.policy.max} in {delay:.1f} s")

    def _advance(self, rev: Revival, now: float) -> None:
        if rev.started is None:
            if now >= rev.due:
                rev.comp = self.running.start_component(rev.comp.name, rev.comp.argv,
                                                        rev.comp.system_port)
                rev.started = now
            return
        comp = rev.comp
        too_late = now - rev.started > self.running.graph.timeouts.startup_s
        if comp.proc.poll() is None and too_late:

            signal_group(comp.proc, signal.SIGKILL)  # never registered: count it as dead
            comp.proc.wait(timeout=5)
        if comp.proc.poll() is not None:
            del self._reviving[comp.name]
            self._schedule(rev)
        elif self._registered(comp):
            del self._reviving[comp.name]
            back = now - rev.died
            self.events.append({"worker": comp.name, "back_s": back})
            self.running.echo_line(f"worker {comp.name} is back after {back:.1f} s")

    def _forget(self, comp) -> None:
        worker_id = _status(self.running.run_dir, comp.name).get("worker_id")
        if worker_id:
            forget_instance(self.running.run_dir / "discovery", int(worker_id))

    def _registered(self, comp) -> bool:
        """The restarted process wrote its status and its group is complete in discovery."""

        graph = self.running.graph
        group = comp.name.rsplit("-", 1)[0]
        expected = next(w.count for w in graph.workers if w.name == group)
        if _status(self.running.run_dir, comp.name).get("pid") != comp.proc.pid:
            return False
        return count_instances(self.running.run_dir / "discovery",
                               graph.namespace).get(group, 0) >= expected
