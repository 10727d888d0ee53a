"""The ceilings engine_bench.py (and long_context.py) compare with: copy bandwidth and cuBLAS's
BF16 / FP8 / FP32 GEMM rates, the GEMMs both in bursts and under sustained load."""

from __future__ import annotations

import statistics
import traceback

import torch

from _engine_layers import cuda_time

DATASHEET = {"copy_GBps": 4800.0, "bf16_TFLOPs": 989.0, "fp8_TFLOPs": 1979.0, "fp32_TFLOPs": 67.0}


def measure_ceilings(device) -> dict:
    try:
        return _measure_ceilings(device)
    except Exception:  # noqa: BLE001  (fall back to the datasheet, and say so)
        traceback.print_exc()
        return {**DATASHEET, "note": "measurement failed: H200 datasheet values"}


def _measure_ceilings(device) -> dict:
    """Copy bandwidth, and each GEMM unit's rate two ways: in bursts (each 8192^3 GEMM alone,
    synchronized: the clocks at their peak) and sustained (back to back for ~0.4 s, the
    median of the second half). The H200 holds its FP8 rate only for the first ~0.1 s of
    full load, then its power cap lowers the clocks: 1,480 -> 1,264 TFLOP/s, 1,980 -> ~1,400
    MHz (2026-12-03, nvidia-smi throttle reason SW power cap). A prefill is sustained load,
    so its floors use the sustained rates ("<unit>_TFLOPs"; the bursts "<unit>_burst_TFLOPs")."""
    if device.type != "cuda":
        return {"copy_GBps": 1.0, **{f"{u}{kind}_TFLOPs": 1.0 for u in ("bf16", "fp8", "fp32")
                                      for kind in ("", "_burst")}}
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = cuda_time(lambda: dst.copy_(src), 20, device)
    out = {"copy_GBps": 2 * src.numel() / ms / 1e6}
    del src, dst
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    torch.backends.cuda.matmul.allow_tf32 = False  # the router's FP32 GEMM: IEEE FP32
    af, bf = a.float(), b.float()
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0, device=device)
    gemms = {"bf16": lambda: a @ b, "fp32": lambda: af @ bf,
             "fp8": lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)}
    for unit, fn in gemms.items():
        burst_ms = cuda_time(fn, 5 if unit == "fp32" else 20, device)
        out[f"{unit}_burst_TFLOPs"] = 2 * n**3 / burst_ms / 1e9
        out[f"{unit}_TFLOPs"] = 2 * n**3 / sustained_ms(fn, max(16, int(400 / burst_ms))) / 1e9
    return out


def sustained_ms(fn, iters: int) -> float:
    """Median ms of fn over the second half of `iters` back-to-back launches (no sync)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        fn()
        events[i + 1].record()
    events[-1].synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1])
                             for i in range(iters // 2, iters))
