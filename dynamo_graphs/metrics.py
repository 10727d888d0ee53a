"""The worker's state as Prometheus metrics on its Dynamo system endpoint (`/metrics`).

`BeamCollector` reads the worker's snapshot (engine counters plus the worker's own: requests
in flight, handoffs, transfers, tiers) at scrape time, so a scrape is never stale and costs
nothing between scrapes. `register(metrics, snapshot)` bridges it into the runtime's `/metrics`
output (Dynamo adds the namespace / component / endpoint / worker labels). Names and meanings
are listed in docs/SERVING.md ("Metrics").
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

PREFIX = "beam_"


def _gauge(name: str, doc: str, labels=(), samples=()):
    from prometheus_client.core import GaugeMetricFamily

    fam = GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))
    for values, value in samples:
        fam.add_metric(list(values), float(value))
    return fam


def _counter(name: str, doc: str, labels=(), samples=()):
    from prometheus_client.core import CounterMetricFamily

    fam = CounterMetricFamily(PREFIX + name, doc, labels=list(labels))
    for values, value in samples:
        fam.add_metric(list(values), float(value))
    return fam


class BeamCollector:
    """prometheus_client collector over `snapshot()` (a LoadReporter snapshot dict)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self.snapshot = snapshot

    def collect(self) -> Iterator:
        s = self.snapshot()
        used, total = s["kv_used_blocks"], s["kv_total_blocks"]
        yield _gauge("kv_blocks", "Full-attention KV blocks by state (cached = free but "
                     "holding a reusable prefix; pinned/reserved are part of used)", ["state"],
                     [(("used",), used), (("free",), total - used),
                      (("cached",), s["kv_cached_blocks"]), (("pinned",), s["kv_pinned_blocks"]),
                      (("reserved",), s["kv_reserved_blocks"]), (("total",), total)])
        rows_total, rows_free = s["ring_rows_total"], s["ring_rows_free"]
        yield _gauge("ring_rows", "Sliding-window ring rows by state", ["state"],
                     [(("used",), rows_total - rows_free), (("free",), rows_free),
                      (("total",), rows_total)])
        yield _gauge("requests_in_flight", "Requests inside this worker's generate()",
                     samples=[((), s["in_flight"])])
        yield _gauge("requests_running", "Requests in the engine's running batch",
                     samples=[((), s["num_running"])])
        yield _gauge("requests_queued", "Requests waiting for KV or a batch slot",
                     samples=[((), s["num_waiting"])])
        yield _counter("requests_ended", "Requests ended, by how", ["how"],
                       [((how,), n) for how, n in sorted(s["ended"].items())])
        yield _counter("preemptions", "Running requests preempted for KV blocks",
                       samples=[((), s["preemptions"])])
        yield _counter("prefix_hit_blocks", "KV blocks served from the prefix cache",
                       samples=[((), s["prefix_hits"])])
        yield from _spec_metrics(s)
        yield from _handoff_metrics(s)
        yield from _tier_metrics(s.get("tiers"))


def _spec_metrics(s: dict) -> Iterator:
    if "spec_verify_steps" not in s:  # drafts off
        return
    yield _counter("spec_verify_steps", "Per-request verify steps of speculative decoding",
                   samples=[((), s["spec_verify_steps"])])
    yield _counter("spec_draft_tokens", "Draft tokens verified, by outcome", ["outcome"],
                   [(("drafted",), s["spec_drafted_tokens"]),
                    (("accepted",), s["spec_accepted_tokens"])])
    steps = s["spec_verify_steps"]
    mean = (s["spec_accepted_tokens"] + steps) / steps if steps else 0.0
    yield _gauge("spec_mean_acceptance_length", "Tokens committed per verify step (accepted "
                 "drafts + the correction or bonus token), since start", samples=[((), mean)])


def _handoff_metrics(s: dict) -> Iterator:
    handoff = s.get("handoff")
    if handoff is not None:  # prefill worker
        yield _gauge("handoffs_in_flight", "Prompts whose KV is pinned for a decode worker",
                     samples=[((), s.get("pinned", 0))])
        yield _counter("handoffs", "KV handoffs by outcome (timed_out: no decode worker read "
                       "it within kv_handoff_ttl_s)", ["outcome"],
                       [(("exported",), handoff["exported"]),
                        (("done",), handoff["released_done"]),
                        (("declined",), handoff["released_failed"]),
                        (("timed_out",), handoff["released_ttl"])])
    transfers = s.get("transfers")
    if transfers is not None:  # decode worker
        yield _gauge("handoffs_in_flight", "KV READs in progress from prefill workers",
                     samples=[((), transfers.get("in_flight", 0))])
        yield _counter("kv_transfers", "KV READs by outcome", ["outcome"],
                       [(("pulled",), transfers["pulled"]), (("failed",), transfers["failed"]),
                        (("declined",), transfers.get("declined", 0))])
        yield _counter("kv_transfer_bytes", "Bytes of KV read from prefill workers",
                       samples=[((), transfers["bytes"])])


def _tier_metrics(tiers: dict | None) -> Iterator:
    if tiers is None:
        return
    yield _gauge("kv_tier_bytes", "Bytes held in each KV offload tier", ["tier"],
                 [(("host",), tiers["host_bytes"]), (("disk",), tiers["disk_bytes"])])
    yield _gauge("kv_tier_blocks", "KV blocks held in each offload tier", ["tier"],
                 [(("host",), tiers["host_blocks"]), (("disk",), tiers["disk_blocks"])])
    yield _counter("kv_tier_hits", "Prefix-cache misses served by each offload tier",
                   ["tier"], [(("host",), tiers["host_hits"]), (("disk",), tiers["disk_hits"])])
    yield _counter("kv_tier_misses", "Prefix-cache misses no tier could serve",
                   samples=[((), tiers["misses"])])
    yield _counter("kv_tier_offloaded", "Evicted blocks written to the host tier",
                   samples=[((), tiers["offloaded"])])


def register(metrics, snapshot: Callable[[], dict[str, Any]]) -> None:
    """Serve `BeamCollector(snapshot)` on the worker's system endpoint `/metrics`."""
    from prometheus_client import CollectorRegistry

    from dynamo.common.backend.metrics import register_engine_registry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(BeamCollector(snapshot))
    register_engine_registry(metrics, registry, prefix_filters=[PREFIX])
