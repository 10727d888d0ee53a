"""The printed tables of bench/engine_bench.py: per format, the per-layer decode / prefill table
against the floors, the kernel timelines, the A/B rows and the whole-model decode; the peer's
line beside the engine's BF16 MoE layers."""

from __future__ import annotations

from _engine_layers import REPEATS


def print_peer(peer: dict, results: list[dict]) -> None:
    if "error" in peer:
        print(f"\npeer (torch.compile + CUDA graphs): FAILED {peer['error']}")
        return
    graph = "one graph" if peer.get("fullgraph") else "with graph breaks"
    print(f"\npeer: transformers BF16, torch.compile({peer['compile_mode']}, {graph}) + CUDA graphs, "
          f"static cache, {peer['experts']} experts, batch 1 at {peer['context']} context: "
          f"whole 4-layer step {peer['step_4']:.3f} ms, 1-layer step {peer['step_1']:.3f} ms, "
          f"{peer['per_moe_layer']:.4f} ms per MoE layer {peer['note']}")
    for r in results:
        moe = [l.get("decode_chained_ms") for l in r.get("layers", []) if "MoE" in l["kind"]]
        if moe and all(moe):
            mean = sum(moe) / len(moe)
            print(f"  {r['format']} engine: {mean:.4f} ms per MoE layer (chained graph), "
                  f"{peer['per_moe_layer'] / mean:.2f}x faster than the peer")


def print_table(results: list[dict], ceilings: dict) -> None:
    rates = ", ".join(f"{u.upper()} {ceilings[f'{u}_TFLOPs']:.0f} "
                      f"({ceilings.get(f'{u}_burst_TFLOPs', 0):.0f})" for u in ("bf16", "fp8", "fp32"))
    print(f"\nceilings: copy {ceilings['copy_GBps']:.0f} GB/s; sustained (burst) {rates} TFLOP/s")
    for r in results:
        if "peer" in r:
            print_peer(r["peer"], results)
            continue
        if "error" in r:
            print(f"\n{r['format']}: FAILED {r['error']}")
            continue
        print(f"\n{r['format']} (setup {r.get('setup_s', 0):.0f} s; errors: {r.get('errors', 'none')})")
        print(f"| layer | kind | decode b=1 ms | floor ms | x floor | in a graph of {REPEATS} ms "
              "| x floor | kernels | sum of kernel times ms | prefill 8x2K ms | GEMM floor ms | x floor "
              "| prefill alone ms | x floor | x burst floor |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for l in r["layers"]:
            for n in (l.get("kernel_names") or []) if l["layer"] == 1 else []:
                print(f"    layer 1 kernel {n}")
            dec = l["decode_ms"] or float("nan")
            chained = l.get("decode_chained_ms") or float("nan")
            alone = l.get("prefill_alone_ms") or float("nan")
            print(f"| {l['layer']} | {l['kind']} | {dec:.4f} | {l['decode_floor_ms']:.4f} | "
                  f"{dec / l['decode_floor_ms']:.2f} | {chained:.4f} | "
                  f"{chained / l['decode_floor_ms']:.2f} | {l['kernels']} (+{l['memcpy_memset']}) | "
                  f"{(l.get('kernel_us') or float('nan')) / 1e3:.4f} | "
                  f"{l['prefill_ms']:.2f} | {l['prefill_floor_ms']:.2f} | "
                  f"{l['prefill_ms'] / l['prefill_floor_ms']:.2f} | {alone:.2f} | "
                  f"{alone / l['prefill_floor_ms']:.2f} | "
                  f"{l['prefill_ms'] / l.get('prefill_floor_burst_ms', float('nan')):.2f} |")
        for i in sorted(int(k.removeprefix("timeline_layer")) for k in r
                        if k.startswith("timeline_layer")):
            for k in r[f"timeline_layer{i}"] or []:
                print(f"    layer {i} in the chained graph: {k}")
        for ab in r.get("chain_ab") or []:
            for i, rows in (ab.get("timelines") or {}).items():
                print(f"    {ab['chain']}: layer {i} ends after the previous kernel's end (us): "
                      + ", ".join(f"{k['name'].removeprefix('_').split('_kernel')[0]} "
                                  f"{k.get('after_prev_end_us', float('nan')):.1f}" for k in rows))
        for d in r.get("throughput_ab") or []:
            print(f"throughput A/B round {d['round']} {d['chain']}: batch {d['batch']} "
                  f"{d['step_ms']:.3f} ms/step")
        for name, ms in r.get("prefill_kernels_layer1") or []:
            print(f"    layer 1 prefill kernel {ms:8.3f} ms  {name}")
        for d in r.get("decode", []):
            print(f"decode batch {d['batch']}: {d['step_ms']:.3f} ms/step, {d['tokens_per_s']:.0f} tok/s "
                  f"({d['graph_steps']}/{d['steps']} steps in CUDA graphs)")
