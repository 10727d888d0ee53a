"""Probe: how long the batch-1 decode step's small kernels take inside a CUDA graph, by
variant, against a kernel that does nothing (H200).

    PYTHONPATH=. python3 bench/decode_chain_probe.py

Each case is captured 16 times in one graph (inputs shared, weights per copy where a
kernel streams them) and replayed under the torch profiler; the table gives each kernel's
median duration over the middle copies. Variants separate the parts of a kernel's latency
chain: qk_prep on a sliding layer (RoPE angles in FP64) or a full one (SSMax), with the gate
GEMM from x or a packed gate; the boundary norms on plain y, a split o_proj's FP32 partials,
or an MoE's 8 per-slot outputs; the router's two kernels.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import plugins  # noqa: E402,F401
from beam_trtllm.config import PRESETS  # noqa: E402

DEV, BF16, FP8 = "cuda", torch.bfloat16, torch.float8_e4m3fn
COPIES = 16


@triton.jit
def _one_value_kernel(src_ptr, dst_ptr):
    tl.store(dst_ptr + tl.program_id(0), tl.load(src_ptr))


def in_graph_us(fn) -> dict[str, float]:
    """Median duration (us) of each kernel fn launches, over copies 2..COPIES-1 of fn in one
    captured graph, 5 replays."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for copy in range(COPIES):
            fn(copy)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    per_copy = len(events) // (5 * COPIES)
    times = defaultdict(list)
    for n, e in enumerate(events):
        if 2 <= (n // per_copy) % COPIES < COPIES - 1:
            times[f"{n % per_copy}:{e.name[:40]}"].append(e.time_range.elapsed_us())
    return {k: statistics.median(v) for k, v in times.items()}


def cases(cfg):
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    one, out = torch.ones(1, device=DEV), torch.empty(1024, device=DEV)
    yield "empty, 1 program x 4 warps", lambda c=0: _one_value_kernel[(1,)](one, out)
    yield "empty, 1 program x 32 warps", lambda c=0: _one_value_kernel[(1,)](one, out, num_warps=32)
    yield "empty, 640 programs x 4 warps", lambda c=0: _one_value_kernel[(640,)](one, out)

    x = torch.randn(1, h, device=DEV, dtype=BF16)
    g_weights = [torch.randn(hq, h, device=DEV, dtype=BF16) / 70 for _ in range(COPIES)]
    w = 1 + 0.1 * torch.randn(d, device=DEV, dtype=BF16)
    k_cache = torch.zeros(64, 64, hkv, d, device=DEV, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([77], device=DEV)
    pos = torch.tensor([3000], device=DEV)
    scale = torch.tensor(0.05, device=DEV)
    for full in (False, True):
        for packed in (False, True):
            width = hq * d + 2 * hkv * d + (hq if packed else 0)
            qkvg = torch.randn(1, width, device=DEV, dtype=BF16)
            gate = () if packed else (x,)

            def run(c=0, qkvg=qkvg, gate=gate, full=full):
                extra = gate + (g_weights[c],) if gate else ()
                return torch.ops.beam.qk_prep(qkvg, pos, w, w, k_cache, v_cache, slots, scale,
                                              scale, full, eps, cfg.rope_theta, cfg.ssmax_base,
                                              cfg.ssmax_exponent, *extra)
            gate_kind = "packed gate" if packed else "gate from x"
            yield f"qk_prep {'full' if full else 'sliding'}, {gate_kind}", run

    hs = torch.randn(1, h, device=DEV, dtype=BF16)
    wn = 1 + 0.1 * torch.randn(h, device=DEV, dtype=BF16)
    xs = torch.tensor(0.02, device=DEV)
    y_plain = torch.randn(1, h, device=DEV, dtype=BF16)
    y_parts = torch.randn(2, 1, h, device=DEV)
    y_slots = torch.randn(8, 1, h, device=DEV, dtype=BF16)
    y_w = torch.rand(1, 8, device=DEV)
    yield "add_rmsnorm_fp8, plain y", lambda c=0: torch.ops.beam.add_rmsnorm_fp8(
        hs, y_plain, wn, wn, xs, 0.9, 0.4, eps)
    yield "add_rmsnorm_fp8, 2 FP32 partials", lambda c=0: torch.ops.beam.add_rmsnorm_fp8(
        hs, y_parts, wn, wn, xs, 0.9, 0.4, eps)
    yield "add_rmsnorm_fp8, 8 weighted slots", lambda c=0: torch.ops.beam.add_rmsnorm_fp8(
        hs, y_slots, wn, wn, xs, 0.9, 0.4, eps, y_w)
    yield "add_rmsnorm, 8 weighted slots", lambda c=0: torch.ops.beam.add_rmsnorm(
        hs, y_slots, wn, wn, 0.9, 0.4, eps, y_w)
    e = cfg.num_experts
    rws = [torch.randn(e, h, device=DEV) / h**0.5 * 2 for _ in range(COPIES)]
    rb = 0.05 * torch.randn(e, device=DEV)
    yield "group_router T=1", lambda c=0: torch.ops.beam.group_router(
        hs, rws[c], rb, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok,
        cfg.routed_scaling_factor, cfg.norm_topk_prob)


def main() -> None:
    cfg = PRESETS["beam-1.0-501b"]
    print(f"| case | kernel: median in-graph duration (us) |\n| --- | --- |")
    for name, fn in cases(cfg):
        times = in_graph_us(fn)
        print(f"| {name} | " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()) + " |",
              flush=True)


if __name__ == "__main__":
    main()
