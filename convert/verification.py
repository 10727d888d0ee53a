"""`beam-trt verify OUT_DIR [--against IN_DIR]`.

1. manifest.json exists (the conversion finished); every file it lists has its size and
   sha256, every weight file holds exactly the tensors (dtype, shape) it lists.
2. --against: each quantized Linear is decoded and compared with the input (relative
   Frobenius error, max abs error), one tensor at a time; unquantized tensors must equal the
   input cast to the output dtype (BF16; routers FP32) bit for bit.
3. --against, model <= --max-model-gb in BF16: transformers' BeamForCausalLM (the canonical
   model, in FP32) runs on held-out text with the input weights as stored and with the
   dequantized weights; mean KL(input || quantized) per token and top-1 agreement of the
   next-token prediction. Weights only: activation and KV quantization are the kernels'
   business (tested there). An FP32 input's KL includes the cast to BF16 the output is
   written in.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from beam_trtllm.checkpoint import expected_tensors

from .dequantize import QuantizedCheckpoint
from .errors import ConvertError
from .manifest import MANIFEST
from .st_io import NAMES, TensorFile, sha256_file

# A decoded weight further than this from the input (relative Frobenius norm) is broken, not
# merely quantized: E4M3 keeps 3 mantissa bits (~2.5% typical), E2M1 with E4M3 block scales
# ~10% on Gaussian weights (shared/research/modelopt.md §4: 0.095).
REL_ERR_LIMIT = {"fp8": 0.06, "nvfp4": 0.16}
LOGIT_TEXT_TOKENS = (4, 64)  # samples x tokens for the logits check


def _check_files(out_dir: Path, manifest: dict, problems: list[str]) -> int:
    count = 0
    for name, info in {**manifest["files"], **manifest["side_files"]}.items():
        path = out_dir / name
        count += 1
        if not path.is_file():
            problems.append(f"{path}: listed in {MANIFEST} but missing")
            continue
        if path.stat().st_size != info["size"] or sha256_file(path) != info["sha256"]:
            problems.append(f"{path}: sha256/size differ from {MANIFEST} (corrupted or modified)")
            continue
        if "tensors" in info:
            specs = TensorFile(path).specs
            got = {n: {"dtype": NAMES[d], "shape": list(s)} for n, (d, s) in specs.items()}
            if got != info["tensors"]:
                problems.append(f"{path}: tensors differ from {MANIFEST}")
    return count


def _tensor_errors(q: QuantizedCheckpoint, src, problems: list[str]) -> dict:
    stats: dict[str, list[float]] = {}
    worst = []
    for name in expected_tensors(q.cfg):
        stored = q.tensor(name)
        if stored.dtype not in (torch.uint8, torch.float8_e4m3fn):
            if not torch.equal(stored, src.read(name)):  # the input cast to the output dtype
                problems.append(f"tensor {name}: unquantized but differs from the input")
            continue
        fmt = "nvfp4" if stored.dtype == torch.uint8 else "fp8"
        deq, ref32 = q.dequant_tensor(name), src.read_stored(name).float()
        rel = ((deq - ref32).norm() / ref32.norm().clamp_min(1e-30)).item()
        stats.setdefault(fmt, []).append(rel)
        worst.append((rel, name, (deq - ref32).abs().max().item()))
        if rel > REL_ERR_LIMIT[fmt]:
            problems.append(f"tensor {name}: dequantization error {rel:.3f} > {REL_ERR_LIMIT[fmt]} ({fmt})")
    worst.sort(reverse=True)
    return {"by_format": {f: {"tensors": len(v), "mean_rel_err": sum(v) / len(v), "max_rel_err": max(v)}
                          for f, v in stats.items()},
            "worst": [{"tensor": n, "rel_err": r, "max_abs_err": a} for r, n, a in worst[:5]]}


@torch.inference_mode()
def _logits(q: QuantizedCheckpoint, src) -> dict:
    """KL and top-1 of transformers' BeamForCausalLM (FP32) on the input as stored against the
    same model on the dequantized weights."""
    from beam_trtllm.hf_model import logits, model_from_state_dict

    from .calib_data import load_calib_tokens

    samples, seq = LOGIT_TEXT_TOKENS
    ids = load_calib_tokens(src.dir, None, samples * 2, seq).ids[samples:]  # not the calib windows
    names = expected_tensors(q.cfg)
    ref = model_from_state_dict(q.cfg, {n: src.read_stored(n) for n in names}, torch.float32)
    p = torch.log_softmax(logits(ref, ids), -1)
    del ref
    quant = model_from_state_dict(
        q.cfg, {n: q.dequant_tensor(n).to(d) for n, (_, d) in names.items()}, torch.float32)
    lq = torch.log_softmax(logits(quant, ids), -1)
    kl = (p.exp() * (p - lq)).sum(-1).mean().item()
    top1 = (p.argmax(-1) == lq.argmax(-1)).float().mean().item()
    return {"tokens": ids.numel(), "kl_mean": kl, "top1_agreement": top1}


def verify(out_dir: str | Path, against: str | Path | None = None, max_model_gb: float = 4.0) -> dict:
    out_dir = Path(out_dir)
    problems: list[str] = []
    report: dict = {"dir": str(out_dir), "problems": problems}
    if not (out_dir / MANIFEST).is_file():
        raise ConvertError(f"{out_dir}: no {MANIFEST}: the conversion did not finish (rerun the "
                           "same `beam-trt convert` command to resume it)")
    manifest = json.loads((out_dir / MANIFEST).read_text())
    report["files_checked"] = _check_files(out_dir, manifest, problems)
    report["recipe"] = manifest["recipe"]["name"]
    report["calibration"] = manifest["calibration"]["mode"]
    if against is not None and not problems:
        from .inputs import InputCheckpoint

        src = InputCheckpoint(against)
        if src.fingerprint() != manifest["input"]["files"]:
            problems.append(f"{against}: not the input this checkpoint was converted from")
        q = QuantizedCheckpoint(out_dir)
        report["tensors"] = _tensor_errors(q, src, problems)
        gb = q.cfg.total_params * 2 / 1e9
        report["logits"] = _logits(q, src) if gb <= max_model_gb else {
            "skipped": f"{gb:.0f} GB in BF16 > --max-model-gb {max_model_gb}"}
    report["ok"] = not problems
    return report


def format_report(r: dict) -> str:
    lines = [f"{r['dir']}: {r['files_checked']} files match manifest.json "
             f"(recipe {r['recipe']}, calibration {r['calibration']})"]
    for fmt, s in r.get("tensors", {}).get("by_format", {}).items():
        lines.append(f"  {fmt:6s} {s['tensors']:5d} tensors  rel. error mean {s['mean_rel_err']:.4f}"
                     f"  max {s['max_rel_err']:.4f}")
    lg = r.get("logits")
    if lg and "kl_mean" in lg:
        lines.append(f"  logits vs the input over {lg['tokens']} tokens: KL {lg['kl_mean']:.5f} "
                     f"nats/token, top-1 agreement {100 * lg['top1_agreement']:.1f}%")
    elif lg:
        lines.append(f"  logits check skipped: {lg['skipped']}")
    lines += [f"  PROBLEM: {p}" for p in r["problems"]]
    lines.append("OK" if r["ok"] else "FAILED")
    return "\n".join(lines)
