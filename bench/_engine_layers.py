"""One batch-1 decode step of the engine bench's model, layer by layer, on the GPU: each
layer's time in CUDA graphs (once, and chained REPEATS times as the whole-model graph chains
layers), layer 1's kernels inside the chained graph, the kernels each layer launches, and the
decode chain's A/B (plugins/_pdl.py). Also the timing and log helpers bench/engine_bench.py
shares. Used by bench/engine_bench.py."""

from __future__ import annotations

import statistics
import time

import torch

from beam_trtllm.engine.batch import build_step
from beam_trtllm.engine.request import Chunk


def cuda_time(fn, iters: int, device) -> float:
    """Median milliseconds of fn() over `iters` runs, timed with CUDA events (wall on CPU)."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def decode_chunks(engine, chunks, batch: int = 1) -> list[Chunk]:
    """The next one-token step of the first `batch` prefilled requests (KV blocks reserved)."""
    assert batch <= len(chunks), f"decode batch {batch} > {len(chunks)} prefilled requests"
    out = []
    for c in chunks[:batch]:
        assert engine.scheduler._ensure_blocks(c.request, c.request.num_computed + 1)
        out.append(Chunk(c.request, c.request.num_computed, 1))
    return out


def decode_inputs(engine, step_chunks, device):
    """(the step's inputs, a random residual stream h) of a decode step of `step_chunks`."""
    s = build_step(step_chunks, engine.kv_plan.block_size, engine.cfg.sliding_window, device)
    return s, torch.randn(len(step_chunks), engine.cfg.hidden_size, device=device,
                          dtype=torch.bfloat16)


def layer_input(model, i: int, h: torch.Tensor):
    """(x, its FP8 codes or None) of layer i as the engine makes them: layer 0's input norm,
    else the boundary that ends layer i - 1 (with layer i's q/k/v input scale)."""
    if i == 0:
        return model.input_norm(h)
    prev, layer = model.layers[i - 1], model.layers[i]
    _, x, xq = model.boundary(h, torch.randn_like(h), prev["post_feedforward_layernorm"],
                              layer["input_layernorm"], 2 * i - 1, layer["attn_in_scale"])
    return x, xq


REPEATS = 8  # layers one graph chains in the steady-state measurement


def chain_layer(model, i: int, h, x, xq, s, repeats: int):
    """Layer i run `repeats` times, each on the previous run's output (as the whole-model graph
    chains 52 layers; the weights streamed in between are far larger than the L2). Each run's
    boundary prepares layer i's own input (its norm and FP8 codes), as a full layer's does in
    the model; chained after the final norm instead, the bench's last layer (its full one)
    would pay a quantize kernel no layer of the model runs."""
    for _ in range(repeats):
        h, x, xq = model.layer(i, h, x, xq, s, into=i)
    return h, x, xq


def decode_layers(engine, step_chunks, device, iters: int) -> tuple[list[float], list[float]]:
    """Batch-1 decode time of each layer: (one replay of a graph holding the layer once, which
    also pays the graph launch; the per-layer time of a graph chaining it REPEATS times, which
    pays it once for all, as the whole-model graph does)."""
    s, h = decode_inputs(engine, step_chunks, device)
    model, single, chained = engine.model, [], []
    with torch.inference_mode():
        for i in range(len(model.layers)):
            x, xq = layer_input(model, i, h)
            for _ in range(2):
                model.layer(i, h, x, xq, s)
            if device.type != "cuda":
                single.append(cuda_time(lambda: model.layer(i, h, x, xq, s), 3, device))
                chained.append(single[-1])
                continue
            for repeats, out in ((1, single), (REPEATS, chained)):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    chain_layer(model, i, h, x, xq, s, repeats)
                out.append(cuda_time(graph.replay, iters, device) / repeats)
                del graph
    return single, chained


def graph_timeline(engine, step_chunks, device, i: int = 1, replays: int = 5) -> list[dict]:
    """Layer i's kernels as they run inside the chained graph (torch profiler over replays):
    per kernel, the median duration and the median idle gap before it (end of the previous
    kernel to its start), over the middle repeats (the first pays the graph launch)."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    s, h = decode_inputs(engine, step_chunks, device)
    model = engine.model
    with torch.inference_mode():
        x, xq = layer_input(model, i, h)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain_layer(model, i, h, x, xq, s, REPEATS)
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.name.startswith(("Memcpy", "Memset"))),
                     key=lambda e: e.time_range.start)
    per_replay = len(kernels) // replays
    names = [e.name for e in kernels[:per_replay]]
    per_layer = _period(names, REPEATS)
    if per_layer is None or len(kernels) != per_replay * replays:
        return [{"error": f"{len(kernels)} kernel events for {replays} x {REPEATS} layers: "
                          "no repeating per-layer sequence"}]
    rows = []
    for j in range(per_layer):
        durs, gaps = [], []
        for r in range(replays):
            end = (r + 1) * per_replay - per_layer  # the last layer of the replay, excluded
            for rep in range(1, REPEATS - 1):  # the middle layers, counted from the end
                n = end - rep * per_layer + j
                durs.append(kernels[n].time_range.elapsed_us())
                gaps.append(kernels[n].time_range.start - kernels[n - 1].time_range.end)
        rows.append({"name": kernels[per_replay - per_layer + j].name[:80],
                     "us": statistics.median(durs), "gap_us": statistics.median(gaps),
                     "after_prev_end_us": statistics.median(d + g for d, g in zip(durs, gaps))})
    return rows


def _period(names: list[str], repeats: int) -> int | None:
    """The number of kernels a layer launches in one replay's `names`: the shortest period
    their last `repeats - 1` layers repeat with (the first layer may differ: a kernel the
    profiler folds into the graph launch)."""
    for p in range(1, len(names) // (repeats - 1) + 1):
        tail = names[len(names) - p * (repeats - 1):]
        if all(tail[k] == tail[k + p] for k in range(len(tail) - p)):
            return p
    return None


def count_launches(engine, step_chunks, device) -> list[dict]:
    """Kernels each layer launches in one eager batch-1 decode step (torch profiler)."""
    if device.type != "cuda":
        return [{} for _ in engine.model.layers]
    from torch.profiler import ProfilerActivity, profile

    s, h = decode_inputs(engine, step_chunks, device)
    model, out = engine.model, []
    with torch.inference_mode():
        for i in range(len(model.layers)):
            x, xq = layer_input(model, i, h)
            model.layer(i, h, x, xq, s)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model.layer(i, h, x, xq, s)
                torch.cuda.synchronize()
            events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            kernels = [e for e in events if not e.name.startswith(("Memcpy", "Memset"))]
            out.append({"kernels": len(kernels), "memcpy_memset": len(events) - len(kernels),
                        "names": [f"{e.time_range.elapsed_us():7.1f} us  {e.name[:90]}" for e in kernels],
                        "kernel_us": sum(e.time_range.elapsed_us() for e in kernels)})
    return out


def chain_links(variant: str):
    """set_decode_chain's argument for a variant's links: "off", "default", "all", or links,
    folds and late triggers joined by ",", where "default" stands for the default links."""
    from plugins import _pdl

    named = {"off": False, "default": True, "all": "all"}
    if variant in named:
        return named[variant]
    return [n for item in variant.split(",")
            for n in (_pdl.DEFAULT_LINKS if item == "default" else (item,))]


def chain_ab(engine, step_chunks, device, variants: str, rounds: int,
             timeline_layers: tuple[int, ...] = ()) -> list[dict]:
    """The per-layer chained decode times under each decode-chain variant (plugins/_pdl.py:
    "off", "default", "all", or links, folds and late triggers joined by ",", "default" among
    them standing for the default links; variants separated by ";"),
    alternating, `rounds` times each (same process, same weights: an A/B on one machine start).
    A variant may end in "|KEY=VALUE/KEY=VALUE": integer overrides of the decode attention's
    DECODE_CONFIG (plugins/_attention_decode.py) for that variant, batch-1 moe_fp8 shapes
    (moe13, moe2) or linear_fp8's few-token tiles (split, wide: "BM,BN,BK,WARPS,STAGES"). In the first round each
    variant also profiles `timeline_layers` (graph_timeline)."""
    from plugins import _attention_decode, _pdl

    saved, run_chain = dict(_attention_decode.DECODE_CONFIG), _pdl.decode_chain_links()
    out = []
    try:
        for r in range(rounds):
            for v in variants.split(";"):
                chain, _, overrides = v.partition("|")
                _pdl.set_decode_chain(chain_links(chain))
                pairs = dict(kv.split("=") for kv in overrides.split("/") if kv)
                moe = {k: pairs.pop(k) for k in ("moe13", "moe2") if k in pairs}
                _set_decode_tiles({k: pairs.pop(k) for k in ("split", "wide") if k in pairs})
                _attention_decode.DECODE_CONFIG.clear()
                _attention_decode.DECODE_CONFIG.update(
                    saved, **{key: int(val) for key, val in pairs.items()})
                _tune_batch1_moe(engine.cfg, moe)
                _, chained = decode_layers(engine, step_chunks, device, 200)
                out.append({"round": r, "chain": v, "chained_ms": chained})
                if r == 0:
                    out[-1]["timelines"] = {i: graph_timeline(engine, step_chunks, device, i)
                                            for i in timeline_layers}
                log(f"decode chain {v}: chained ms " + " / ".join(f"{c:.4f}" for c in chained))
    finally:
        _pdl.set_decode_chain(run_chain)
        _attention_decode.DECODE_CONFIG.clear()
        _attention_decode.DECODE_CONFIG.update(saved)
        _tune_batch1_moe(engine.cfg, {})
        _set_decode_tiles({})
    return out


def _set_decode_tiles(shapes: dict) -> None:
    """linear_fp8's few-token tiles ("split" / "wide": "BM,BN,BK,WARPS,STAGES", weights on
    the MMA's M side) for one --chain-ab variant; none: the shipped ones."""
    from plugins import linear_fp8
    from plugins._moe_common import GemmConfig

    linear_fp8.DECODE_TILES.update(split=linear_fp8.SPLIT_CONFIG, wide=linear_fp8.WIDE_CONFIG)
    for name, spec in shapes.items():
        bm, bn, bk, warps, stages = (int(v) for v in spec.split(","))
        linear_fp8.DECODE_TILES[name] = GemmConfig(bm, bn, bk, warps, stages, swap=True)


def _tune_batch1_moe(cfg, shapes: dict) -> None:
    """Install batch-1 moe_fp8 launch shapes ("moe13" / "moe2": "BM,BN,BK,WARPS,STAGES",
    weights on the MMA's M side) as a tuned-kernel entry, or remove it (no shapes)."""
    from plugins import tuning
    from plugins._moe_common import GemmConfig

    key = ("moe_fp8", tuning.bucket(cfg.num_experts_per_tok), cfg.num_experts,
           cfg.moe_intermediate_size, cfg.hidden_size)
    tuning._TABLE.pop(key, None)
    if shapes:
        made = {name: GemmConfig(*map(int, shapes[name].split(",")), swap=True)
                if name in shapes else None for name in ("moe13", "moe2")}
        tuning._TABLE[key] = {"w13": made["moe13"], "w2": made["moe2"]}
