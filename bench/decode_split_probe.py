"""Eager batch-1 decode of the engine bench's layers (default 1 and 3: sliding and full MoE,
FP8, after an 8 x 2K prefill), three times each, for a kernel profiler to look at, e.g.:

    PYTHONPATH=.:bench ncu --kernel-name regex:_decode_split_kernel --launch-count 6 \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        python3 bench/decode_split_probe.py [LAYER ...]

(docs/BENCHMARKS.md session 15, run I). Needs a GPU."""
import sys

import torch

from engine_bench import bench_config, make_engine, prefill
from engine_bench_layers import chain_layer, decode_chunks, decode_inputs, layer_input


def main():
    device = torch.device("cuda")
    torch.manual_seed(0)
    engine = make_engine(bench_config(False), "fp8", device, max_num_tokens=8 * 2048)
    chunks, _ = prefill(engine, 8, 2048, device, iters=1)
    s, h = decode_inputs(engine, decode_chunks(engine, chunks), device)
    with torch.inference_mode():
        for i in [int(v) for v in sys.argv[1:]] or [1, 3]:
            x, xq = layer_input(engine.model, i, h)
            chain_layer(engine.model, i, h, x, xq, s, 3)
            torch.cuda.synchronize()
            print("layer", i, "done", flush=True)


if __name__ == "__main__":
    main()
