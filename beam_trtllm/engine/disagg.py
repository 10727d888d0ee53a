"""Disaggregated prefill -> decode, independent of the transport (docs/DESIGN.md §4).

Prefill engine: `add_request(id, prompt, prefill_only=True)` computes the prompt and samples
the first token; the request then finishes but keeps its blocks and ring row (PINNED) until
`release(id)`. `kv_export(id)` says where that KV lives.
Decode engine: `kv_reserve(id, num_tokens)` allocates blocks and a ring row (RESERVED) and
returns the same description; a transport copies the rows (block `src.block_ids[i]` of every
full layer to `dst.block_ids[i]`, ring row to ring row); then
`add_request(id, prompt, sampling, kv_reserved=dataclasses.replace(handle, first_token=t))`
emits `t` first and continues decoding. `release` / `abort` free a pin or a reservation at
any time (timeouts), so no block leaks.
"""

from __future__ import annotations

from .plan import cdiv
from .request import Request, State
from .types import EngineError, KVCapacityError, KVHandle, LayerKV, SamplingParams


class DisaggMixin:
    def kv_layers(self) -> tuple[LayerKV, ...]:
        """What a handoff moves: every layer's KV, then with a drafter (speculative decoding)
        its paged K/V per draft layer (kind "full": the same block ids), so the decode side
        drafts from the prompt's context at once."""
        layers = self.kv.layers()
        if getattr(self, "spec", None) is None:
            return layers
        cache, base = self.spec.kv.cache, self.cfg.num_hidden_layers
        return layers + tuple(LayerKV(base + j, "full", cache[j, 0], cache[j, 1], 1.0, 1.0)
                              for j in range(cache.shape[0]))

    def _handle(self, req: Request, num_tokens: int, first_token: int | None) -> KVHandle:
        return KVHandle(req.request_id, num_tokens, self.kv_plan.block_size,
                        tuple(req.block_ids[:cdiv(num_tokens, self.kv_plan.block_size)]),
                        req.ring_row, self.kv_layers(), first_token, self.kv_plan.kv_dtype)

    def kv_export(self, request_id: str) -> KVHandle:
        """Where a finished prefill-only request's KV lives (it stays pinned until release)."""
        with self._lock:
            req = self.requests.get(request_id)
            if req is None or req.state != State.PINNED:
                state = "unknown" if req is None else req.state.value
                raise EngineError(f"kv_export({request_id!r}): the request is {state}; only a "
                                  "finished prefill_only request can be exported")
            return self._handle(req, len(req.prompt_ids), req.output_ids[0])

    def kv_reserve(self, request_id: str, num_tokens: int) -> KVHandle:
        """Allocate blocks for `num_tokens` positions and a ring row for an incoming handoff.
        KVCapacityError when memory is short now (retry later)."""
        with self._lock:
            if request_id in self.requests:
                raise EngineError(f"kv_reserve({request_id!r}): the request id is in use")
            if not 0 < num_tokens < self.options.max_seq_len:
                raise EngineError(f"kv_reserve({request_id!r}): {num_tokens} tokens; must be in "
                                  f"[1, --max-seq-len {self.options.max_seq_len})")
            need = cdiv(num_tokens, self.kv_plan.block_size)
            if need > self.blocks.num_free or self.kv.free_rows == 0:
                raise KVCapacityError(f"kv_reserve({request_id!r}): needs {need} blocks and a "
                                      f"ring row; {self.blocks.num_free} blocks and "
                                      f"{self.kv.free_rows} rows are free")
            self._quiesce()  # a finished request's in-flight step may still write freed blocks
            req = Request(request_id, [], SamplingParams(), next(self._arrivals), num_tokens)
            req.block_ids = self.blocks.allocate(need)
            req.ring_row = self.kv.allocate_row()
            req.state = State.RESERVED
            req.num_computed = num_tokens
            self.requests[request_id] = req
            return self._handle(req, num_tokens, None)

    def release(self, request_id: str) -> bool:
        """Free a pinned export or a reservation; False if there is none under this id."""
        with self._lock:
            req = self.requests.get(request_id)
            if req is None or req.state not in (State.PINNED, State.RESERVED):
                if req is not None and req.state in (State.RUNNING, State.WAITING):
                    raise EngineError(f"release({request_id!r}): the request is still "
                                      f"{req.state.value}; abort it instead")
                return False
            self.scheduler.release(req)
            self.requests.pop(request_id, None)
            return True

    def _continue_reserved(self, req: Request, handle: KVHandle) -> None:
        reserved = self.requests.get(req.request_id)
        if reserved is None or reserved.state != State.RESERVED:
            raise EngineError(f"request {req.request_id!r}: kv_reserved given, but no "
                              "kv_reserve() for this id is pending")
        if handle.first_token is None:
            raise EngineError(f"request {req.request_id!r}: kv_reserved.first_token is not set "
                              "(the token the prefill engine sampled)")
        if handle.num_tokens != len(req.prompt_ids) or reserved.num_computed != handle.num_tokens:
            raise EngineError(f"request {req.request_id!r}: the prompt has {len(req.prompt_ids)} "
                              f"tokens, the reservation holds {reserved.num_computed}")
        req.block_ids, req.ring_row = reserved.block_ids, reserved.ring_row
        req.num_computed = handle.num_tokens
        req.output_ids = [int(handle.first_token)]
        req.pending_first = int(handle.first_token)
        req.state = State.RUNNING
        self.scheduler.running.append(req)
        self.scheduler.register_full_blocks(req)  # the transferred prompt blocks are reusable
