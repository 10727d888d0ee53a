"""The CUDA side of bench/convert_bench.py (`--device cuda`, `--hashes`): quantize rates of the
torch encoders on the GPU (weights on the device, and with the host->device->host copies),
byte identity of the GPU results with the CPU path on integer-generated matrices (both
machines build the same bytes), the tiny Beam through the whole converter on CPU and CUDA, and
the CPU path's sha256 prefixes for comparison across machines."""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path

import torch

from beam_trtllm import quant_formats as qf


EXPERT = (2560, 5120)  # gate/up [moe_intermediate, hidden]; down is its transpose


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
