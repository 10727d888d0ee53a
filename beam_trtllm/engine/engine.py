"""`Engine`: the runtime API servers and scripts use (docs/DESIGN.md §4).

    engine = Engine.from_dir(path)
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step(): ...

One `step()` schedules (scheduler.py), builds the ops' index tensors (batch.py), runs the
forward (model.py; on CUDA pure decode steps replay a captured graph, graphs.py), samples
(sampler.py), applies stop conditions, makes newly full blocks reusable and hands the KV events
to the installed sink. The engine is not thread-safe by itself; every public method takes one
lock, so a server may call add_request/abort from another thread than the step loop.
"""

from __future__ import annotations

import itertools
import sys
import threading
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..config import BeamConfig
from .batch import build_step
from .block_manager import BlockManager
from .disagg import DisaggMixin
from .engine_dir import check_device, load_weights, read_engine_dir
from .kv_cache import KVCache
from .model import BeamModel
from .outputs import OutputMixin
from .overlap import OverlapMixin
from .plan import BuildOptions, KVPlan, cdiv
from .request import Request, State
from .scheduler import Scheduler
from .spec_chain import SpecChainMixin
from .speculative import DRAFT_DIR, SpecConfig, SpecDecoder, dir_draft_tokens, find_draft_dir
from .types import EngineError, KVUsage, SamplingParams


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class Engine(DisaggMixin, OutputMixin, OverlapMixin, SpecChainMixin):
    def __init__(self, cfg: BeamConfig, weights: dict[str, torch.Tensor], layer_plan: dict,
                 options: BuildOptions, kv_plan: KVPlan, device: torch.device | str = "cpu",
                 tokenizer=None, eos_token_ids: Sequence[int] = (), use_cuda_graphs: bool = True,
                 parallel=None, drafter=None, spec: "SpecConfig | None" = None,
                 overlap: bool | None = None, batch_invariant: bool | int = False):
        self.cfg, self.options, self.kv_plan = cfg, options, kv_plan
        if batch_invariant and parallel is not None:
            raise EngineError("batch_invariant runs on single-GPU engines; this is a rank of a "
                              "parallel engine (its collectives run eagerly, at the step's shape)")
        self.batch_invariant = batch_invariant
        self.parallel = parallel  # a rank of a parallel engine (parallel/rank.py), or None
        kv_cfg = cfg if parallel is None else parallel.mapping.local_config(cfg)  # its KV heads
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        k_scales, v_scales = _kv_scales(weights, cfg) if kv_plan.kv_dtype == "fp8" else ({}, {})
        num_drafts = 0
        if drafter is not None:
            spec = spec or SpecConfig()
            num_drafts = spec.tokens or drafter.cfg.num_draft_tokens
        self.kv = KVCache(kv_cfg, kv_plan.num_blocks, kv_plan.block_size, kv_plan.max_seqs,
                          kv_plan.kv_dtype, self.device, k_scales, v_scales,
                          ring_len=cfg.sliding_window + num_drafts)
        self.blocks = BlockManager(kv_plan.num_blocks, kv_plan.block_size,
                                   self.kv.read_block, self.kv.write_block)
        self.scheduler = Scheduler(self.blocks, self.kv, options.max_batch, options.max_num_tokens,
                                   len(cfg.sliding_layers), cfg.sliding_window,
                                   separate_prefill=batch_invariant)
        self.model = BeamModel(cfg, weights, layer_plan, self.kv, parallel)
        self.requests: dict[str, Request] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(0)
        self.kv_event_sink = None
        self._pending_outputs: list = []
        self._arrivals = itertools.count()
        self._lock = threading.RLock()
        self.spec = None
        if drafter is not None:
            if parallel is not None:
                raise EngineError("speculative decoding runs on single-GPU engines; this is a "
                                  "rank of a parallel engine")
            self.spec = SpecDecoder(self, drafter, num_drafts, spec.adaptive, use_cuda_graphs,
                                    spec.compile)
        self.capture = self.spec.layers if self.spec is not None else ()
        self.graphs = self.verify_graphs = None
        self._init_graphs(use_cuda_graphs)
        self.stats = {"steps": 0, "graph_steps": 0, "prompt_tokens": 0, "generated_tokens": 0,
                      "restored_tokens": 0, "preemptions": 0}
        self._init_overlap(overlap)  # decode steps launched ahead (overlap.py)
        self._init_chain()  # speculative steps launched ahead (spec_chain.py)

    @classmethod
    def from_dir(cls, path: str | Path, device: torch.device | str | None = None,
                 verify: bool = True, use_cuda_graphs: bool = True, autotune: str | None = None,
                 progress: Callable[[str], None] | None = None,
                 speculative: "SpecConfig | bool | None" = None,
                 overlap: bool | None = None, batch_invariant: bool | int = False) -> "Engine":
        """Load an engine dir; refuses a corrupt or mismatched one (see engine_dir.py). On CUDA
        the engine's tuned launch shapes are installed first (or searched, if the build left
        that to the first load; `autotune` auto | quick | off, see tuned_kernels.py), so the
        CUDA graphs capture them. `progress` gets one line per step (default: stderr).
        `speculative`: None = on if the dir has a drafter (`build --draft`), False = off, or a
        SpecConfig (speculative.py). `overlap`: launch decode steps ahead (overlap.py; None =
        on CUDA). `batch_invariant`: every decode and verify step at one shape, never beside a
        prefill chunk (docs/ENGINE.md "Batch-invariant mode"): True = max_batch x (1 + the
        dir's drafter's draft tokens) rows, drafts on or off; an int = that many rows."""
        from ..tokenizer import TextTokenizer

        device = torch.device(device) if device is not None else default_device()
        spec = read_engine_dir(path, verify=verify)
        check_device(spec, device)
        if device.type == "cuda":
            from .tuned_kernels import load_autotune

            load_autotune(spec, device, autotune, progress or _stderr)
        weights = load_weights(spec, device)
        parallel = None
        if spec.parallel is not None:  # a rank dir: torch.distributed must be up (launch.py)
            from .parallel import rank_of

            parallel = rank_of(spec, device)
        tokenizer = TextTokenizer(spec.path)
        eos = spec.cfg.eos_token_id
        eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
        sc, drafter = _speculative(spec, speculative), None
        if sc is not None:
            from ..draft import DFlash2Drafter

            drafter = DFlash2Drafter.from_dir(
                find_draft_dir(spec.path, sc), spec.cfg, weights["model.embed_tokens.weight"],
                weights["lm_head.weight"], device, weights["model.embed_tokens.weight"].dtype)
        if batch_invariant is True:  # the same rows in the dir's engines with and without drafts
            batch_invariant = spec.options.max_batch * (1 + dir_draft_tokens(spec.path, sc))
        return cls(spec.cfg, weights, spec.layer_plan, spec.options, spec.kv, device, tokenizer,
                   eos_ids, use_cuda_graphs, parallel, drafter, sc, overlap, batch_invariant)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling: SamplingParams | None = None, *, prefill_only: bool = False,
                    kv_reserved=None) -> None:
        """Queue a request. EngineError if it is malformed or could never fit; `prefill_only`
        keeps its KV after the first token for `kv_export`; `kv_reserved` (a `kv_reserve`
        handle with `first_token` set, filled by a transport) continues decoding from there."""
        with self._lock:
            sampling = sampling or SamplingParams()
            prompt = self._check_prompt(request_id, prompt_token_ids, kv_reserved is not None)
            max_total = min(len(prompt) + sampling.max_tokens, self.options.max_seq_len)
            need = cdiv(max_total - 1, self.kv_plan.block_size)
            if need > self.kv_plan.num_blocks:
                raise EngineError(
                    f"request {request_id!r}: {len(prompt)} prompt + {sampling.max_tokens} new "
                    f"tokens need {need} KV blocks, the engine has {self.kv_plan.num_blocks}; it "
                    "can never fit (lower max_tokens or rebuild with more --kv-memory)")
            req = Request(request_id, prompt, sampling, next(self._arrivals), max_total,
                          prefill_only=prefill_only)
            req.detok = self._detokenizer(req)
            if kv_reserved is not None:
                self._continue_reserved(req, kv_reserved)
            else:
                self.scheduler.add(req)
            self.requests[request_id] = req

    def _check_prompt(self, request_id: str, ids: Sequence[int], reserved: bool) -> list[int]:
        old = self.requests.get(request_id)
        if old is not None and old.state != State.FINISHED and not (reserved and old.state == State.RESERVED):
            raise EngineError(f"request {request_id!r} is already in the engine ({old.state.value})")
        prompt = [int(t) for t in ids]
        if not prompt:
            raise EngineError(f"request {request_id!r}: the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise EngineError(f"request {request_id!r}: token id {bad[0]} is outside the "
                              f"vocabulary [0, {self.cfg.vocab_size})")
        if len(prompt) >= self.options.max_seq_len:
            raise EngineError(f"request {request_id!r}: the prompt has {len(prompt)} tokens, "
                              f"--max-seq-len is {self.options.max_seq_len} (it must leave room "
                              "for at least one generated token)")
        return prompt

    def abort(self, request_id: str) -> bool:
        """Stop a request at any time and free its KV (pinned exports and reservations too).
        Returns False for an unknown or already finished request."""
        with self._lock:
            req = self.requests.get(request_id)
            if req is None or req.state == State.FINISHED:
                return False
            if req.state in (State.PINNED, State.RESERVED):
                self.scheduler.release(req)
                self.requests.pop(request_id, None)
                return True
            self._finish(req, "abort")
            return True

    def _init_graphs(self, use_cuda_graphs: bool) -> None:
        """Decode (and verify) graphs. Batch-invariant: one size, max_batch sequences, every
        step at the same rows (`from_dir`: those of the dir's most drafts, so engines with and
        without drafts match), run eagerly where nothing is captured (the CPU)."""
        options, cuda = self.options, self.device.type == "cuda"
        captured = cuda and use_cuda_graphs and bool(options.cuda_graph_batch_sizes)
        if self.parallel is not None or not (captured or self.batch_invariant):
            return  # a rank's collectives run eagerly
        from .graphs import DecodeGraphs

        counts = self.spec.verify_counts if self.spec is not None else ()
        drafts = max(counts, default=0)
        need = options.max_batch * (1 + drafts)
        sizes, rows = None, None
        if self.batch_invariant:
            sizes = (options.max_batch,)
            rows = need if self.batch_invariant is True else int(self.batch_invariant)
            if need > rows:
                raise EngineError(f"batch_invariant={rows} rows: max_batch {options.max_batch} "
                                  f"x (1 + {drafts} drafts) = {need} rows do not fit")
        after = self.spec.in_graph if self.spec is not None else None

        def graphs(q: int):
            return DecodeGraphs(self.model, options, self.kv_plan, self.cfg, self.device,
                                capture=cuda and use_cuda_graphs, sizes=sizes,
                                capture_layers=self.capture, ring_len=self.kv.ring_len,
                                tokens_per_seq=q, after=after, rows=rows)
        self.graphs = graphs(1)
        if self.spec is not None:  # verify steps: 1 + n tokens per sequence, by n
            self.verify_graphs = {n: graphs(1 + n) for n in counts}

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending_outputs)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self):
        with self._lock:
            outputs = self._pending_outputs
            self._pending_outputs = []
            outputs += self._emit_handoff_tokens()
            busy = self._inflight is not None or self._chain is not None
            chunks = self.scheduler.schedule() if not busy else None
            if self._chain is not None or (chunks and self._chainable(chunks)):
                outputs += self._chained_step(chunks)  # speculative steps on the device
            elif self._inflight is not None or (chunks and self._overlappable(chunks)):
                outputs += self._overlapped_step(chunks)
            elif chunks:
                slots = self.spec.context_slots(chunks) if self.spec is not None else None
                logits, hidden = self._forward(chunks)
                outputs += self._after_forward(chunks, logits, hidden, slots)
            elif self.parallel is not None:  # attention DP: join the other ranks' MoE
                self.parallel.idle_step(self.model)
            self._flush_events()
            self.stats["steps"] += 1
            self.stats["preemptions"] = self.scheduler.num_preemptions
            return outputs

    def _forward(self, chunks, input_ids: torch.Tensor | None = None):
        """-> (logits of the sampling rows, the captured target states [T, n*H] or None).
        `input_ids`: a decode step's tokens on the device (pending chunks, overlap.py)."""
        # Graphs cover plain decode: one token per sequence, nothing to restore from the cache.
        decode_only = all(c.n == 1 + len(c.drafts) and c.start >= c.request.full_cached
                          for c in chunks)
        graphs = self.graphs
        drafts = max(len(c.drafts) for c in chunks)
        if drafts and self.verify_graphs:  # the graph of the fewest draft rows that fit
            graphs = self.verify_graphs[min(n for n in self.verify_graphs if n >= drafts)]
        if graphs is not None and decode_only and len(chunks) <= graphs.max_batch:
            self.stats["graph_steps"] += 1
            return graphs.run(chunks, input_ids)
        inputs = build_step(chunks, self.kv_plan.block_size, self.cfg.sliding_window, self.device,
                            ring_len=self.kv.ring_len)
        if input_ids is not None:
            inputs.input_ids[:len(chunks)].copy_(input_ids)
        if not self.capture:
            return self.model.forward(inputs), None
        return self.model.forward(inputs, self.capture)

    def model_cost_probe(self, num_tokens: int) -> None:
        """One target forward over `num_tokens` tokens of a sequence that writes no cache (the
        adaptive budget's verify-cost profile, speculative.py)."""
        from .model import StepInputs

        dev, t = self.device, num_tokens

        def z(n, dtype=torch.int32):
            return torch.zeros(n, dtype=dtype, device=dev)

        s = StepInputs(input_ids=z(t, torch.int64), positions=torch.arange(t, device=dev),
                       cu_seqlens=torch.tensor([0, t], dtype=torch.int32, device=dev),
                       q_start=z(1), hist_full=z(1), hist_sliding=z(1),
                       block_table=z((1, 1)), ring_index=torch.full((1, 1), self.kv.scratch_row,
                                                                    dtype=torch.int32, device=dev),
                       slot_full=torch.full((t,), -1, dtype=torch.int64, device=dev),
                       slot_sliding=torch.full((t,), -1, dtype=torch.int64, device=dev),
                       write_rows=z(0, torch.int64), write_slots=z(0, torch.int64),
                       restore_rows=z(0, torch.int64), restore_slots=z(0, torch.int64),
                       logits_rows=torch.arange(t, device=dev))
        self.model.forward(s, self.capture)

    # ------------------------------------------------------------------ accounting
    def kv_usage(self) -> KVUsage:
        """Full-attention blocks held by requests (cached-but-free blocks count as free)."""
        return KVUsage(self.blocks.num_used, self.blocks.num_blocks, self.blocks.block_size)

    def load_snapshot(self) -> dict:
        """The load a router weighs (Dynamo's ComponentSnapshot fields plus ours)."""
        with self._lock:
            states = [r.state for r in self.requests.values()]
            held = {State.PINNED: 0, State.RESERVED: 0}
            for r in self.requests.values():
                if r.state in held:
                    held[r.state] += len(r.block_ids)
            return {
                "kv_used_blocks": self.blocks.num_used, "kv_total_blocks": self.blocks.num_blocks,
                "kv_pinned_blocks": held[State.PINNED], "kv_reserved_blocks": held[State.RESERVED],
                "kv_cached_blocks": self.blocks.num_cached, "block_size": self.blocks.block_size,
                "ring_rows_free": self.kv.free_rows, "ring_rows_total": self.kv.max_seqs,
                "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "num_pinned": states.count(State.PINNED), "num_reserved": states.count(State.RESERVED),
                "max_batch": self.options.max_batch, **self.stats,
                # the rows of every decode and verify step in batch-invariant mode (0: off)
                "batch_invariant_rows": (self.graphs.fixed_rows or 0) if self.graphs else 0,
                "prefix_hits": self.blocks.stats["hits"],
                **(self.spec.stats if self.spec is not None else {}),
            }

    def set_kv_event_sink(self, sink) -> None:
        """`sink.stored(list[StoredBlock])` / `sink.removed(list[int])`, called in order after
        each step (from the thread that runs `step`)."""
        self.kv_event_sink = sink

    def set_kv_tier(self, offload=None, fetch=None) -> None:
        """Secondary KV tier: `offload(block_hash, parent_hash, token_ids, kv)` when a reusable
        block is evicted, `fetch(block_hash) -> kv | None` on a prefix miss. `kv` is
        [n_full_layers, 2, block_size, Hkv, D] in the cache dtype, on the engine's device."""
        self.blocks.offload, self.blocks.fetch = offload, fetch

    def _flush_events(self) -> None:
        events = self.blocks.drain_events()
        if self.kv_event_sink is None:
            return
        for kind, items in events:
            getattr(self.kv_event_sink, kind)(items)

    # ------------------------------------------------------------------ scripts
    def generate(self, prompts, sampling: SamplingParams | None = None) -> list[dict]:
        """Run prompts (strings or token-id lists) to completion; returns per prompt
        {"token_ids", "text", "finish_reason", "logprobs"} in order."""
        with self._lock:
            ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
            for rid, prompt in zip(ids, prompts):
                tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                self.add_request(rid, tokens, sampling)
        results = {rid: {"token_ids": [], "text": "", "finish_reason": None, "logprobs": []} for rid in ids}
        while any(results[r]["finish_reason"] is None for r in ids):
            for out in self.step():
                res = results.get(out.request_id)
                if res is None:
                    continue
                res["token_ids"] += out.new_token_ids
                res["text"] += out.text
                res["logprobs"] += out.logprobs or []
                if out.finished:
                    res["finish_reason"] = out.finish_reason
                    self.requests.pop(out.request_id, None)
        return [results[r] for r in ids]


def _speculative(spec, choice) -> "SpecConfig | None":
    """The drafts setting an engine loads with (see `Engine.from_dir`)."""
    if choice is False:
        return None
    if isinstance(choice, SpecConfig):
        return choice
    if choice not in (None, True):
        raise EngineError(f"speculative must be None, True, False or a SpecConfig, got {choice!r}")
    has_draft = (Path(spec.path) / DRAFT_DIR / "config.json").is_file()
    if choice is True and not has_draft:
        raise EngineError(f"engine dir {spec.path}: speculative decoding asked for, but it has "
                          f"no drafter ({DRAFT_DIR}/); build with --draft DIR")
    if not has_draft:
        return None
    return SpecConfig(tokens=spec.options.draft_tokens or None)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _kv_scales(weights: dict, cfg: BeamConfig) -> tuple[dict, dict]:
    ks, vs = {}, {}
    for i in range(cfg.num_hidden_layers):
        for kind, out in (("k", ks), ("v", vs)):
            name = f"model.layers.{i}.self_attn.{kind}_scale"
            if name not in weights:
                raise EngineError(f"FP8 KV cache: engine weights have no {name}")
            out[i] = float(weights[name])
    return ks, vs
