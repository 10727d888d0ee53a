"""Host time of an eager engine step against the GPU's time for it: the model forward of one
prefill chunk (launches only, the GPU runs behind) and build_step, on the trained tiny Beam;
and the host's part of adaptive verification's draft choice at batch 32 (SpecDecoder._admit),
with the estimator's features packed by the draft graph and packed on the host.

    python bench/host_overhead.py --device cuda [--work DIR] [--tokens 60] [--blocks 10]
    python bench/host_overhead.py --smoke      # the CPU, 16 tokens, 2 blocks (seconds)

An eager step (a prefill chunk, or a mixed prefill + decode step: CUDA graphs cover pure
decode only) runs several beam:: ops a layer, each a Python launcher plus a Triton launch; on
a short chunk the host, not the GPU, sets the step's time. Reports the best and the median
block (of --blocks blocks of 20 forwards, 100 build_steps), wall and the thread's CPU time,
and what one op's registration costs a call (beam_op against torch.library.custom_op).
The ceiling is the forward's GPU time (printed, from one synchronized forward); the host
should stay below it. To compare two trees, run it twice with PYTHONPATH set to each (the
engine dir is reused). About a minute on an H200 with the build, seconds after.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# appended, not prepended: PYTHONPATH picks the tree under test (an A/B of two trees)
sys.path += [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]


def timed_blocks(fn, blocks: int, per: int, sync) -> dict:
    wall, cpu = [], []
    for _ in range(blocks):
        w0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(per):
            fn()
        wall.append((time.perf_counter() - w0) / per * 1e3)
        cpu.append((time.thread_time() - c0) / per * 1e3)
        sync()
    return {"wall_min": min(wall), "wall_median": statistics.median(wall),
            "cpu_min": min(cpu), "cpu_median": statistics.median(cpu)}


def gpu_time_ms(eng, inputs) -> float:
    """The forward's GPU time: CUDA events around it, replayed from a graph-free queue that
    is kept full (a sleep kernel first, so the host's launches finish before the GPU starts)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # ~tens of ms: the launches below queue up behind it
    start.record()
    eng.model.forward(inputs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def registration_us(x: torch.Tensor, blocks: int) -> dict:
    """Host us a call of beam::add_rmsnorm on a prefill chunk's rows three ways, alternated
    block by block in this process (so a slower host moves all three alike): as registered
    (registry.beam_op), the same Python function as a torch.library.custom_op (how the ops
    were registered before 2026-12-02), and the function called directly."""
    from plugins.add_rmsnorm import add_rmsnorm

    body = add_rmsnorm.__wrapped__
    twin = torch.library.custom_op("beam_host_overhead::add_rmsnorm", mutates_args=())(body)
    w = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
    calls = {"beam_op": lambda: add_rmsnorm(x, x, w, w, 1.0, 1.0, 1e-6),
             "custom_op": lambda: twin(x, x, w, w, 1.0, 1.0, 1e-6),
             "direct": lambda: body(x, x, w, w, 1.0, 1.0, 1e-6)}
    best = {k: float("inf") for k in calls}
    for _ in range(blocks):
        for name, fn in calls.items():
            t0 = time.thread_time()
            for _ in range(200):
                fn()
            best[name] = min(best[name], (time.thread_time() - t0) / 200 * 1e6)
    return best


def admit_times(engine_dir: Path, device: str, blocks: int, sync, batch: int = 32) -> dict:
    """SpecDecoder._admit of `batch` requests (adaptive, random draft scores at the drafter's
    shapes): {"features packed in the graph": ..., "features packed on the host": ...}."""
    from beam_trtllm.draft.model import DraftOutput
    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.speculative import SpecConfig

    spec = Engine.from_dir(engine_dir, device=device,
                           speculative=SpecConfig(adaptive=True, compile=False)).spec
    n, k, dev = spec.block, spec.dcfg.selector_top_k, spec.engine.device
    g = torch.Generator().manual_seed(0)
    out = DraftOutput(torch.randint(0, 1000, (batch, n), generator=g).to(dev),
                      torch.zeros(batch, n, k, dtype=torch.int64, device=dev),
                      (torch.randn(batch, n, k, generator=g) * 3).to(dev))
    temps, rooms = torch.zeros(batch, device=dev), [64] * batch
    packed = torch.cat([out.tokens.double(), spec._features(out.cand_scores, temps).double()], 1)
    spec._admit(out, temps, rooms, packed)  # the budget's one-time cost profile
    return {"features packed in the graph": timed_blocks(
                lambda: spec._admit(out, temps, rooms, packed), blocks, 100, sync),
            "features packed on the host": timed_blocks(
                lambda: spec._admit(out, temps, rooms), blocks, 100, sync)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--work", type=Path, default=Path("/tmp/beam-host-overhead"))
    p.add_argument("--tokens", type=int, default=60)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="CPU, 16 tokens, 2 blocks")
    args = p.parse_args(argv)
    if args.smoke:  # (a fresh work dir: never an engine built by other code)
        args.device, args.tokens, args.blocks = "cpu", 16, 2
        args.work = Path(tempfile.mkdtemp(prefix="beam-host-overhead-"))
    import beam_trtllm
    import plugins
    from beam_trtllm.engine.batch import build_step
    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.types import SamplingParams

    engine_dir = args.work / "engine"
    if not (engine_dir / "engine.json").exists():
        from spec_bench import trained_engine_dir  # (puts this checkout first on sys.path)

        trained_engine_dir(args.work, args.device)
    eng = Engine.from_dir(engine_dir, device=args.device, speculative=False)
    ids = (eng.tokenizer.encode("def read_lines(path):\n    return open(path).read()\n") * 50)
    eng.add_request("host", ids[:args.tokens], SamplingParams(max_tokens=1))
    chunks = eng.scheduler.schedule()
    step = (chunks, eng.kv_plan.block_size, eng.cfg.sliding_window, eng.device)
    inputs = build_step(*step, ring_len=eng.kv.ring_len)
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    for _ in range(20):
        eng.model.forward(inputs)
    sync()
    gpu_ms = gpu_time_ms(eng, inputs) if eng.device.type == "cuda" else float("nan")
    fwd = timed_blocks(lambda: eng.model.forward(inputs), args.blocks, 20, sync)
    bld = timed_blocks(lambda: build_step(*step, ring_len=eng.kv.ring_len), args.blocks, 100, sync)
    print(f"code: {Path(beam_trtllm.__file__).parent}, {Path(plugins.__file__).parent}")
    if hasattr(plugins.registry, "beam_op"):  # (a tree from before beam_op has no twin to time)
        x = torch.randn(args.tokens, eng.cfg.hidden_size, dtype=torch.bfloat16, device=eng.device)
        reg = registration_us(x, args.blocks)
        print("add_rmsnorm host us a call (best block, thread CPU time): " +
              ", ".join(f"{k} {v:.1f}" for k, v in reg.items()))
    print(f"{eng.cfg.num_hidden_layers} layers, a {len(chunks[0].token_ids)}-token prefill chunk")
    print(f"GPU time of the forward (the ceiling): {gpu_ms:.3f} ms")
    print("| part | wall ms best | wall ms median | CPU ms best | CPU ms median |")
    print("| --- | ---: | ---: | ---: | ---: |")
    admit = admit_times(engine_dir, args.device, args.blocks, sync)
    rows = [("model.forward", fwd), ("build_step", bld)]
    rows += [(f"adaptive draft choice, batch 32, {k}", v) for k, v in admit.items()]
    for name, r in rows:
        print(f"| {name} | {r['wall_min']:.3f} | {r['wall_median']:.3f} | {r['cpu_min']:.3f} | "
              f"{r['cpu_median']:.3f} |")


if __name__ == "__main__":
    main()
