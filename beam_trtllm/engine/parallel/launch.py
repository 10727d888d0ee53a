"""Starting the ranks of a parallel engine: one process per rank over torch.distributed
(NCCL on GPUs, rank r on cuda:r; gloo on the CPU), all on 127.0.0.1.

    results = launch(2, fn, engine_dir, device="cpu")   # fn(rank, engine_dir) in each rank

`fn` must be importable by name (a module-level function: the ranks are spawned, not forked,
so that CUDA and torch's threads start clean). Each rank's return value comes back in rank
order; an exception in any rank stops them all and is raised here with that rank's traceback.
Every rank destroys its process group on the way out, and ranks still running when one fails
or the timeout passes are terminated, so nothing outlives the call.
"""

from __future__ import annotations

import datetime
import io
import queue
import socket
import traceback
from pathlib import Path

import torch

from ..types import EngineError

DEFAULT_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str) -> str:
    if device == "cpu":
        return "gloo"
    if device == "cuda":
        return "nccl"
    raise EngineError(f"--device must be cpu or cuda, got {device!r}")


def rank_device(device: str, rank: int) -> torch.device:
    return torch.device("cpu") if device == "cpu" else torch.device("cuda", rank)


def launch(world: int, fn, *args, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S,
           threads: int = 1) -> list:
    """Run fn(rank, *args) in `world` spawned ranks; returns their results in rank order."""
    import torch.multiprocessing as mp

    backend = backend_for(device)
    if device == "cuda" and torch.cuda.device_count() < world:
        raise EngineError(f"{world} ranks on cuda need {world} GPUs, this machine has "
                          f"{torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, name=f"beam-rank{r}",
                         args=(r, world, backend, port, device, threads, timeout_s, results, fn,
                               args))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)


def _collect(procs, results, world: int, timeout_s: float) -> list:
    out: dict[int, object] = {}
    while len(out) < world:
        try:
            rank, ok, value = results.get(timeout=timeout_s)
        except queue.Empty:
            dead = [p.name for p in procs if not p.is_alive() and p.exitcode]
            raise EngineError(f"parallel ranks did not finish within {timeout_s:.0f} s"
                              + (f" ({', '.join(dead)} exited)" if dead else "")) from None
        if not ok:
            raise EngineError(f"rank {rank} of {world} failed:\n{value}")
        out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    return [out[r] for r in range(world)]


def _plain(value) -> bytes:
    """A rank's result as bytes: a tensor sent through the queue as itself would be shared
    through a file descriptor that dies with the rank."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _rank_main(rank, world, backend, port, device, threads, timeout_s, results, fn, args):
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        value = fn(rank, *args)
        results.put((rank, True, _plain(value)))
    except BaseException:  # reported to the parent, which stops the other ranks
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------- in a rank
def load_rank(engine_dir, device: str = "cpu", **kwargs):
    """This rank's Engine of a parallel engine dir (inside `launch`); its rank dir must be of
    the layout parallel.json states."""
    import torch.distributed as dist

    from ..engine import Engine
    from .build import read_layout

    layout = read_layout(Path(engine_dir))
    rank = dist.get_rank()
    engine = Engine.from_dir(Path(engine_dir) / f"rank{rank}", rank_device(device, rank), **kwargs)
    if engine.parallel.mapping != layout.at(rank):
        raise EngineError(f"{engine_dir}/rank{rank}: layout {engine.parallel.mapping.describe()} "
                          f"(rank {engine.parallel.mapping.rank}), parallel.json says "
                          f"{layout.describe()} (rank {rank})")
    return engine


def owns_request(engine, index: int) -> bool:
    """Which rank adds request number `index`: every rank under TP (they run one schedule),
    rank index % world under attention DP (each its own requests)."""
    m = engine.parallel.mapping
    return not m.attention_dp or index % m.world == m.rank


def generate(engine, prompts, sampling=None, on_output=None) -> dict[int, dict]:
    """Engine.generate for a rank: this rank's share of the prompts ({index: result}); steps
    until every rank is done, so that attention-DP ranks keep joining each other's MoE."""
    ids = {}
    for n, prompt in enumerate(prompts):
        if owns_request(engine, n):
            rid = f"generate-{n}"
            tokens = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            engine.add_request(rid, tokens, sampling)
            ids[rid] = n
    results = {n: {"token_ids": [], "text": "", "finish_reason": None, "logprobs": []}
               for n in ids.values()}
    while True:
        for out in engine.step():
            res = results[ids[out.request_id]]
            res["token_ids"] += out.new_token_ids
            res["text"] += out.text
            res["logprobs"] += out.logprobs or []
            if on_output is not None:
                on_output(out)
            if out.finished:
                res["finish_reason"] = out.finish_reason
                engine.requests.pop(out.request_id, None)
        if not engine.parallel.any_unfinished(engine):
            return results


def stream_prompt_rank(rank: int, engine_dir: str, device: str, prompt: str, chat: bool,
                       sampling) -> dict:
    """`beam-trt generate` on a parallel engine dir, in each rank: rank 0 prints the text as
    it comes (under attention DP rank 0 also holds the request; the others join its steps)."""
    import sys

    engine = load_rank(engine_dir, device)
    text = (engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            if chat else prompt)
    if rank == 0:
        print(text, end="", flush=True)

    def show(out):
        if rank == 0:
            print(out.text, end="", flush=True)

    res = generate(engine, [engine.tokenizer.encode(text)], sampling, on_output=show)
    if rank == 0:
        print(flush=True)
        print(f"[{res[0]['finish_reason']}; {len(res[0]['token_ids'])} tokens, "
              f"{engine.parallel.mapping.describe()}, {engine.parallel.mapping.world} ranks on "
              f"{device}]", file=sys.stderr, flush=True)
    return {"tokens": res.get(0, {}).get("token_ids")}
