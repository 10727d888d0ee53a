"""`beam-trt convert` throughput and memory on full-size Beam expert matrices.

CPU (default): writes two synthetic BF16 checkpoints with Beam-1.0 layer shapes (hidden 5120,
48/8 heads of 128, 16 experts of 5120x2560 per layer; 2 and 4 layers, ~2.9 and ~5.7 GB) under
--tmp, converts each to fp8 and nvfp4 in a fresh subprocess (weight-only scales: the synthetic
model has no meaningful activations) and reports MB/s of BF16 input and the child's peak RSS;
then times ModelOpt's own quantizers on the same expert matrices in this process. Deletes the
checkpoints afterwards.

CUDA (--device cuda, no numba/ModelOpt needed): quantize rate of the torch encoders on the GPU
for expert matrices already on the device and with the host->device->host copies, and byte
identity of the GPU results with the CPU path on the same matrices (integer-generated inputs,
so both machines build the same bytes), plus the sha256 of the CPU results for comparison with
the numba path on the CPU box.

    python bench/convert_bench.py [--tmp /tmp] [--layers 2 4]
    PYTHONPATH=. python3 bench/convert_bench.py --device cuda
"""

from __future__ import annotations

import argparse
import hashlib
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
sys.path.insert(0, str(ROOT))

from beam_trtllm import quant_formats as qf  # noqa: E402
from beam_trtllm.config import BeamConfig  # noqa: E402

EXPERT = (2560, 5120)  # gate/up [moe_intermediate, hidden]; down is its transpose
MB = 1e6


def bench_config(layers: int) -> BeamConfig:
    """Beam-1.0 shapes for every Linear, 16 experts a layer, a small vocabulary."""
    return BeamConfig(vocab_size=512, num_hidden_layers=layers, num_experts=16, n_group=8,
                      topk_group=4, num_experts_per_tok=8,
                      layer_types=tuple(["sliding_attention"] * layers),
                      mlp_layer_types=tuple(["sparse"] * layers))


def int_weight(shape, seed: int, device="cpu") -> torch.Tensor:
    """Deterministic BF16 weights from integer hashing only (identical on any machine/torch):
    magnitudes 2^-9..2^-3 with random mantissas and signs, like trained weights of std ~0.02."""
    n = shape[0] * shape[1]
    i = torch.arange(n, dtype=torch.int64, device=device) + seed * 0x9E3779B1
    h = (i * 2654435761 + 0x6A09E667) & 0xFFFFFFFF
    h = (h ^ (h >> 15)) * 2246822519 & 0xFFFFFFFF
    h = h ^ (h >> 13)
    sign = (h & 1) << 15
    exponent = 118 + (h >> 1) % 7  # 2^-9 .. 2^-3
    mantissa = (h >> 4) & 0x7F
    bits = (sign | (exponent << 7) | mantissa).to(torch.int32)
    bits = torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16)
    return bits.view(torch.bfloat16).reshape(shape)


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
import json, resource, sys, time
from convert.pipeline import ConvertOptions, convert
t = time.perf_counter()
convert(sys.argv[1], sys.argv[2], ConvertOptions(sys.argv[3], calib_data="none", workers=2))
seconds = time.perf_counter() - t
# VmHWM: this process's peak RSS since exec (the parent's pages shared at fork time, which
# the rusage of a waited child would count, are not included)
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(json.dumps({"seconds": seconds, "vm_hwm_kb": hwm}))
"""


def run_convert(src: Path, out: Path, recipe: str) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(out), recipe],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"convert {recipe} of {src} failed (status {status})")
    result = json.loads(stdout.decode().strip().splitlines()[-1])
    result["peak_rss_mb"] = result.pop("vm_hwm_kb") / 1024
    result["cpu_seconds"] = usage.ru_utime + usage.ru_stime  # includes ~5 s of imports
    return result


def modelopt_rates(src: Path, count: int = 4) -> dict:
    """ModelOpt's own quantizers (what export_hf_checkpoint calls) on expert matrices."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.export.quant_utils import to_quantized_weight
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from convert.inputs import InputCheckpoint

    ckpt = InputCheckpoint(src)
    names = [n for n in ckpt.sources if n.endswith("experts.0.gate_proj.weight")][:1]
    names += [n.replace("experts.0.", f"experts.{e}.") for n in names for e in range(1, count)]
    weights = [ckpt.read(n) for n in names]
    nbytes = sum(w.numel() * 2 for w in weights)
    rates = {}
    t = time.perf_counter()
    for w in weights:
        NVFP4QTensor.quantize(w, 16)
    rates["modelopt nvfp4"] = nbytes / (time.perf_counter() - t) / MB
    t = time.perf_counter()
    for w in weights:
        scale = torch.tensor(w.abs().amax().float().item() / 448.0)
        to_quantized_weight(w, scale, "fp8")
    rates["modelopt fp8"] = nbytes / (time.perf_counter() - t) / MB
    for threads in (1, 2):
        t = time.perf_counter()
        for w in weights:
            qf.quantize_nvfp4(w, threads=threads)
        rates[f"beam-trt nvfp4 encoder, {threads} thread(s)"] = nbytes / (time.perf_counter() - t) / MB
    return rates


def cpu_main(args) -> None:
    torch.set_num_threads(2)
    rows = []
    root = Path(tempfile.mkdtemp(prefix="beam-convert-bench-", dir=args.tmp))
    try:
        for layers in args.layers:
            src = root / f"in-{layers}"
            t = time.perf_counter()
            total = write_checkpoint(bench_config(layers), src)
            print(f"wrote {total / 1e9:.2f} GB synthetic checkpoint ({layers} layers) in "
                  f"{time.perf_counter() - t:.0f} s", flush=True)
            for recipe in args.recipes:
                out = root / f"out-{layers}-{recipe}"
                r = run_convert(src, out, recipe)
                rows.append((f"convert {recipe}", total, r["seconds"], total / r["seconds"] / MB,
                             r["peak_rss_mb"], r["cpu_seconds"], os.getloadavg()[0]))
                print(rows[-1], flush=True)
                shutil.rmtree(out)
            if layers == args.layers[0]:
                for name, rate in modelopt_rates(src).items():
                    rows.append((name, None, None, rate, None, None, os.getloadavg()[0]))
            shutil.rmtree(src)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n| run | BF16 input GB | wall s | MB/s (wall) | CPU s (child) | MB/s per 2 CPU-s | "
          "peak RSS MB | load avg |")
    print("|---|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    for name, total, secs, rate, rss, cpu, load in rows:
        per_cpu = None if cpu is None else total / (cpu / 2) / MB
        print(f"| {name} | {fmt(total and total / 1e9, '.2f')} | {fmt(secs, '.1f')} | {rate:.0f} | "
              f"{fmt(cpu, '.1f')} | {fmt(per_cpu, '.0f')} | {fmt(rss, '.0f')} | {load:.1f} |")


# ---------------------------------------------------------------------------- CUDA
def _sha(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def cuda_main(args) -> None:
    dev = torch.device("cuda")
    on_dev = [int_weight(EXPERT if i % 3 != 2 else EXPERT[::-1], seed=i, device=dev)
              for i in range(24)]
    mats = [m.cpu() for m in on_dev]
    nbytes = sum(m.numel() * 2 for m in mats)
    pinned = [m.pin_memory() for m in mats]
    rows = []
    for fmt, fn in (("nvfp4", lambda w: qf.quantize_nvfp4(w)), ("fp8", lambda w: qf.quantize_fp8(w)),
                    ("fp8-block", lambda w: qf.quantize_fp8_block(w))):
        for w in on_dev[:3]:
            fn(w)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        for w in on_dev:
            fn(w)
        torch.cuda.synchronize()
        rows.append((f"{fmt}, weights on GPU", nbytes / (time.perf_counter() - t) / 1e9))
        t = time.perf_counter()
        for w in pinned:
            out = fn(w.to(dev, non_blocking=True))
            [o.to("cpu") for o in out]
        torch.cuda.synchronize()
        rows.append((f"{fmt}, host -> GPU -> host", nbytes / (time.perf_counter() - t) / 1e9))
    same, hashes = [], {}
    for i, m in enumerate(mats[:3]):  # CPU torch path vs GPU, bytes
        gpu = qf._quantize_nvfp4_torch(m.to(dev), qf.nvfp4_scale_2(m.to(dev)))
        cpu = qf._quantize_nvfp4_torch(m, qf.nvfp4_scale_2(m))
        fast = qf.quantize_nvfp4(m, threads=4)  # numba path where numba is installed
        same.append((f"nvfp4 #{i}", _sha(*gpu) == _sha(*cpu) == _sha(*fast)))
        hashes[f"nvfp4 #{i}"] = _sha(*cpu)
        for fmt, fn in (("fp8", qf.quantize_fp8), ("fp8-block", qf.quantize_fp8_block)):
            g, c = fn(m.to(dev)), fn(m)
            same.append((f"{fmt} #{i}", _sha(*g) == _sha(*c)))
            hashes[f"{fmt} #{i}"] = _sha(*c)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("\n| quantize | GB/s of BF16 input |\n|---|---|")
    for name, rate in rows:
        print(f"| {name} | {rate:.1f} |")
    print(f"\nGPU bytes == CPU bytes on {len(same)} (matrix, format) pairs: "
          f"{all(ok for _, ok in same)}; differing: {[n for n, ok in same if not ok]}")
    print("CPU-path sha256 prefixes:", json.dumps(hashes))
    with tempfile.TemporaryDirectory() as tmp:
        print(e2e_cuda_check(Path(tmp))[-1])


def e2e_cuda_check(root: Path) -> list[str]:
    """The tiny Beam through the whole converter on CPU and on CUDA: weight-only outputs must
    be identical files; a calibrated CUDA run must verify."""
    from beam_trtllm.tiny import init_tiny
    from convert.pipeline import ConvertOptions, convert
    from convert.verification import verify

    tiny = init_tiny(root / "tiny", seed=0)
    lines = []
    for recipe in ("nvfp4", "fp8-block", "fp8"):
        outs = {}
        for device in ("cpu", "cuda"):
            out = convert(tiny, root / f"{recipe}-{device}",
                          ConvertOptions(recipe, "fp8", calib_data="none", device=device))
            outs[device] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()
                            if p.name != "manifest.json"}
        lines.append(f"tiny {recipe} weight-only: CPU files == CUDA files: {outs['cpu'] == outs['cuda']}")
        print(lines[-1], flush=True)  # now, in case a later step fails
    out = convert(tiny, root / "calib-cuda", ConvertOptions("nvfp4", "fp8", device="cuda"))
    report = verify(out, tiny)
    lines.append(f"tiny nvfp4 + FP8 KV calibrated on CUDA: verify ok={report['ok']}, "
                 f"KL {report['logits']['kl_mean']:.4f}, top-1 {report['logits']['top1_agreement']:.3f}")
    return lines


def hashes_here() -> None:
    """The same sha256 prefixes from this machine's CPU path (numba for NVFP4)."""
    mats = [int_weight(EXPERT if i % 3 != 2 else EXPERT[::-1], seed=i) for i in range(3)]
    out = {}
    for i, m in enumerate(mats):
        out[f"nvfp4 #{i}"] = _sha(*qf.quantize_nvfp4(m, threads=2))
        out[f"fp8 #{i}"] = _sha(*qf.quantize_fp8(m))
        out[f"fp8-block #{i}"] = _sha(*qf.quantize_fp8_block(m))
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--recipes", nargs="+", default=["fp8", "nvfp4"])
    ap.add_argument("--hashes", action="store_true", help="print the CPU-path hashes and exit")
    args = ap.parse_args()
    if args.hashes:
        hashes_here()
    elif args.device == "cuda":
        cuda_main(args)
    else:
        cpu_main(args)


if __name__ == "__main__":
    main()
