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
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
from dynamo.common.backend.health_check import build_health_check_payload, is_probe
from dynamo.common.backend.publisher import PushSource
from dynamo.common.constants import DisaggregationMode
from dynamo.llm.exceptions import InvalidArgument, Unknown

from .admission import AdmissionError, Limits, check_admission
from .disagg import handoff_failed
from .engine_loop import ABORTED, EngineLoop, RateLimiter
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
    p.add_argument("--speculative", default=None, help="the graph's speculative block as JSON "
                   "(false: drafts off; absent: on when the engine dir has a drafter)")
    p.add_argument("--batch-invariant", action="store_true", help="every decode and verify "
                   "step at one shape, never beside a prefill chunk (docs/ENGINE.md)")
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
        self._by_context: dict[str, RequestSlot] = {}  # Dynamo context id -> its request
        self._slots: dict[str, RequestSlot] = {}  # every request inside generate()
        self.ended: dict[str, int] = {"finished": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.limits: Limits | None = None
        self._stop = asyncio.Event()
        self._poller: asyncio.Task | None = None
        self._ids = 0
        self.worker_id = 0

    @classmethod
    async def from_args(cls, argv=None):
        args = parse_args(argv)
        args.device = _claim_device(args.device)
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
        from beam_trtllm.engine.parallel.group import open_engine

        self.worker_id = worker_id
        t0 = time.monotonic()
        # a parallel engine dir: this worker is rank 0 of its TP/EP group and starts the others
        self.engine = await asyncio.to_thread(open_engine, self.args.engine_dir,
                                              self.args.device, _speculative(self.args),
                                              self.args.batch_invariant)
        # The first forward pays one-time costs (op registration, allocator, torch.compile
        # wrappers): pay them here, not in the first user's TTFT. 3 tokens fill no block, so
        # the warm-up leaves no cached KV and emits no KV events.
        await asyncio.to_thread(self._warm_up)
        self.engine.set_kv_event_sink(self.events)
        self._start_offload()
        self._start_disagg(worker_id)
        self.limits = Limits(self.engine.options.max_seq_len,
                             self.args.max_isl if self.role == "prefill" else None)
        self.reporter = LoadReporter(self.engine, self.args.status_file, self._extra_status)
        self.loop = EngineLoop(self.engine, on_step=RateLimiter(self.reporter, 0.05))
        self.loop.start()
        opts, plan = self.engine.options, self.engine.kv_plan
        log.info("beam worker %s (%s) on %s ready in %.1f s: %d KV blocks of %d tokens, "
                 "%d sequences, max_seq_len %d", self.args.component, self.role,
                 self.engine.device, time.monotonic() - t0, plan.num_blocks, plan.block_size,
                 opts.max_batch, opts.max_seq_len)
        # The chat processor in the frontend checks prompts against these before routing
        # (beam_trtllm/chat/limits.py): context_length and the graph's max_isl.
        runtime_data = {} if self.args.max_isl is None else {"beam_max_isl": self.args.max_isl}
        return EngineConfig(
            model=str(self.args.engine_dir.resolve()), served_model_name=self.args.served_model_name,
            runtime_data=runtime_data,
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
            self._poller = asyncio.get_running_loop().create_task(
                self.decode.run_progress(self._stop))

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
        if self.engine is not None and hasattr(self.engine, "followers"):
            self.engine.close()  # a TP/EP rank group: stop its other ranks

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

    async def register_prometheus(self, metrics) -> None:
        from .metrics import register

        register(metrics, self.reporter.snapshot)

    def _extra_status(self) -> dict:
        out = {"role": self.role, "worker_id": self.worker_id, "pid": os.getpid(),
               "component": self.args.component, "in_flight": len(self._slots),
               "ended": dict(self.ended), "kv_events": dict(self.events.counts)}
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
        slot = self._by_context.get(context.id())
        if slot is not None and self.loop is not None:
            self.loop.abort(slot.rid)

    async def generate(self, request, context):
        self._ids += 1
        slot = RequestSlot(f"{context.id()}-{self._ids}", is_probe(request))
        prompt = [int(t) for t in request["token_ids"]]
        handle = self._incoming_handle(request)
        try:
            sampling = sampling_params(request, self.limits.max_seq_len, self.role)
            check_admission(context.id(), len(prompt), sampling.max_tokens, self.role,
                            self.limits)
        except ValueError as exc:  # AdmissionError, EngineError: both subclass ValueError
            self._count("rejected")
            if handle is not None:  # the prefill worker holds this prompt's KV: free it now
                await self.decode.decline(handle)
            raise InvalidArgument(str(exc) if isinstance(exc, AdmissionError)
                                  else f"request {context.id()}: {exc}") from None
        self._by_context[context.id()] = self._slots[slot.rid] = slot
        try:
            add, cached = await self._admission(slot, prompt, sampling, handle)
            pending = self.loop.submit(slot.rid, add)
            first_lp = (handle or {}).get("first_logprobs")  # decode: the prefill's token's
            async for chunk in self._stream(slot, pending, context.id(), cached, first_lp):
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):  # the stream was dropped
            slot.how = "cancelled"
            raise
        finally:
            self._end(context.id(), slot)

    async def _stream(self, slot, pending, request_id: str, cached, first_lp=None):
        generated = 0
        while not slot.finished:
            item = await pending.queue.get()
            if item is ABORTED:  # cancelled: its KV is already freed
                slot.how = "cancelled"
                return
            if isinstance(item, BaseException):
                raise _dynamo_error(item, request_id)
            generated += len(item.new_token_ids)
            if cached is not None:  # decode: the prefix cache hit happened on prefill
                item.num_cached_tokens = cached
            # A response parser hooks in here: `item` is the engine's output, `chunk` the wire.
            chunk = output_chunk(item, generated)
            if first_lp and chunk["token_ids"] and "log_probs" not in chunk:
                chunk.update(first_lp)  # the first token was sampled (and scored) on prefill
                first_lp = None
            if item.finished and item.finish_reason == "error":
                raise Unknown(f"request {request_id}: engine error: {item.error}")
            slot.finished = item.finished
            if (slot.finished and self.prefill is not None and item.finish_reason != "abort"
                    and not slot.probe):  # a health probe leaves nothing pinned
                chunk["disaggregated_params"] = self.prefill.export(slot.rid)
                chunk["disaggregated_params"]["cached_tokens"] = item.num_cached_tokens
                chunk["disaggregated_params"]["first_logprobs"] = {
                    k: chunk[k] for k in ("log_probs", "top_logprobs") if k in chunk}
                slot.exported = True
            yield chunk

    def _end(self, context_id: str, slot: "RequestSlot") -> None:
        """The one cleanup of every request, however it ended (finished, cancelled by the
        client or the frontend, failed, or its stream dropped): nothing of it stays."""
        self._slots.pop(slot.rid, None)
        if self._by_context.get(context_id) is slot:
            del self._by_context[context_id]
        if not slot.finished:
            if self.loop is not None:
                self.loop.abort(slot.rid)  # frees running / waiting / pinned / reserved KV
            how = slot.how or "failed"
        else:
            if self.prefill is not None and not slot.exported and not slot.probe:
                self.engine.release(slot.rid)  # finished but never handed over
            how = "finished"
        self._count(how)

    def _count(self, how: str) -> None:
        self.ended[how] = self.ended.get(how, 0) + 1

    def _incoming_handle(self, request) -> dict | None:
        """Decode role: the prefill worker's KV handle this request carries, if any."""
        if self.role != "decode" or is_probe(request):
            return None
        return ((request.get("prefill_result") or {}).get("disaggregated_params")) or None

    async def _admission(self, slot, prompt, sampling, handle):
        """The engine call that queues this request (run later in the step thread), and the
        prompt tokens the prefill worker's cache served (decode role), else None."""
        engine, rid = self.engine, slot.rid
        if self.role == "prefill" and not slot.probe:
            return lambda: engine.add_request(rid, prompt, sampling, prefill_only=True), None
        if self.role == "decode" and handle is not None:
            try:
                reserved = await self.decode.pull(rid, prompt, handle)
            except (KvTransferError, KeyError, TypeError, ValueError) as exc:
                if self.args.on_transfer_failure != "recompute":
                    raise handoff_failed(rid, exc) from None
                log.warning("request %s: KV handoff failed (%s); recomputing the prompt", rid, exc)
            else:
                return (lambda: engine.add_request(rid, prompt, sampling, kv_reserved=reserved),
                        int(handle.get("cached_tokens") or 0))
        return lambda: engine.add_request(rid, prompt, sampling), None


@dataclass
class RequestSlot:
    """One request inside generate(): what its cleanup must undo."""

    rid: str
    probe: bool
    finished: bool = False
    exported: bool = False  # prefill: its KV was handed to a decode worker
    how: str | None = None  # how it ended, when not finished


def _dynamo_error(exc: BaseException, request_id: str) -> Exception:
    from beam_trtllm.engine.types import EngineError

    if isinstance(exc, EngineError):  # its message already names the request
        return InvalidArgument(str(exc))
    return Unknown(f"request {request_id}: {exc}")


def _claim_device(device: str | None) -> str:
    """--device resolved (default: cuda if available), and made what Dynamo reports.

    Dynamo 1.6.1 records every endpoint instance's `device_type` (discovery, hence the
    frontend's `/health` and its device-aware router) from the environment alone: `cpu` only
    when CUDA_VISIBLE_DEVICES is empty / -1 / none / void (or NVIDIA_VISIBLE_DEVICES is
    none / void), else `cuda` (dynamo_runtime::component::endpoint::endpoint_device_type).
    A CPU worker therefore hides the GPUs from itself before its endpoints register; it
    uses none of them anyway.
    """
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    return device


def main() -> None:
    from dynamo.common.backend.run import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(BeamWorker)


def _speculative(args):
    """--speculative JSON -> Engine.from_dir's `speculative` (None: the engine dir decides)."""
    if args.speculative is None:
        return None
    from beam_trtllm.engine.speculative import SpecConfig

    raw = json.loads(args.speculative)
    return SpecConfig.from_json(raw, "--speculative") or False


if __name__ == "__main__":
    main()

