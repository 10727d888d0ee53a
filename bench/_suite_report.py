"""bench/suite.py's output: the flat list of metrics that bench/compare.py matches run to run,
and the Markdown tables (the machine and code first, then one table per benchmark, each with
the ceilings its step measured)."""

from __future__ import annotations

from _common import table as kernel_table

LOWER, HIGHER = "lower", "higher"


def metric(key: str, value, unit: str, better: str = LOWER, **extra) -> dict:
    return dict(key=key, value=value, unit=unit, better=better, **extra)


def _kernel_data(step: dict) -> dict | None:
    for data in step.get("data", {}).values():
        if isinstance(data, dict) and isinstance(data.get("rows"), list) and "ceilings" in data:
            return data
    return None


def _engine_results(step: dict) -> tuple[dict, list[dict]]:
    data = step.get("data", {}).get("engine_bench.json") or {}
    return data.get("ceilings", {}), data.get("results", [])


def metrics(suite: dict) -> list[dict]:
    """Every number worth comparing: kernel times and shares of their ceilings, per-layer
    decode / prefill times and their multiples of the floor, whole-model steps, ceilings."""
    out = []
    for name, step in suite["steps"].items():
        data = _kernel_data(step)
        if data:
            out += _kernel_metrics(name, data)
        ceilings, results = _engine_results(step)
        if results:
            out += [metric(f"{name}/ceiling/{k}", v, k.split("_")[-1], HIGHER)
                    for k, v in ceilings.items() if isinstance(v, (int, float))]
            for r in results:
                out += _engine_metrics(name, r)
    return out


def _kernel_metrics(name: str, data: dict) -> list[dict]:
    out = [metric(f"{name}/ceiling/{k}", v, k.split("_")[-1], HIGHER)
           for k, v in data["ceilings"].items()]
    for r in data["rows"]:
        key = f"{name}/{r['op']} {r['shape']}"
        out.append(metric(key + " us", r["ours_us"], "us", pct_of_ceiling=r["pct"]))
    for m in data.get("moe", []):
        if "x_floor" in m:
            out.append(metric(f"{name}/moe_{m['fmt']} T={m['t']} x floor", m["x_floor"], "x"))
    return out


def _engine_metrics(name: str, r: dict) -> list[dict]:
    fmt = r.get("format")
    if "peer" in r:
        peer = r["peer"]
        return [metric(f"{name}/peer ms per MoE layer", peer["per_moe_layer"], "ms")] \
            if "per_moe_layer" in peer else []
    out = []
    for layer in r.get("layers", []):
        key = f"{name}/{fmt} layer {layer['layer']} {layer['kind']}"
        chained, floor = layer.get("decode_chained_ms"), layer["decode_floor_ms"]
        if chained:
            out += [metric(f"{key} decode ms", chained, "ms"),
                    metric(f"{key} decode x floor", chained / floor, "x")]
        out += [metric(f"{key} prefill ms", layer["prefill_ms"], "ms"),
                metric(f"{key} prefill x floor", layer["prefill_ms"] / layer["prefill_floor_ms"],
                       "x")]
        if layer.get("kernels") is not None:
            out.append(metric(f"{key} kernels", layer["kernels"], "launches"))
    for d in r.get("decode", []):
        out.append(metric(f"{name}/{fmt} whole model batch {d['batch']} ms/step", d["step_ms"],
                          "ms"))
        out.append(metric(f"{name}/{fmt} whole model batch {d['batch']} tok/s",
                          d["tokens_per_s"], "tok/s", HIGHER))
    return out


# ---------------------------------------------------------------------------- Markdown
def render(suite: dict) -> str:
    env = suite["env"]
    v = env["versions"]
    lines = [f"# Benchmark suite, {env['date']}", "",
             f"Commit {env['commit']}{' (uncommitted changes)' if env['dirty'] else ''}; "
             f"{env['machine']} x {env['gpus']}; Python {v['python']}, torch {v['torch']} "
             f"(CUDA {v['cuda']}), Triton {v['triton']}, transformers {v['transformers']}; "
             f"{suite['seconds']:.0f} s of {suite['budget_s']:.0f} s budget"
             f"{'; --smoke (CPU: the numbers say nothing about speed)' if suite['smoke'] else ''}.",
             "", "| step | command | exit | seconds |", "| --- | --- | --- | ---: |"]
    for name, step in suite["steps"].items():
        lines.append(f"| {name} | `{step.get('cmd', '-')}` | {step['rc']} | {step['seconds']} |")
    for name, step in suite["steps"].items():
        data = _kernel_data(step)
        if data:
            lines += ["", f"## {name}", "", kernel_table(data["ceilings"], data["rows"])]
        ceilings, results = _engine_results(step)
        if results:
            lines += ["", f"## {name}", "", _ceilings_line(ceilings)]
            lines += _engine_tables(results)
        if step["rc"] != 0:
            lines += ["", f"{name}: exit {step['rc']}; last lines of its log:", "", "```",
                      step["log_tail"][-1500:].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _ceilings_line(c: dict) -> str:
    """engine_bench's GEMM rates are sustained ones with the bursts beside them (its
    _measure_ceilings); the kernel benchmarks' have no bursts entry."""
    def rate(u: str) -> str:
        burst = c.get(f"{u}_burst_TFLOPs")
        return f"{c.get(f'{u}_TFLOPs', 0):.1f}" + (f" ({burst:.1f} in bursts)" if burst else "")
    return (f"Ceilings measured in this step: copy {c.get('copy_GBps', 0):.0f} GB/s, BF16 "
            f"{rate('bf16')}, FP8 {rate('fp8')}, FP32 {rate('fp32')} TFLOP/s.")


def _engine_tables(results: list[dict]) -> list[str]:
    lines = ["", "| format | layer | kind | decode b=1 ms (chained) | floor ms | x floor | "
             "kernels | prefill 8x2K ms | GEMM floor ms | x floor |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    whole, peers = [], []
    for r in results:
        if "peer" in r:
            peers.append(r["peer"])
            continue
        if "error" in r:
            lines.append(f"| {r['format']} | failed: {r['error']} | | | | | | | | |")
            continue
        for l in r["layers"]:
            chained = l.get("decode_chained_ms") or float("nan")
            lines.append(f"| {r['format']} | {l['layer']} | {l['kind']} | {chained:.4f} | "
                         f"{l['decode_floor_ms']:.4f} | {chained / l['decode_floor_ms']:.2f} | "
                         f"{l.get('kernels')} | {l['prefill_ms']:.2f} | "
                         f"{l['prefill_floor_ms']:.2f} | "
                         f"{l['prefill_ms'] / l['prefill_floor_ms']:.2f} |")
        whole += [(r["format"], d) for d in r.get("decode", [])]
        if r.get("errors"):
            lines.append(f"\n{r['format']}: sections that failed: {r['errors']}")
    if whole:
        lines += ["", "| format | whole-model decode batch | ms/step | tokens/s | steps in "
                  "CUDA graphs |", "| --- | ---: | ---: | ---: | --- |"]
        lines += [f"| {fmt} | {d['batch']} | {d['step_ms']:.3f} | {d['tokens_per_s']:.0f} | "
                  f"{d['graph_steps']}/{d['steps']} |" for fmt, d in whole]
    for p in peers:
        if "error" in p:
            lines += ["", f"peer: failed: {p['error']}"]
            continue
        lines += ["", f"peer (transformers BF16, torch.compile({p['compile_mode']}), "
                  f"{'one graph' if p.get('fullgraph') else 'with graph breaks'}, static "
                  f"cache): {p['per_moe_layer']:.4f} ms per MoE layer, whole 4-layer step "
                  f"{p['step_4']:.3f} ms {p['note']}"]
    return lines
