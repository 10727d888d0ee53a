"""FP8-KV decode attention against the BF16 cache, and the FP8 cache's operand forms against
each other, at Beam-1.0's attention shapes on one GPU (H200), against the copy bandwidth
measured in the same run.

    PYTHONPATH=.:bench python3 bench/decode_fp8kv.py [--out DIR] [--cases NAME,...] [--no-prefill]
    TRITON_INTERPRET=1 PYTHONPATH=.:bench python3 bench/decode_fp8kv.py --smoke   # CPU, seconds

Cases: a full layer (paged, block size 64) at B=1 with 8K, 32K, 128K and 1M cached tokens
and at B=8 and B=64 with 8K and 32K; a sliding layer (its sliding_window-slot ring) at B=1
and B=64. Rows a case: the BF16 cache before and after the block-table shifts
("pow2_blocks"), the FP8 cache as before (Triton's cast to BF16, runtime division: the old
kernel) and under each FP16 operand setting (DECODE_CONFIG "fp8_operands": cvt, bits,
cvt_k_bits_v; plugins/_attention_tiles.py); at B=1 128K also the cast with the shifts,
each FP16 setting under a 168-register cap (3 programs an SM, not in whole waves), and 8 warps
a program (with 4 stages, with 256-key tiles; BF16 too); in every
case also the grid as it was before whole waves ("no fit": DECODE_CONFIG "wave_fit" 0, FP8
at 3 an SM). Times:
medians of CUDA-graph replays of the decode launcher (as the engine runs decode, launched as
in its decode chain); rate: K+V bytes read / time, against the copy ceiling (bytes read +
written, as bench/kernels_bench.py). FP8 rows also give their time over the BF16 row's and their
output's rel. error against the old FP8 kernel's (up to 256K tokens a batch also against the
reference op). Then a full-layer prefill chunk (2048 tokens on 32K cached) per setting,
against the BF16 GEMM rate. Targets (issue 34): FP8 at B=1 128K >= 85% of copy and <= 0.6x
the BF16 time; no case slower than before. About 3 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import _common as bc  # noqa: E402  (timers, ceilings, the --smoke switch, provenance)
import kernels_bench as kb  # noqa: E402  (the decode case kernels_bench.py times)
import plugins  # noqa: E402,F401  (registers torch.ops.beam.*)
from beam_trtllm.config import preset  # noqa: E402
from plugins import _attention_prefill  # noqa: E402
from plugins._attention_decode import launch_decode  # noqa: E402
from plugins._decode_config import DECODE_CONFIG, FP8_SETTINGS  # noqa: E402
from plugins.attention import ref_attention  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
FP16_FORMS = ("cvt", "bits", "cvt_k_bits_v")
HEADLINE = "full B=1 128K"
# name -> (batch, cached tokens, sliding); --smoke shrinks the contexts
CASES = {"full B=1 8K": (1, 8192, False), "full B=1 32K": (1, 32768, False),
         HEADLINE: (1, 131072, False), "full B=1 1M": (1, 1 << 20, False),
         "full B=8 8K": (8, 8192, False), "full B=8 32K": (8, 32768, False),
         "full B=64 8K": (64, 8192, False), "full B=64 32K": (64, 32768, False),
         "sliding B=1": (1, 8192, True), "sliding B=64": (64, 8192, True)}
SMOKE_CONTEXT = {8192: 40, 32768: 70, 131072: 100, 1 << 20: 130}
SMOKE_CASES = (HEADLINE, "sliding B=64")  # every row kind once, in well under a minute
REF_MAX_TOKENS = 1 << 18  # the reference op's FP32 copies of a longer batch take many GB


def variants(name: str) -> dict[str, tuple[torch.dtype, dict]]:
    """Row label -> (cache dtype, launch_decode config overrides) of one case."""
    rows = {"bf16 before": (BF16, {"pow2_blocks": False}), "bf16": (BF16, {}),
            "fp8 before": (FP8, {"fp8_operands": FP8_SETTINGS["cast"], "pow2_blocks": False})}
    if name == HEADLINE:
        rows["fp8 cast"] = (FP8, {"fp8_operands": FP8_SETTINGS["cast"]})
    for form in FP16_FORMS:
        rows[f"fp8 {form}"] = (FP8, {"fp8_operands": FP8_SETTINGS[form]})
    # the defaults before 2026-12-03: at least (not at most) programs_per_sm programs an SM,
    # 3 an SM for an FP8 cache (1.5 waves of the kernel's 2 an SM)
    rows["bf16 no fit"] = (BF16, {"wave_fit": 0})
    rows["fp8 3/SM"] = (FP8, {"programs_per_sm_fp8": 3, "wave_fit": 0})
    if name == HEADLINE:
        for form in FP16_FORMS:
            rows[f"fp8 {form} 168 regs"] = (FP8, {"fp8_operands": FP8_SETTINGS[form],
                                                  "maxnreg": 168, "programs_per_sm_fp8": 3,
                                                  "wave_fit": 0})
        # 8 warps a program: the tile's conversions and softmax spread over twice the threads
        # (half the registers each), 16 warps an SM at 2 programs to hide the FP8 loop's
        # instruction latency; with 4 stages, and with 256-key tiles (more bytes a stage)
        rows["fp8 8 warps"] = (FP8, {"num_warps": 8})
        rows["fp8 8 warps 4 stages"] = (FP8, {"num_warps": 8, "num_stages": 4})
        rows["fp8 8 warps 256 keys"] = (FP8, {"num_warps": 8, "BLOCK_N": 256, "min_split": 256})
        rows["bf16 8 warps"] = (BF16, {"num_warps": 8})
    return rows


def decode_args(cfg, batch: int, context: int, sliding: bool, kv_dtype) -> dict:
    """launch_decode's arguments: bench/kernels_bench.py's decode case (random block tables over a
    shuffled pool, or one ring row a sequence), without cu_seqlens_q."""
    window = cfg.sliding_window if sliding else 0
    case = kb.paged_decode_case(cfg, batch, context, 64, kv_dtype, window)
    case.pop("cu_seqlens_q")
    return case


def kv_bytes(cfg, batch: int, context: int, sliding: bool, kv_dtype) -> int:
    seen = min(context, cfg.sliding_window - 1) if sliding else context
    return batch * seen * cfg.num_key_value_heads * cfg.head_dim * 2 * kv_dtype.itemsize


def reference(args: dict, context: int):
    """The reference op's output (FP32 math) where the batch's caches are short enough (its
    per-head FP32 copies), else None."""
    if args["q"].shape[0] * context > REF_MAX_TOKENS and not bc.smoke():
        return None
    full = dict(args, cu_seqlens_q=torch.arange(args["q"].shape[0] + 1, dtype=torch.int32,
                                                device=args["q"].device))
    return ref_attention(**full)


def run_case(cfg, ceil: dict, name: str) -> list[dict]:
    batch, context, sliding = CASES[name]
    if bc.smoke():
        context = SMOKE_CONTEXT[context]
    rows, outs, cases = [], {}, {}
    for label, (kv, conf) in variants(name).items():
        if kv not in cases:  # one problem a cache dtype (one seed: the same BF16 draws)
            torch.manual_seed(0)
            args = decode_args(cfg, batch, context, sliding, kv)
            cases[kv] = (args, reference(args, context))
        args, want = cases[kv]
        outs[label] = out = launch_decode(**args, config=conf)
        us = bc.time_graph_us(lambda: launch_decode(**args, config=conf))  # noqa: B023
        work = kv_bytes(cfg, batch, context, sliding, kv)
        check = f"vs ref {bc.rel_err(out, want):.1e}" if want is not None else ""
        if kv == FP8 and label != "fp8 before":
            check += f", vs before {bc.rel_err(out, outs['fp8 before']):.1e}"
        rows.append(dict(case=name, row=label, us=us, GBps=work / us / 1e3,
                         pct_copy=100 * work / us / 1e3 / ceil["copy_GBps"], check=check))
        print(f"  {name:<16} {label:<24} {us:9.1f} us  {rows[-1]['GBps']:8.1f} GB/s "
              f"({rows[-1]['pct_copy']:5.1f}% of copy)  {check}", flush=True)
    us = {r["row"]: r["us"] for r in rows}
    for r in rows:  # against the BF16 cache now, and against the same cache's old kernel
        r["x_bf16"] = r["us"] / us["bf16"]
        r["x_before"] = r["us"] / us["fp8 before" if r["row"].startswith("fp8") else "bf16 before"]
    del cases, outs
    if bc.dev() == "cuda":
        torch.cuda.empty_cache()
    return rows


def prefill_args(cfg, chunk: int, cached: int, kv_dtype) -> dict:
    """One sequence's prefill chunk of `chunk` tokens on `cached` tokens of a full layer's
    paged cache (block size 64, shuffled blocks)."""
    hq, hkv, d, dev = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, bc.dev()
    blocks = math.ceil((cached + chunk) / 64)
    cache = [(torch.randn(blocks, 64, hkv, d, device=dev, dtype=BF16)).to(kv_dtype)
             for _ in range(2)]
    scale = torch.tensor(1.0 if kv_dtype == BF16 else 1 / 64, device=dev)
    return dict(q=torch.randn(chunk, hq, d, device=dev, dtype=BF16) * 2,
                k_new=torch.randn(chunk, hkv, d, device=dev, dtype=BF16),
                v_new=torch.randn(chunk, hkv, d, device=dev, dtype=BF16),
                gate=torch.rand(chunk, hq, d, device=dev, dtype=BF16), k_cache=cache[0],
                v_cache=cache[1],
                cu_seqlens_q=torch.tensor([0, chunk], device=dev, dtype=torch.int32),
                q_start=torch.tensor([cached], device=dev, dtype=torch.int32),
                hist_start=torch.zeros(1, device=dev, dtype=torch.int32),
                cache_index=torch.randperm(blocks, device=dev).int()[None], window=0,
                k_scale=scale, v_scale=scale)


def run_prefill(cfg, ceil: dict) -> list[dict]:
    chunk, cached = (6, 50) if bc.smoke() else (2048, 32768)
    flops = 4 * cfg.num_attention_heads * cfg.head_dim * (chunk * cached + chunk * (chunk + 1) // 2)
    full, rows, base = _attention_prefill.PREFILL_CONFIG["full"], [], None
    saved = full["fp8_operands"]
    cases = [("bf16", BF16, FP8_SETTINGS["cast"])] + [
        (f"fp8 {form}", FP8, FP8_SETTINGS[form]) for form in ("cast",) + FP16_FORMS]
    try:
        for label, kv, setting in cases:
            torch.manual_seed(0)
            args = prefill_args(cfg, chunk, cached, kv)
            full["fp8_operands"] = setting
            out = torch.ops.beam.attention(**args)
            base = out if label == "fp8 cast" else base
            us = bc.time_us(lambda: torch.ops.beam.attention(**args))  # noqa: B023
            check = f"vs fp8 cast {bc.rel_err(out, base):.1e}" if kv == FP8 else ""
            tflops = flops / us / 1e6
            rows.append(dict(case=f"prefill {chunk} on {cached}", row=label, us=us,
                             TFLOPs=tflops, pct_bf16=100 * tflops / ceil["bf16_TFLOPs"],
                             check=check))
            print(f"  prefill {chunk} on {cached}  {label:<18} {us:9.1f} us  {tflops:6.1f} "
                  f"TFLOP/s ({rows[-1]['pct_bf16']:5.1f}% of BF16 GEMM)  {check}", flush=True)
    finally:
        full["fp8_operands"] = saved
    return rows


def summary(rows: list[dict]) -> list[str]:
    """The targets at B=1 128K, and each case's FP8 rows against its old FP8 kernel."""
    lines, default = [], next(f for f, v in FP8_SETTINGS.items()
                              if v == DECODE_CONFIG["fp8_operands"])
    head = [r for r in rows if r["case"] == HEADLINE and r["row"].startswith("fp8")]
    if head:
        best = min(head, key=lambda r: r["us"])
        lines.append(f"{HEADLINE}: fastest FP8 row '{best['row']}' {best['us']:.1f} us, "
                     f"{best['pct_copy']:.1f}% of copy (target >= 85), {best['x_bf16']:.2f}x "
                     f"the BF16 cache (target <= 0.6)")
    for case in dict.fromkeys(r["case"] for r in rows if "us" in r and "GBps" in r):
        mine = {r["row"]: r["us"] for r in rows if r["case"] == case}
        old = mine.get("fp8 before")
        new = {f: mine[f"fp8 {f}"] for f in FP16_FORMS if f"fp8 {f}" in mine}
        if old and new:
            fastest = min(new, key=new.get)
            lines.append(f"{case}: FP8 before {old:.1f} us, default ({default}) "
                         f"{mine.get('fp8 ' + default, float('nan')):.1f}, fastest {fastest} "
                         f"{new[fastest]:.1f} ({old / new[fastest]:.2f}x); BF16 "
                         f"{mine['bf16 before']:.1f} -> {mine['bf16']:.1f} us; not in whole waves "
                         f"BF16 {mine.get('bf16 no fit', float('nan')):.1f}, FP8 3/SM "
                         f"{mine.get('fp8 3/SM', float('nan')):.1f} us")
    return lines


def markdown(rows: list[dict], ceil: dict) -> str:
    out = ["| case | row | µs | rate | of ceiling | x BF16 | x before | check |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if "GBps" in r:
            out.append(f"| {r['case']} | {r['row']} | {r['us']:.1f} | {r['GBps']:.1f} GB/s | "
                       f"{r['pct_copy']:.1f}% of copy | {r['x_bf16']:.2f} | "
                       f"{r['x_before']:.2f} | {r['check']} |")
        else:
            out.append(f"| {r['case']} | {r['row']} | {r['us']:.1f} | {r['TFLOPs']:.1f} TFLOP/s "
                       f"| {r['pct_bf16']:.1f}% of BF16 GEMM | | | {r['check']} |")
    out.append(f"\nCeilings measured in this run: copy {ceil['copy_GBps']:.0f} GB/s (read + "
               f"write), BF16 GEMM {ceil['bf16_TFLOPs']:.0f} TFLOP/s")
    return "\n".join(out)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Measures: " + __doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write table.md and results.json here")
    parser.add_argument("--cases", default="", help="comma list of: " + ", ".join(CASES)
                        + f" (default all; --smoke: {', '.join(SMOKE_CASES)})")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill rows")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny preset and contexts, no timing: every row once (CPU works)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    bc.configure(opts.smoke)
    if not opts.smoke and not torch.cuda.is_available():
        print("bench/decode_fp8kv.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    names = [c.strip() for c in opts.cases.split(",") if c.strip()] or list(
        SMOKE_CASES if opts.smoke else CASES)
    unknown = [c for c in names if c not in CASES]
    if unknown:
        print(f"unknown --cases {unknown}; known: {list(CASES)}", file=sys.stderr)
        return 2
    cfg, t0, env = preset("tiny" if opts.smoke else "beam-1.0-501b"), time.time(), bc.environment()
    print(f"{env['machine']} | torch {torch.__version__} | commit {env['commit']} | "
          f"fp8_operands default {DECODE_CONFIG['fp8_operands']}", flush=True)
    ceil = bc.measure_ceilings()
    print(f"ceilings: {json.dumps({k: round(v, 1) for k, v in ceil.items()})}", flush=True)
    rows = [r for name in names for r in run_case(cfg, ceil, name)]
    if not opts.no_prefill:
        rows += run_prefill(cfg, ceil)
    lines = summary(rows)
    text = markdown(rows, ceil) + "\n\n" + "\n".join(f"- {line}" for line in lines)
    print("\n" + text + f"\n\ntotal {time.time() - t0:.0f} s")
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "table.md").write_text(text + "\n")
        (opts.out / "results.json").write_text(json.dumps(
            dict(env=env, ceilings=ceil, rows=rows, summary=lines,
                 seconds=time.time() - t0), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
