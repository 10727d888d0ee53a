"""One engine of a TP/EP rank group behind a single-process API, for servers: the Dynamo
worker holds rank 0 (`RankGroup`), which starts the other ranks itself.

Under TP every rank must run the same schedule, so the group mirrors what the leader is told:
each `add_request` / `abort` is applied to rank 0's Engine at once (a bad request is refused
there, naming the field, before any other rank sees it) and queued; each `step()` first
broadcasts the queue to the followers, which apply it and step too. All ranks then sample the
same tokens from the same all-reduced logits; only rank 0's outputs leave the group.
Not supported here (refused): attention-DP layouts (their ranks hold different requests, so a
server would route to each rank), and disaggregation and the offload tier (their transports
address one rank's cache).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..types import EngineError
from .build import read_layout
from .launch import free_port, rank_device


class RankGroup:
    def __init__(self, engine_dir, device: str | None = None, timeout_s: float = 600.0):
        import datetime

        import torch.multiprocessing as mp

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        device = "cuda" if device.startswith("cuda") else device
        self.layout = read_layout(Path(engine_dir))
        if self.layout.attention_dp:
            raise EngineError(f"{engine_dir}: an attention-DP engine serves one request stream "
                              "per rank; a RankGroup serves TP/EP layouts only")
        port, world = free_port(), self.layout.world
        ctx = mp.get_context("spawn")
        self.followers = [ctx.Process(target=_follow, name=f"beam-rank{r}", daemon=True,
                                      args=(r, world, port, str(engine_dir), device, timeout_s))
                          for r in range(1, world)]
        for p in self.followers:
            p.start()
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("gloo" if device == "cpu" else "nccl",
                                init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        from .launch import load_rank

        self.engine = load_rank(engine_dir, device)
        self.device = rank_device(device, 0)
        self._queue: list[tuple] = []
        self._lock = threading.RLock()
        self._last = time.monotonic()
        self._closed = threading.Event()
        threading.Thread(target=self._keepalive, name="beam-rank-keepalive", daemon=True).start()

    def _keepalive(self, every_s: float = 30.0) -> None:
        """An idle server steps nothing; ping the followers, whose wait in the broadcast
        would otherwise run into the process group's timeout."""
        while not self._closed.wait(every_s):
            with self._lock:
                if not self._closed.is_set() and time.monotonic() - self._last >= every_s:
                    dist.broadcast_object_list([[("ping",)]], src=0)
                    self._last = time.monotonic()

    # ------------------------------------------------------------------ mirrored calls
    def add_request(self, request_id, prompt_token_ids, sampling=None, *, prefill_only=False,
                    kv_reserved=None) -> None:
        if prefill_only or kv_reserved is not None:
            raise EngineError(f"request {request_id!r}: disaggregated prefill/decode is not "
                              "supported on a parallel engine")
        with self._lock:
            self.engine.add_request(request_id, prompt_token_ids, sampling)
            self._queue.append(("add", request_id, list(prompt_token_ids), sampling))

    def abort(self, request_id) -> bool:
        with self._lock:
            done = self.engine.abort(request_id)
            if done:
                self._queue.append(("abort", request_id))
            return done

    def step(self):
        with self._lock:
            commands, self._queue = self._queue, []
            dist.broadcast_object_list([commands], src=0)
            self._last = time.monotonic()
            return self.engine.step()

    def generate(self, prompts, sampling=None) -> list[dict]:
        """Engine.generate through the group (the followers see every request)."""
        ids = [f"generate-{n}" for n in range(len(prompts))]
        results = {rid: {"token_ids": [], "text": "", "finish_reason": None, "logprobs": []}
                   for rid in ids}
        for rid, prompt in zip(ids, prompts):
            tokens = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            self.add_request(rid, tokens, sampling)
        while any(r["finish_reason"] is None for r in results.values()):
            for out in self.step():
                res = results.get(out.request_id)
                if res is not None:
                    res["token_ids"] += out.new_token_ids
                    res["text"] += out.text
                    res["logprobs"] += out.logprobs or []
                    if out.finished:
                        res["finish_reason"] = out.finish_reason
        return [results[rid] for rid in ids]

    def set_kv_tier(self, offload=None, fetch=None) -> None:
        if offload is not None or fetch is not None:
            raise EngineError("the offload tier is not supported on a parallel engine")

    def close(self) -> None:
        """Stop the followers and leave the process group (idempotent)."""
        if not dist.is_initialized():
            return
        with self._lock:
            self._closed.set()
            dist.broadcast_object_list([[("stop",)]], src=0)
        for p in self.followers:
            p.join(30)
            if p.is_alive():
                p.terminate()
        dist.destroy_process_group()

    def kv_export(self, *args, **kwargs):
        raise EngineError("disaggregated prefill/decode is not supported on a parallel engine")

    kv_reserve = release = kv_export

    def __getattr__(self, name):  # everything else is rank 0's Engine's (read-only use)
        if "engine" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["engine"], name)


def _follow(rank, world, port, engine_dir, device, timeout_s) -> None:
    import datetime

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if device == "cpu" else "nccl",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _exit_with(os.getppid())
    try:
        from .launch import load_rank

        engine = load_rank(engine_dir, device)
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] == [("ping",)]:  # the leader is idle (RankGroup._keepalive)
                continue
            for command in box[0]:
                if command[0] == "stop":
                    return
                if command[0] == "add":
                    engine.add_request(command[1], command[2], command[3])
                else:
                    engine.abort(command[1])
            engine.step()
    finally:
        dist.destroy_process_group()


def _exit_with(parent: int) -> None:
    """A follower blocks in collectives: if its leader is killed, leave instead of waiting
    out the process group's timeout."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="beam-rank-watchdog", daemon=True).start()


def open_engine(engine_dir, device: str | None = None, speculative=None,
                batch_invariant: bool = False):
    """What a server loads: `Engine.from_dir`, or for a parallel engine dir (parallel.json) a
    RankGroup that starts its other ranks. `speculative`, `batch_invariant`: see
    `Engine.from_dir`."""
    if (Path(engine_dir) / "parallel.json").is_file():
        asked = (("speculative decoding", speculative), ("batch_invariant", batch_invariant))
        for name, on in asked:
            if on:
                raise EngineError(f"{engine_dir}: {name} runs on single-GPU engines, this is a "
                                  "parallel engine dir")
        return RankGroup(engine_dir, device)
    from ..engine import Engine

    return Engine.from_dir(engine_dir, device, speculative=speculative,
                           batch_invariant=batch_invariant)
