"""Parallel-engine benchmark: per-layer decode and 8 x 2K prefill of a full-width Beam at
TP2 / EP2 / attention-DP2+EP2 against one GPU, over NCCL.

    PYTHONPATH=. python3 bench/engine_bench_parallel.py [--layouts tp1,tp2,ep2,dp2ep2] [--out F]
    PYTHONPATH=. python3 bench/engine_bench_parallel.py --smoke   # CPU, gloo, 2 ranks, seconds

The model is bench/_engine_model.py's (Beam-1.0 at full width cut to 4 layers: 0 dense
sliding, 1-2 MoE sliding, 3 MoE full; FP8 W8A8 or NVFP4 MLPs, FP8 attention projections),
each rank's random weights made on its GPU in its own shapes (its heads, MLP columns and
experts; the replicated tensors drawn from one seed, so they agree across ranks). Layouts
(docs/ENGINE.md "Parallelism"): tp1 (one GPU, no collectives), tp2 (heads and dense columns
split, experts split by columns, moe_tp 2), ep2 (tp 2 ep 2: heads split, experts 128 a rank),
dp2ep2 (attention DP: 8 x 2K prompts a rank, the MoE over both ranks' tokens). Reported per
layout and layer (rank 0's times; every rank runs the same collectives):
- decode: eager one-token step at batch 1 and 8 (the prefilled 2K prompts), ms per layer;
  collectives included, no CUDA graphs (the parallel engine runs its ranks eagerly);
- prefill: 8 x 2K tokens in one chunk (per rank under attention DP), ms per layer.
Needs as many GPUs as the largest layout's world (2); on one GPU only tp1 runs. --smoke
--layouts tp1,ep2 takes about 10 s on the 2-core CPU box; not yet run on two GPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

LAYOUTS = {"tp1": None, "tp2": (2, 1, False), "ep2": (2, 2, False), "dp2ep2": (2, 2, True)}


def rank_engine(cfg, mapping, fmt: str, device, max_num_tokens: int):
    """This rank's Engine of the bench model: its own shapes, made on the device."""
    import torch

    from _engine_model import random_weights
    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.parallel import rank_of
    from beam_trtllm.engine.plan import BuildOptions, kv_plan

    cuda = device.type == "cuda"
    opts = BuildOptions(target="sm90" if cuda else "cpu", max_batch=64 if cuda else 4,
                        max_seq_len=4096 if cuda else 256, max_num_tokens=max_num_tokens,
                        block_size=32 if cuda else 8, kv_memory_gib=4.0 if cuda else 0.01)
    if mapping is None:
        torch.manual_seed(0)
        weights, plan = random_weights(cfg, fmt, device)
        return Engine(cfg, weights, plan, opts, kv_plan(cfg, opts, "bf16"), device,
                      use_cuda_graphs=False)
    q, kv = mapping.heads(cfg)
    local = cfg.replace(num_attention_heads=len(q), num_key_value_heads=len(kv),
                        intermediate_size=cfg.intermediate_size // mapping.attn_tp,
                        moe_intermediate_size=cfg.moe_intermediate_size // mapping.moe_tp,
                        num_experts=cfg.num_experts // mapping.ep)
    torch.manual_seed(0)
    weights, plan = random_weights(local, fmt, device)
    for li in cfg.moe_layers:  # the router is whole on every rank (FP32, replicated)
        p = f"model.layers.{li}.mlp.gate."
        weights[p + "weight"] = torch.randn(cfg.num_experts, cfg.hidden_size, device=device) \
            / cfg.hidden_size ** 0.5
        weights[p + "e_score_correction_bias"] = 0.05 * torch.randn(cfg.num_experts, device=device)
    spec = type("Spec", (), {"parallel": mapping, "cfg": cfg})
    return Engine(cfg, weights, plan, opts, kv_plan(mapping.local_config(cfg), opts, "bf16"),
                  device, use_cuda_graphs=False, parallel=rank_of(spec, device))


def per_layer_ms(engine, chunks, device, iters: int) -> list[float]:
    """Median ms of each layer's forward over one step of `chunks` (collectives included)."""
    import torch

    from _engine_layers import cuda_time, layer_input
    from beam_trtllm.engine.batch import build_step

    s = build_step(chunks, engine.kv_plan.block_size, engine.cfg.sliding_window, device)
    model, out = engine.model, []
    tokens = s.input_ids.shape[0]
    with torch.inference_mode():
        h = torch.nn.functional.embedding(s.input_ids, model.embed)
        for i in range(len(model.layers)):
            x, xq = layer_input(model, i, h)

            def run(i=i, x=x, xq=xq):
                if engine.parallel is not None and engine.parallel.mapping.attention_dp:
                    engine.parallel.comm.exchange_counts(tokens)
                model.layer(i, h, x, xq, s)

            run()  # compiles the kernels
            out.append(cuda_time(run, iters, device))
    return out


def bench_rank(rank: int, layout: str, fmt: str, smoke: bool) -> dict:
    import torch

    from _engine_layers import decode_chunks
    from _engine_model import bench_config
    from beam_trtllm.engine.parallel import ParallelMapping
    from beam_trtllm.engine.types import SamplingParams

    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    cfg = bench_config(smoke)
    seqs, seq_len = (2, 40) if smoke else (8, 2048)
    spec = LAYOUTS[layout]
    mapping = None if spec is None else ParallelMapping(*spec, rank=rank)
    t = time.perf_counter()
    engine = rank_engine(cfg, mapping, fmt, device, seqs * seq_len)
    res = {"layout": layout, "mapping": None if mapping is None else mapping.to_json(),
           "format": fmt, "setup_s": time.perf_counter() - t}
    for k in range(seqs):
        prompt = torch.randint(0, cfg.vocab_size - 8, (seq_len,)).tolist()
        engine.add_request(f"p{k}", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    chunks = engine.scheduler.schedule()
    iters = 2 if smoke else 5
    res["prefill_ms"] = per_layer_ms(engine, chunks, device, iters)
    res["prefill_tokens"] = sum(c.n for c in chunks)
    with torch.inference_mode():  # the whole prefill once, committed: the decodes' context
        from beam_trtllm.engine.batch import build_step

        step = build_step(chunks, engine.kv_plan.block_size, cfg.sliding_window, device)
        engine._after_forward(chunks, engine.model.forward(step))
    for batch in (1, seqs):
        res[f"decode_b{batch}_ms"] = per_layer_ms(engine, decode_chunks(engine, chunks, batch),
                                                  device, 5 if smoke else 50)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="tp1,tp2,ep2,dp2ep2",
                    help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--format", default="fp8", choices=["fp8", "nvfp4", "bf16"])
    ap.add_argument("--smoke", action="store_true", help="narrow config, CPU ranks over gloo")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    from beam_trtllm.engine.parallel.launch import launch

    results = []
    for layout in args.layouts.split(","):
        if layout not in LAYOUTS:
            ap.error(f"--layouts: unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
        world = 1 if LAYOUTS[layout] is None else LAYOUTS[layout][0]
        t = time.perf_counter()
        if LAYOUTS[layout] is None:
            res = bench_rank(0, layout, args.format, args.smoke)
        else:
            res = launch(world, bench_rank, layout, args.format, args.smoke,
                         device="cpu" if args.smoke else "cuda", timeout_s=1800)[0]
        res["wall_s"] = time.perf_counter() - t
        results.append(res)
        print(f"{layout:7s} prefill {res['prefill_tokens']} tokens/rank: "
              + " ".join(f"{v:.2f}" for v in res["prefill_ms"]) + " ms/layer; decode b1: "
              + " ".join(f"{v:.3f}" for v in res["decode_b1_ms"]) + " ms/layer"
              + f"  [{res['wall_s']:.0f} s]", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
