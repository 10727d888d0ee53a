"""The Beam Dynamo worker: `python -m dynamo_graphs.worker --engine-dir DIR --role agg|prefill|decode`.

A `dynamo.common.backend.LLMEngine` over `beam_trtllm.engine.Engine`. It registers the
model (context length, block size, KV capacity), streams tokens, honours cancellation,
publishes the engine's KV events (real token ids per block) and load snapshots, and in the
prefill / decode roles hands the prompt's KV over with NIXL (disagg.py). With offload tiers
the engine's evicted blocks go to host memory then disk (offload.py) and come back on a
prefix miss. Its counters (KV blocks used, pins, reservations, tier hits) go to a status
file the launcher and tests read.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from pathlib import Path

from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
from dynamo.common.backend.disagg import require_prefill_result
from dynamo.common.backend.health_check import build_health_check_payload, is_probe
from dynamo.common.backend.publisher import PushSource
from dynamo.common.constants import DisaggregationMode
from dynamo.llm.exceptions import InvalidArgument, Unknown

from .engine_loop import EngineLoop, RateLimiter
from .graph import MIB, Timeouts
from .nixl_kv import KvTransferError
from .requests import output_chunk, sampling_params
from .worker_events import KvEventForwarder, LoadReporter

log = logging.getLogger("beam.worker")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Beam Dynamo worker")
    p.add_argument("--engine-dir", required=True, type=Path)
    p.add_argument("--role", choices=["agg", "prefill", "decode"], default="agg")
    p.add_argument("--served-model-name", default="beam")
    p.add_argument("--namespace", default="beam")
    p.add_argument("--component", default="backend")
    p.add_argument("--device", default=None, help="cpu | cuda[:N] (default: cuda if available)")
    p.add_argument("--kv-transfer-base-s", type=float, default=Timeouts.kv_transfer_base_s)
    p.add_argument("--kv-transfer-min-mib-s", type=float, default=Timeouts.kv_transfer_min_mib_s)
    p.add_argument("--kv-handoff-ttl-s", type=float, default=Timeouts.kv_handoff_ttl_s)
    p.add_argument("--on-transfer-failure", choices=["error", "recompute"], default="error")
    p.add_argument("--max-isl", type=int, default=None)
    p.add_argument("--offload-host-mib", type=float, default=0.0)
    p.add_argument("--offload-disk-mib", type=float, default=0.0)
    p.add_argument("--offload-disk-dir", type=Path, default=None)
    p.add_argument("--status-file", type=Path, default=None)
    return p.parse_args(argv)


class BeamWorker(LLMEngine):
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.role = args.role
        self.timeouts = Timeouts(kv_transfer_base_s=args.kv_transfer_base_s,
                                 kv_transfer_min_mib_s=args.kv_transfer_min_mib_s,
                                 kv_handoff_ttl_s=args.kv_handoff_ttl_s)
        self.engine = self.loop = self.transport = self.tiers = None
        self.prefill = self.decode = None
        self.events = KvEventForwarder()
        self.reporter: LoadReporter | None = None
        self._by_context: dict[str, str] = {}
        self._stop = asyncio.Event()
        self._poller: asyncio.Task | None = None
        self._ids = 0
        self.worker_id = 0

    @classmethod
    async def from_args(cls, argv=None):
        args = parse_args(argv)
        worker = cls(args)
        config = WorkerConfig(
            namespace=args.namespace, component=args.component, endpoint="generate",
            model_name=str(args.engine_dir.resolve()), served_model_name=args.served_model_name,
            discovery_backend=os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
            request_plane=os.environ.get("DYN_REQUEST_PLANE", "tcp"),
            event_plane=os.environ.get("DYN_EVENT_PLANE"),
            disaggregation_mode=DisaggregationMode(args.role))
        return worker, config

    # ------------------------------------------------------------------ lifecycle
    async def start(self, worker_id: int) -> EngineConfig:
        from beam_trtllm.engine.engine import Engine

        self.worker_id = worker_id
        t0 = time.monotonic()
        self.engine = await asyncio.to_thread(Engine.from_dir, self.args.engine_dir,
                                              self.args.device)
        # The first forward pays one-time costs (op registration, allocator, torch.compile
        # wrappers): pay them here, not in the first user's TTFT. 3 tokens fill no block, so
        # the warm-up leaves no cached KV and emits no KV events.
        await asyncio.to_thread(self._warm_up)
        self.engine.set_kv_event_sink(self.events)
        self._start_offload()
        self._start_disagg(worker_id)
        self.reporter = LoadReporter(self.engine, self.args.status_file, self._extra_status)
        self.loop = EngineLoop(self.engine, on_step=RateLimiter(self.reporter, 0.05))
        self.loop.start()
        opts, plan = self.engine.options, self.engine.kv_plan
        log.info("beam worker %s (%s) ready in %.1f s: %d KV blocks of %d tokens, %d sequences, "
                 "max_seq_len %d", self.args.component, self.role, time.monotonic() - t0,
                 plan.num_blocks, plan.block_size, opts.max_batch, opts.max_seq_len)
        return EngineConfig(
            model=str(self.args.engine_dir.resolve()), served_model_name=self.args.served_model_name,
            llm=LlmRegistration(context_length=opts.max_seq_len,
                                kv_cache_block_size=plan.block_size,
                                total_kv_blocks=plan.num_blocks, max_num_seqs=opts.max_batch,
                                max_num_batched_tokens=opts.max_num_tokens))

    def _warm_up(self) -> None:
        from beam_trtllm.engine.types import SamplingParams

        bos = self.engine.cfg.bos_token_id or 0
        self.engine.generate([[bos, bos, bos]], SamplingParams(max_tokens=2, ignore_eos=True))

    def _start_offload(self) -> None:
        if not self.args.offload_host_mib:
            return
        from .offload import KvTiers

        self.tiers = KvTiers(int(self.args.offload_host_mib * MIB),
                             int(self.args.offload_disk_mib * MIB), self.args.offload_disk_dir)
        self.engine.set_kv_tier(offload=self.tiers.offload, fetch=self.tiers.fetch)

    def _start_disagg(self, worker_id: int) -> None:
        if self.role == "agg":
            return
        from .disagg import DecodeSide, PrefillSide, cache_tensors
        from .nixl_kv import NixlKvTransport

        name = f"beam-{self.args.namespace}-{self.args.component}-{worker_id:x}-{os.getpid()}"
        self.transport = NixlKvTransport(name, cache_tensors(self.engine))
        if self.role == "prefill":
            self.prefill = PrefillSide(self.engine, self.transport, self.timeouts.kv_handoff_ttl_s)
            self._poller = asyncio.get_running_loop().create_task(
                self.prefill.run_poller(self._stop))
        else:
            self.decode = DecodeSide(self.engine, self.transport, self.timeouts)

    async def cleanup(self) -> None:
        self._stop.set()
        if self._poller is not None:
            await asyncio.wait([self._poller], timeout=2)
        if self.loop is not None:
            self.loop.stop()
            self.loop = None
        if self.prefill is not None:
            self.prefill.release_all()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.reporter is not None and self.engine is not None:
            self.reporter()

    async def is_quiescent(self):
        return self.prefill is None or not self.prefill.pinned

    # ------------------------------------------------------------------ router surfaces
    async def kv_event_sources(self):
        return [PushSource(on_ready=self.events.set_publisher, dp_rank=0)]

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher) -> None:
        if self.reporter is not None:
            self.reporter.publisher = publisher

    async def health_check_payload(self):
        return build_health_check_payload(bos_token_id=self.engine.cfg.bos_token_id or 0)

    def _extra_status(self) -> dict:
        out = {"role": self.role, "worker_id": self.worker_id, "pid": os.getpid(),
               "component": self.args.component, "in_flight": len(self._by_context),
               "kv_events": dict(self.events.counts)}
        if self.prefill is not None:
            out["pinned"] = len(self.prefill.pinned)
            out["handoff"] = dict(self.prefill.stats)
        if self.decode is not None:
            out["transfers"] = dict(self.decode.stats)
        if self.tiers is not None:
            out["tiers"] = self.tiers.usage()
        return out

    # ------------------------------------------------------------------ requests
    async def abort(self, context) -> None:
        rid = self._by_context.get(context.id())
        if rid is not None and self.loop is not None:
            self.loop.abort(rid)

    async def generate(self, request, context):
        self._ids += 1
        rid = f"{context.id()}-{self._ids}"
        prompt = [int(t) for t in request["token_ids"]]
        max_seq_len = self.engine.options.max_seq_len
        try:
            sampling = sampling_params(request, max_seq_len, self.role)
        except ValueError as exc:  # EngineError subclasses ValueError
            raise InvalidArgument(f"request {context.id()}: {exc}") from None
        if self.role != "prefill" and len(prompt) + sampling.max_tokens > max_seq_len:
            raise InvalidArgument(
                f"request {context.id()}: {len(prompt)} prompt tokens + max_tokens "
                f"{sampling.max_tokens} exceed the context length {max_seq_len}")
        add, cached = await self._admission(rid, prompt, sampling, request)
        self._by_context[context.id()] = rid
        pending = self.loop.submit(rid, add)
        finished = exported = False
        generated = 0
        try:
            while not finished:
                item = await pending.queue.get()
                if isinstance(item, BaseException):
                    raise _dynamo_error(item, context.id())
                generated += len(item.new_token_ids)
                if cached is not None:  # decode: the prefix cache hit happened on prefill
                    item.num_cached_tokens = cached
                chunk = output_chunk(item, generated)
                finished = item.finished
                if finished and item.finish_reason == "error":
                    raise Unknown(f"request {context.id()}: engine error: {item.error}")
                if (finished and self.prefill is not None and item.finish_reason != "abort"
                        and not is_probe(request)):  # a health probe leaves nothing pinned
                    chunk["disaggregated_params"] = self.prefill.export(rid)
                    chunk["disaggregated_params"]["cached_tokens"] = item.num_cached_tokens
                    exported = True
                yield chunk
        finally:
            self._by_context.pop(context.id(), None)
            if not finished:
                self.loop.abort(rid)  # cancelled or failed mid-stream: free its KV now
            elif self.prefill is not None and not exported and not is_probe(request):
                self.engine.release(rid)  # finished but never handed over

    async def _admission(self, rid, prompt, sampling, request):
        """The engine call that queues this request (run later in the step thread), and the
        prompt tokens the prefill worker's cache served (decode role), else None."""
        engine = self.engine
        if self.role == "prefill" and not is_probe(request):
            return lambda: engine.add_request(rid, prompt, sampling, prefill_only=True), None
        if self.role == "decode" and not is_probe(request):
            try:
                params = require_prefill_result(request, DisaggregationMode.DECODE)
                handle = params.get("disaggregated_params") or {}
                reserved = await self.decode.pull(rid, prompt, handle)
            except (KvTransferError, KeyError, TypeError, ValueError) as exc:
                if self.args.on_transfer_failure != "recompute":
                    raise Unknown(f"request {rid}: KV handoff from the prefill worker failed: "
                                  f"{exc}") from None
                log.warning("request %s: KV handoff failed (%s); recomputing the prompt", rid, exc)
            else:
                return (lambda: engine.add_request(rid, prompt, sampling, kv_reserved=reserved),
                        int(handle.get("cached_tokens") or 0))
        return lambda: engine.add_request(rid, prompt, sampling), None


def _dynamo_error(exc: BaseException, request_id: str) -> Exception:
    from beam_trtllm.engine.types import EngineError

    if isinstance(exc, EngineError):  # its message already names the request
        return InvalidArgument(str(exc))
    return Unknown(f"request {request_id}: {exc}")


def main() -> None:
    from dynamo.common.backend.run import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(BeamWorker)


if __name__ == "__main__":
    main()
