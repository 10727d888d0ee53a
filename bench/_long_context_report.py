"""The long-context benchmark's memory accounting against `beam-trt info`'s plan, and its
markdown tables (bench/long_context.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

GIB = 1 << 30
DECODE_TARGET = 1.3     # issue 34: decode at 1M depth <= 1.3x its floor
MEMORY_TOLERANCE = 0.05  # issue 34: measured memory within 5% of the plan


def token_label(n: int) -> str:
    """131072 -> "128K", 1048576 -> "1M", 2048 -> "2K", 300 -> "300"."""
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n % 1024 == 0 else str(n)


def memory_result(engine, path: Path, device, base: int) -> dict:
    """The plan `beam-trt info ENGINE_DIR --context MAX_SEQ_LEN` gives (beam_trtllm.info.report:
    weight bytes of the engine's precision + KV bytes of one sequence of that length) and what
    the loaded engine holds: weight files, KV cache tensors, and torch's allocated bytes (the
    CPU has no allocator statistics: there, the weights' and KV cache's tensor bytes)."""
    from beam_trtllm.config import BeamConfig
    from beam_trtllm.info import report, scheme_precision

    spec = json.loads((path / "engine.json").read_text())
    context, kv_dtype = engine.options.max_seq_len, engine.kv_plan.kv_dtype
    precision = scheme_precision(spec["quantization"]["scheme"])
    info = report(BeamConfig.from_hf(path), context, kv_dtype, engine.options.max_num_tokens,
                  precision)
    plan = {"context": context, "precision": precision, "kv_dtype": kv_dtype,
            "weights": info["weight_bytes"][precision], "kv": info["kv_bytes_sequence"],
            "activations": info["plan"]["activations"],
            "num_tokens": engine.options.max_num_tokens}
    plan["total"] = plan["weights"] + plan["kv"]  # what is held between steps
    plan["peak"] = info["plan"]["total"]  # + one chunk's activations
    weights = sum(f["bytes"] for n, f in spec["files"].items() if n.startswith("weights-"))
    measured = {"weights_stored": weights, "kv_cache": engine.kv.nbytes,
                "engine_kv_plan": engine.kv_plan.total_bytes}
    if device.type == "cuda":
        measured["allocated"] = torch.cuda.memory_allocated(device) - base
    else:
        measured["allocated"] = weights + engine.kv.nbytes
    ratio = measured["allocated"] / plan["total"]
    summary = (f"{measured['allocated'] / GIB:.2f} GiB allocated, plan {plan['total'] / GIB:.2f} "
               f"GiB ({ratio:.3f}x): weights {weights / GIB:.2f} GiB stored vs "
               f"{plan['weights'] / GIB:.2f} planned, KV {engine.kv.nbytes / GIB:.3f} GiB vs "
               f"{plan['kv'] / GIB:.3f} planned")
    return {"plan": plan, "measured": measured, "allocated_x_plan": ratio, "summary": summary}


def checks(res: dict) -> dict:
    """The run against its targets: every request complete, decode at the longest context
    <= DECODE_TARGET x its floor, memory within MEMORY_TOLERANCE of the plan."""
    done = [r for r in res["requests"] if r.get("decode")]
    out = {"requests_complete": len(done) == len(res["requests"]) and not res.get("errors")}
    if done:
        last = max(done, key=lambda r: r["context"])
        d = last["decode"]
        out.update(decode_context=last["context"], decode_x_floor=d["x_floor"],
                   decode_replay_x_floor=d["replay_x_floor"],
                   decode_ok=d["x_floor"] <= DECODE_TARGET)
    mem = res.get("memory")
    if mem:
        total = mem["plan"]["total"]
        out["allocated_x_plan"] = mem["allocated_x_plan"]
        out["allocated_ok"] = abs(mem["allocated_x_plan"] - 1) <= MEMORY_TOLERANCE
        peak = mem["plan"].get("peak", total)
        peaks = [r["memory"]["peak_allocated"] / peak for r in done if r.get("memory")]
        if peaks:
            out["peak_x_plan"] = max(peaks)
            out["peak_ok"] = abs(max(peaks) - 1) <= MEMORY_TOLERANCE
    return out


def _checks_line(c: dict) -> str:
    parts = [f"requests complete: {'yes' if c['requests_complete'] else 'no'}"]
    if "decode_x_floor" in c:
        replay = c["decode_replay_x_floor"]
        parts.append(f"decode at {c['decode_context']:,} tokens {c['decode_x_floor']:.2f}x its "
                     f"floor (graph replay alone {_f(replay, '.2f')}x; target <= "
                     f"{DECODE_TARGET}x: {'met' if c['decode_ok'] else 'missed'})")
    if "allocated_x_plan" in c:
        parts.append(f"allocated after loading {c['allocated_x_plan']:.3f}x the plan"
                     + (f", peak while prefilling {c['peak_x_plan']:.3f}x" if "peak_x_plan" in c
                        else "") + f" (target within {MEMORY_TOLERANCE:.0%})")
    return "Checks: " + "; ".join(parts) + "."


# ---------------------------------------------------------------------------- markdown
def _f(v, fmt: str, none: str = "—") -> str:
    return none if v is None else format(v, fmt)


def markdown(res: dict) -> str:
    env, c = res["env"], res["ceilings"]
    lines = [f"### Long context (`long_context.py`), {env['date']}, {env['machine']}", "",
             f"Commit {env['commit']}{' (dirty tree)' if env['dirty'] else ''}, "
             f"`{res['command']}`, {res.get('total_s', 0):.0f} s in all; torch "
             f"{env['versions']['torch']}, Triton {env['versions']['triton']}. Model: "
             f"{'narrow (--smoke)' if res['smoke'] else 'Beam-1.0 widths'}, layers "
             f"{res['layers']}, FP8 weights and KV cache, max_seq_len "
             f"{res['options']['max_seq_len']:,}, chunk (--max-num-tokens) "
             f"{res['options']['max_num_tokens']:,}, build {_build(res)}.",
             f"Ceilings measured in this run: copy {c['copy_GBps']:.0f} GB/s, FP8 GEMM "
             f"{c['fp8_TFLOPs']:.0f}, BF16 {c['bf16_TFLOPs']:.0f}, FP32 {c['fp32_TFLOPs']:.1f}, "
             f"attention {c['attention_TFLOPs']:.0f} TFLOP/s "
             f"({c.get('attention_shapes') or c.get('attention_note', '')}).", "",
             "| request | prompt tokens | chunks | prefill s | tokens/s | floor s (GEMM + "
             "attention) | x floor | decode ms/step | graph replay ms | decode floor ms | "
             "x floor (step / replay) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    lines += [_request_row(r, res.get("errors", {})) for r in res["requests"]]
    lines += ["", *_memory_rows(res), "", _checks_line(checks(res))]
    if res.get("errors"):
        lines += ["", "Errors: " + "; ".join(f"{k}: {v}" for k, v in res["errors"].items())]
    return "\n".join(lines)


def _build(res: dict) -> str:
    b = res.get("build") or {}
    if "reused" in b:
        return "reused"
    return (f"checkpoint {b.get('checkpoint_GB', 0):.1f} GB in {b.get('checkpoint_s', 0):.0f} s, "
            f"`beam-trt build` {b.get('build_s', 0):.0f} s, load {res.get('load_s', 0):.0f} s")


def _request_row(r: dict, errors: dict) -> str:
    p, d = r.get("prefill"), r.get("decode")
    if not p or not d:
        return f"| {r['label']} | failed: {errors.get(r['label'], '?')} |" + " |" * 9
    fl = p["floor"]
    return (f"| {r['label']} | {r['prompt_tokens']:,} | {len(p['chunks'])} | {p['s']:.2f} | "
            f"{p['tokens_per_s']:,.0f} | {fl['total']:.2f} ({fl['gemm']:.2f} + "
            f"{fl['attention']:.2f}) | {p['x_floor']:.2f} | {d['step_ms']:.3f} | "
            f"{_f(d['replay_ms'], '.3f')} | {d['floor_ms']:.3f} | {d['x_floor']:.2f} / "
            f"{_f(d['replay_x_floor'], '.2f')} |")


def _memory_rows(res: dict) -> list[str]:
    mem = res.get("memory")
    if not mem:
        return []
    plan, got = mem["plan"], mem["measured"]
    rows = [("weights (engine dir files)", plan["weights"], got["weights_stored"]),
            (f"KV cache ({plan['kv_dtype']}, {plan['context']:,} tokens)", plan["kv"],
             got["kv_cache"]),
            ("allocated after loading", plan["total"], got["allocated"])]
    for r in res["requests"]:
        m = r.get("memory") or {}
        if m:
            rows.append((f"peak allocated, {r['label']} prefill (plan + a "
                         f"{plan.get('num_tokens', 0):,}-token chunk's activations)",
                         plan.get("peak", plan["total"]),
                         m["peak_allocated"]))
            rows.append((f"device in use after the {r['label']} prefill (mem_get_info)",
                         plan.get("peak", plan["total"]), m["device_used"]))
    out = [f"Memory against `beam-trt info ENGINE_DIR --context {plan['context']}` "
           f"({plan['precision']} weights):", "",
           "| memory | plan GiB | measured GiB | measured / plan |", "| --- | ---: | ---: | ---: |"]
    out += [f"| {name} | {p / GIB:.3f} | {m / GIB:.3f} | {m / p:.3f} |" for name, p, m in rows]
    return out
