"""`beam-trt convert` throughput and memory on full-size Beam expert matrices.

CPU (default), in one run, on a synthetic BF16 checkpoint of Beam-1.0 layer shapes (hidden
5120, 48/8 heads of 128, 16 experts of 5120x2560 a layer; --layers 2: ~2.9 GB, under --tmp,
deleted after): fp8-block, fp8 and nvfp4 conversions (weight-only) and `verify --against` of the
fp8-block output (logits off) in fresh subprocesses (MB/s of BF16 input, peak RSS); our and
ModelOpt's quantizers and decoders on the same expert matrices; calibration on the default set
(32 x 256 tokens) by beam-trt and by ModelOpt's mtq.quantize, per full-size layer; and the
tokens per expert a full-size Beam router (256 experts, random weights) gives the default set.

CUDA (--device cuda, no numba/ModelOpt needed): quantize rate of the torch encoders on the GPU
for expert matrices already on the device and with the host->device->host copies, and byte
identity of the GPU results with the CPU path on the same matrices (integer-generated inputs,
so both machines build the same bytes), plus the sha256 of the CPU results for comparison with
the numba path on the CPU box.

    python bench/convert_bench.py [--tmp /tmp] [--layers 2]       # CPU box: about 3.5 minutes
    PYTHONPATH=. python3 bench/convert_bench.py --device cuda      # GPU: about 1 minute
    python bench/convert_bench.py --smoke                          # CPU, a narrow model

Ceilings: ModelOpt's own quantizers, decoders and calibration on the same tensors in the same
run (the converter's targets: fp8-block >= 400 MB/s end to end, verify --against >= 300 MB/s
on the 2-core CPU box). Results: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from beam_trtllm import quant_formats as qf  # noqa: E402
from beam_trtllm.config import BeamConfig  # noqa: E402

MB = 1e6


def bench_config(layers: int, smoke: bool = False) -> BeamConfig:
    """Beam-1.0 shapes for every Linear, 16 experts a layer, a small vocabulary (--smoke: a
    narrow model of the same structure)."""
    narrow = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64) if smoke else {}
    return BeamConfig(vocab_size=512, num_hidden_layers=layers, num_experts=16, n_group=8,
                      topk_group=4, num_experts_per_tok=8,
                      layer_types=tuple(["sliding_attention"] * layers),
                      mlp_layer_types=tuple(["sparse"] * layers), **narrow)


# ---------------------------------------------------------------------------- CPU: checkpoints
def write_checkpoint(cfg: BeamConfig, out: Path, shard_bytes: int = 1_000_000_000) -> int:
    from beam_trtllm.checkpoint import INDEX_NAME, expected_tensors, shard_name
    from beam_trtllm.tiny import random_tensor
    from beam_trtllm.tokenizer import write_tokenizer_files
    from convert.st_io import PartialFile, header_for, nbytes_of

    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    write_tokenizer_files(out, cfg.vocab_size, cfg.max_position_embeddings)
    specs = list(expected_tensors(cfg).items())
    shards, used = [[]], 0
    for name, (shape, dtype) in specs:
        size = nbytes_of(dtype, shape)
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape, dtype))
        used += size
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = shard_name(k, len(shards))
        f = PartialFile(out / fname, header_for([(n, d, s) for n, s, d in shard]))
        for j, (name, shape, dtype) in enumerate(shard):
            f.write_tensor(random_tensor(cfg, name, shape, dtype, seed=k * 1000 + j))
            weight_map[name] = fname
        f.finish()
    total = sum(nbytes_of(d, s) for _, (s, d) in specs)
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": weight_map}))
    return total


CHILD = """
import json, sys, time
from convert.pipeline import ConvertOptions, convert
from convert.verification import verify
t = time.perf_counter()
if sys.argv[1] == "convert":
    convert(sys.argv[2], sys.argv[3], ConvertOptions(sys.argv[4], calib_data="none", workers=2))
else:  # verify OUT --against IN, logits skipped (a model of this size runs with them off)
    assert verify(sys.argv[3], sys.argv[2], max_model_gb=0)["ok"]
seconds = time.perf_counter() - t
# VmHWM: this process's peak RSS since exec (the parent's pages shared at fork time, which
# the rusage of a waited child would count, are not included)
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(json.dumps({"seconds": seconds, "vm_hwm_kb": hwm}))
"""

CALIB_CHILD = """
import json, sys, time, torch
import transformers.models.beam.modeling_beam  # both sides: imports before the clock starts
from convert.calib_data import load_calib_tokens
from convert.inputs import InputCheckpoint
src = InputCheckpoint(sys.argv[2])
ids = load_calib_tokens(src.dir, None, int(sys.argv[3]), int(sys.argv[4])).ids
if sys.argv[1] == "beam-trt":
    from convert.calibrate import calibrate
    t = time.perf_counter()
    calib = calibrate(src.cfg, src.read, ids, log=lambda m: None)
    extra = {"min_tokens_per_expert": min(min(c) for c in calib.expert_tokens.values())}
else:  # ModelOpt's own max calibration (mtq.quantize) of transformers' model on the same ids
    sys.path.insert(0, "tests")
    import modelopt.torch.quantization as mtq
    from modelopt_reference import load_bf16, modelopt_config
    t = time.perf_counter()  # loading counts: ours reads every layer from disk too
    model = load_bf16(src.dir)
    def loop(m):
        with torch.no_grad():
            m(input_ids=ids, use_cache=False)
    loaded = time.perf_counter()
    mtq.quantize(model, modelopt_config("fp8", kv_fp8=True), loop)
    extra = {"torch_threads": torch.get_num_threads(), "load_seconds": loaded - t}
print(json.dumps({"seconds": time.perf_counter() - t, **extra}))
"""


def run_child(script: str, *args) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{args[:2]} failed (status {status})")
    result = json.loads(stdout.decode().strip().splitlines()[-1])
    if "vm_hwm_kb" in result:
        result["peak_rss_mb"] = result.pop("vm_hwm_kb") / 1024
    result["cpu_seconds"] = usage.ru_utime + usage.ru_stime  # includes ~5 s of imports
    return result


def _timed(fn, items) -> float:
    fn(items[0])  # warm-up: numba's cached compile, first-touch of buffers
    t = time.perf_counter()
    for item in items:
        fn(item)
    return time.perf_counter() - t


def modelopt_rates(src: Path, count: int = 4) -> dict:
    """Seconds that ModelOpt's own quantizers (what export_hf_checkpoint calls) and decoders and
    ours take on the same expert matrices, each on one torch thread."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.export.quant_utils import to_quantized_weight
        from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from convert.encode_cpu import quantize_fp8_block
    from convert.inputs import InputCheckpoint
    from convert.verify_cpu import error_stats

    torch.set_num_threads(1)
    ckpt = InputCheckpoint(src)
    names = [n for n in ckpt.sources if n.endswith("experts.0.gate_proj.weight")][:1]
    names += [n.replace("experts.0.", f"experts.{e}.") for n in names for e in range(1, count)]
    weights = [ckpt.read(n) for n in names]
    mb = sum(w.numel() * 2 for w in weights) / MB
    blocks = {-1: 128, -2: 128}
    fp4 = [(w, NVFP4QTensor.quantize(w, 16)) for w in weights]
    fp8b = [(w, quantize_fp8_block(w)) for w in weights]

    def rel(w, deq):  # what verify computes, in torch
        return ((deq - w.float()).norm() / w.float().norm()).item()

    def mo_fp4_check(item):  # ModelOpt's decode, then the error in torch
        w, (qt, scale, scale_2) = item
        rel(w, qt.dequantize(torch.float32, scale=scale, double_scale=scale_2,
                             block_sizes={-1: 16}))

    def mo_fp8b_check(item):
        w, (q, scale) = item
        rel(w, FP8QTensor(w.shape, w.dtype, q).dequantize(torch.float32, scale=scale,
                                                          block_sizes=blocks))

    def ours_fp4_check(item):
        w, (qt, scale, scale_2) = item
        error_stats(qt._quantized_data, scale, scale_2, w)

    def fp8_scale(w):
        return torch.tensor(w.abs().amax().float().item() / 448.0)

    return {
        "quantize nvfp4": (_timed(lambda w: qf.quantize_nvfp4(w, threads=1), weights),
                           _timed(lambda w: NVFP4QTensor.quantize(w, 16), weights)),
        "quantize fp8": (_timed(qf.quantize_fp8, weights),
                         _timed(lambda w: to_quantized_weight(w, fp8_scale(w), "fp8"), weights)),
        "quantize fp8-block": (_timed(quantize_fp8_block, weights),
                               _timed(lambda w: FP8QTensor.quantize(w, block_sizes=blocks),
                                      weights)),
        "decode + error nvfp4": (_timed(ours_fp4_check, fp4), _timed(mo_fp4_check, fp4)),
        "decode + error fp8-block": (_timed(lambda i: error_stats(*i[1], None, i[0]), fp8b),
                                     _timed(mo_fp8b_check, fp8b)),
    }, mb


def _router_inputs(cfg, ids: torch.Tensor) -> torch.Tensor:
    """The MoE input of a full-size layer 0 on `ids`: transformers' attention and norms with
    random weights at transformers' init scale (N(0, 0.02), norms 1, biases 0), seed 0."""
    from transformers.models.beam.modeling_beam import (BeamAttention, BeamRMSNorm,
                                                        depth_scaled_residual_add)

    from convert.calibrate import _layer_inputs

    torch.manual_seed(0)
    attn = BeamAttention(cfg, 0).bfloat16()
    norms = [BeamRMSNorm(cfg.hidden_size, cfg.rms_norm_eps).bfloat16() for _ in range(3)]
    embed = (torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02).bfloat16()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
            else:  # q_norm / k_norm weights 1, the output gate's bias 0
                p.fill_(1.0 if "norm" in name else 0.0)
        h = embed[ids]
        inputs, position_ids = _layer_inputs(cfg, h)
        mask, rope, _ = inputs["sliding_attention"]
        a, _ = attn(norms[0](h), position_embeddings=rope, attention_mask=mask,
                    position_ids=position_ids)
        h = depth_scaled_residual_add(norms[1](a), h, 2)
        return norms[2](h).view(-1, cfg.hidden_size)


def router_coverage(calib_ids: torch.Tensor, tune_ids: torch.Tensor, smoke: bool = False) -> dict:
    """Tokens per expert that a full-size Beam router (256 experts, top-8, 8 groups / top-4;
    transformers' BeamTopKRouter, weight N(0, 0.02)) gives the calibration tokens: as drawn,
    and with its e_score_correction_bias fitted on other text (`tune_ids`, held-out documents)
    by DeepSeek-V3's aux-loss-free balancing update, the mechanism that bias exists for."""
    from transformers.models.beam.modeling_beam import BeamTopKRouter

    from beam_trtllm.config import preset
    from beam_trtllm.hf_model import hf_config

    cfg = hf_config(preset("tiny" if smoke else "beam-1.0-501b"), attn_implementation="sdpa")
    cfg.vocab_size = int(max(calib_ids.max(), tune_ids.max())) + 1
    x, tune = _router_inputs(cfg, calib_ids), _router_inputs(cfg, tune_ids)
    router = BeamTopKRouter(cfg)
    out = {}
    with torch.no_grad():
        router.weight.normal_(0.0, 0.02)

        def count(h):
            return torch.bincount(router(h)[2].flatten(), minlength=cfg.num_experts)

        out["random router"] = count(x)
        for step in range(400):  # b_e -= gamma * sign(load_e - mean load)
            load = count(tune).float()
            router.e_score_correction_bias -= (0.01 if step < 200 else 0.001) * torch.sign(
                load - load.mean())
        out["bias fitted on held-out text"] = count(x)
    return out


def cpu_main(args) -> None:
    from convert.calib_data import (DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, heldout_tokens,
                                    load_calib_tokens)

    samples, seq_len, heldout = (2, 16, 2) if args.smoke else (DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, 16)
    torch.set_num_threads(2)
    rows, summary = [], {}
    root = Path(tempfile.mkdtemp(prefix="beam-convert-bench-", dir=args.tmp))
    try:
        layers = args.layers
        src = root / "in"
        t = time.perf_counter()
        total = write_checkpoint(bench_config(layers, args.smoke), src)
        print(f"wrote {total / 1e9:.2f} GB synthetic checkpoint ({layers} layers) in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
        for recipe in args.recipes:
            out = root / f"out-{recipe}"
            r = run_child(CHILD, "convert", src, out, recipe)
            rows.append((f"convert {recipe}", total, r))
            print(rows[-1], flush=True)
            if recipe == "fp8-block":
                rows.append(("verify --against (fp8-block)", total,
                             run_child(CHILD, "verify", src, out)))
                print(rows[-1], flush=True)
            shutil.rmtree(out)
        rates, mb = modelopt_rates(src, count=1 if args.smoke else 4)
        torch.set_num_threads(2)
        for which in ("beam-trt", "ModelOpt"):
            r = run_child(CALIB_CHILD, which, src, samples, seq_len)
            summary[f"calibration {which}"] = r
            print(which, r, flush=True)
        counts = router_coverage(load_calib_tokens(src, None, samples, seq_len).ids,
                                 heldout_tokens(src, heldout, seq_len), args.smoke)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_tables(rows, rates, mb, summary, counts, layers)


def print_tables(rows, rates, mb, summary, counts, layers) -> None:
    rate = {name: total / r["seconds"] / MB for name, total, r in rows}
    ours, theirs = summary["calibration beam-trt"], summary["calibration ModelOpt"]
    print(f"\nload average {os.getloadavg()[0]:.1f}\n\n"
          "| metric | beam-trt | ModelOpt, same tensors |\n|---|---|---|")
    print(f"| fp8-block convert, end to end, MB/s | {rate['convert fp8-block']:.0f} | "
          f"{mb / rates['quantize fp8-block'][1]:.0f} (its quantizer alone, one thread) |")
    print(f"| verify --against, MB/s | {rate['verify --against (fp8-block)']:.0f} | "
          f"{mb / rates['decode + error fp8-block'][1]:.0f} (its decode + the error, one thread) |")
    print(f"| calibration, default set, s per full-size layer (16 experts) | "
          f"{ours['seconds'] / layers:.1f} | {theirs['seconds'] / layers:.1f} (from_pretrained + "
          f"mtq.quantize, {theirs['torch_threads']} threads; loading "
          f"{theirs['load_seconds']:.1f} s) |")
    print("\n| run | BF16 input GB | wall s | MB/s (wall) | CPU s (child) | peak RSS MB |\n"
          "|---|---|---|---|---|---|")
    for name, total, r in rows:
        print(f"| {name} | {total / 1e9:.2f} | {r['seconds']:.1f} | {rate[name]:.0f} | "
              f"{r['cpu_seconds']:.1f} | {r['peak_rss_mb']:.0f} |")
    print(f"\n| same {mb:.0f} MB of expert matrices, one thread | beam-trt MB/s | ModelOpt MB/s |"
          "\n|---|---|---|")
    for name, (a, b) in rates.items():
        print(f"| {name} | {mb / a:.0f} | {mb / b:.0f} |")
    print(f"\nbench layers: fewest calibration tokens an expert got "
          f"{ours['min_tokens_per_expert']}")
    for name, c in counts.items():
        c = c.float()
        print(f"full-size router (256 experts, top-8), {name}: default set's tokens per expert "
              f"min {int(c.min())}, median {int(c.median())}, max {int(c.max())}, "
              f"mean {c.mean():.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--recipes", nargs="+", default=["fp8-block", "fp8", "nvfp4"])
    ap.add_argument("--hashes", action="store_true", help="print the CPU-path hashes and exit")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU path on a narrow 1-layer model and 2 x 16 calibration tokens")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.device = 1, "cpu"
    if args.hashes:
        from _convert_cuda import hashes_here

        hashes_here()
    elif args.device == "cuda":
        from _convert_cuda import cuda_main

        cuda_main(args)
    else:
        cpu_main(args)


if __name__ == "__main__":
    main()
