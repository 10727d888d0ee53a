"""What the kernel benchmarks share (bench/kernels_bench.py, kernels_moe.py, kernels_sweep.py,
decode_sweep.py): the device and --smoke switch, the timers, the ceilings measured in the same
run, the table of rows, and the description of the machine and code that every result carries.

Ceilings: device-to-device copy bandwidth (bytes read + written) and cuBLAS's BF16 / FP8 /
FP32 GEMM rates on random square products. A row's rate is compared with one of them.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
# Problem sizes of Beam-1.0: a 16K-token prefill chunk, a 128K-token decode, batched decode.
# --smoke shrinks them (and skips timing) so that every code path runs in seconds on the CPU.
SIZES = dict(tokens=16384, long_ctx=131072, batch=32, batch_ctx=8192, sliding_batch=64,
             router_layers=16, copy_elems=1 << 30, gemm=8192, few_tokens=64, moe_prefill=16384)
SMOKE_SIZES = dict(tokens=20, long_ctx=100, batch=2, batch_ctx=40, sliding_batch=2,
                   router_layers=2, copy_elems=1 << 16, gemm=64, few_tokens=3, moe_prefill=72)
STATE = dict(device="cuda", smoke=False)
ROWS: list[dict] = []


def configure(smoke: bool) -> str:
    """Switch to --smoke (tiny sizes, no timing, the CPU where there is no GPU); the device."""
    if smoke:
        STATE["smoke"] = True
        SIZES.update(SMOKE_SIZES)
        STATE["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    return STATE["device"]


def dev() -> str:
    return STATE["device"]


def smoke() -> bool:
    return STATE["smoke"]


# ----------------------------------------------------------------------------- timing
def time_us(fn) -> float:
    """Median of triton.testing.do_bench (L2 flushed between calls), µs; --smoke: one call."""
    if smoke():
        fn()
        return 1.0
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def time_graph_us(fn, calls: int = 1) -> float:
    """Median replay time of a CUDA graph of `fn` divided by the `calls` op calls inside it."""
    if smoke():
        return time_us(fn) / calls
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3 / calls


def measure_ceilings() -> dict:
    """Copy GB/s (read + write, 2 GiB each way) and cuBLAS BF16 / FP8 / FP32 TFLOP/s at
    SIZES["gemm"]^3 (FP32 without TF32: the router's GEMM is IEEE FP32)."""
    device, n = dev(), SIZES["copy_elems"]
    src, dst = torch.randn(n, device=device, dtype=BF16), torch.empty(n, device=device, dtype=BF16)
    copy_gbs = 2 * n * 2 / time_us(lambda: dst.copy_(src)) / 1e3
    del src, dst
    m = SIZES["gemm"]
    a, b = torch.randn(m, m, device=device, dtype=BF16), torch.randn(m, m, device=device, dtype=BF16)
    bf16 = 2 * m**3 / time_us(lambda: a @ b) / 1e6
    a8, b8 = a.to(FP8), b.to(FP8).t().contiguous().t()  # column-major B, as _scaled_mm wants
    one = torch.ones((), device=device)
    fp8 = float("nan")
    if device == "cuda":
        fp8 = 2 * m**3 / time_us(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=BF16)) / 1e6
    af, bf = a.float(), b.float()
    torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = 2 * m**3 / time_us(lambda: af @ bf) / 1e6
    return {"copy_GBps": copy_gbs, "bf16_TFLOPs": bf16, "fp8_TFLOPs": fp8, "fp32_TFLOPs": fp32}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- rows
def add_row(op, shape, ours_us, eager_us, work, unit, ceiling, check, note=""):
    """work: bytes (unit 'GB/s') or FLOPs (unit 'TFLOP/s') the op must move / do."""
    rate = work / ours_us / (1e3 if unit == "GB/s" else 1e6)
    ROWS.append(dict(op=op, shape=shape, ours_us=ours_us, eager_us=eager_us, rate=rate,
                     unit=unit, ceiling=ceiling, pct=100 * rate / ceiling, check=check,
                     note=note))
    print(f"  {op:<28} {shape:<34} {ours_us:9.1f} us  {rate:8.1f} {unit}  "
          f"({100 * rate / ceiling:5.1f}%)  {check}", flush=True)


def table(ceil: dict, rows: list[dict] | None = None) -> str:
    lines = ["| op | shape | ours (µs) | eager (µs) | speed-up | achieved | ceiling | "
             "% of ceiling | check vs ref | note |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in ROWS if rows is None else rows:
        eager = f"{r['eager_us']:.1f}" if r["eager_us"] else "—"
        speed = f"{r['eager_us'] / r['ours_us']:.1f}×" if r["eager_us"] else "—"
        lines.append(f"| {r['op']} | {r['shape']} | {r['ours_us']:.1f} | {eager} | {speed} | "
                     f"{r['rate']:.1f} {r['unit']} | {r['ceiling']:.1f} {r['unit']} | "
                     f"{r['pct']:.1f}% | {r['check']} | {r['note']} |")
    lines.append(f"\nCeilings measured in this run: copy {ceil['copy_GBps']:.0f} GB/s (read + "
                 f"write), BF16 GEMM {ceil['bf16_TFLOPs']:.0f} TFLOP/s, FP8 GEMM "
                 f"{ceil['fp8_TFLOPs']:.0f} TFLOP/s, FP32 GEMM {ceil['fp32_TFLOPs']:.1f} TFLOP/s")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- one run
def start_run(opts, script: str):
    """A kernel benchmark's start (opts: --smoke, --preset): the switch, a GPU or a refusal,
    the model shapes, the ceilings measured now, each printed -> (preset name, config, start
    time, environment, ceilings), or None without a GPU (the caller exits 2)."""
    from beam_trtllm.config import preset

    configure(opts.smoke)
    if not opts.smoke and not torch.cuda.is_available():
        print(f"bench/{script} needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return None
    name = opts.preset or ("tiny" if smoke() else "beam-1.0-501b")
    cfg, t0, env = preset(name), time.time(), environment()
    print(f"{env['machine']} | torch {torch.__version__} | triton {triton.__version__}"
          f" | preset {name} | commit {env['commit']}", flush=True)
    ceil = measure_ceilings()
    print(f"ceilings: {json.dumps({k: round(v, 1) for k, v in ceil.items()})}", flush=True)
    return name, cfg, t0, env, ceil


def report_run(opts, name: str, env: dict, ceil: dict, t0: float, **extra) -> None:
    """Print the table of ROWS and the run's time; with --out, table.md and results.json
    (`extra`: more results.json fields)."""
    text = table(ceil)
    print("\n" + text)
    print(f"total {time.time() - t0:.0f} s")
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "table.md").write_text(text + "\n")
        (opts.out / "results.json").write_text(json.dumps(
            dict(env=env, preset=name, ceilings=ceil, rows=ROWS, **extra,
                 seconds=time.time() - t0), indent=1, default=str))


# ----------------------------------------------------------------------------- provenance
def environment() -> dict:
    """Date, commit, machine and software versions: what every result is keyed by."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "triton": triton.__version__, "cuda": torch.version.cuda}
    try:
        import transformers
        versions["transformers"] = transformers.__version__
    except ImportError:
        versions["transformers"] = None
    cuda = torch.cuda.is_available()
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "machine": torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()})",
            "gpus": torch.cuda.device_count() if cuda else 0, "versions": versions}
