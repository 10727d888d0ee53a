"""`beam-trt verify OUT_DIR [--against IN_DIR]`.

1. manifest.json exists (the conversion finished); every file it lists has its size and
   sha256, every weight file holds exactly the tensors (dtype, shape) it lists.
2. --against: each quantized Linear is decoded and compared with the input (relative
   Frobenius error, max abs error) by the compiled pass of `verify_cpu` (no full-size
   temporaries), tensors in parallel threads; unquantized tensors must equal the input cast to
   the output dtype (BF16; routers FP32) bit for bit. Any inf / NaN is a failure naming the
   tensor: in a stored weight or scale, in a decoded value, in the input; so is a scale that
   is not positive (weight_scale, weight_scale_2, input_scale) or not finite (k/v scales).
3. --against, model <= --max-model-gb in BF16: transformers' BeamForCausalLM (the canonical
   model, in FP32) runs on held-out text (`convert/data/heldout.jsonl`, documents that are not
   in the shipped calibration set) with the input weights as stored and with the dequantized
   weights; mean KL(input || quantized) per token and top-1 agreement of the next-token
   prediction; non-finite logits or KL fail. Weights only: activation and KV quantization are
   the kernels' business (tested there). An FP32 input's KL includes the cast to BF16 the
   output is written in.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from beam_trtllm.checkpoint import expected_tensors

from .dequantize import QuantizedCheckpoint
from .errors import ConvertError
from .outdir import MANIFEST
from .parallel import ordered_map
from .st_io import NAMES, TensorFile, sha256_file
from .verify_cpu import error_stats

# A decoded weight further than this from the input (relative Frobenius norm) is broken, not
# merely quantized: E4M3 keeps 3 mantissa bits (~2.5% typical), E2M1 with E4M3 block scales
# ~10% on Gaussian weights (shared/research/modelopt.md §4: 0.095).
REL_ERR_LIMIT = {"fp8": 0.06, "fp8_channel": 0.06, "nvfp4": 0.16}
LOGIT_TEXT_TOKENS = (4, 64)  # samples x tokens for the logits check
POSITIVE_SCALES = (".weight_scale", ".weight_scale_2", ".input_scale")
QUANTIZED = (torch.uint8, torch.float8_e4m3fn)


def _workers() -> int:
    return max(1, os.cpu_count() or 1)


def _check_file(out_dir: Path, name: str, info: dict) -> str | None:
    path = out_dir / name
    if not path.is_file():
        return f"{path}: listed in {MANIFEST} but missing"
    if path.stat().st_size != info["size"] or sha256_file(path) != info["sha256"]:
        return f"{path}: sha256/size differ from {MANIFEST} (corrupted or modified)"
    if "tensors" in info:
        specs = TensorFile(path).specs
        got = {n: {"dtype": NAMES[d], "shape": list(s)} for n, (d, s) in specs.items()}
        if got != info["tensors"]:
            return f"{path}: tensors differ from {MANIFEST}"
    return None


def _check_files(out_dir: Path, manifest: dict, problems: list[str]) -> int:
    listed = {**manifest["files"], **manifest["side_files"]}
    found = ordered_map(lambda item: _check_file(out_dir, *item), listed.items(), _workers(),
                        "beam-verify-hash")
    problems += [p for p in found if p is not None]
    return len(listed)


def _non_finite(t: torch.Tensor) -> int:
    if t.dtype == torch.float8_e4m3fn:
        return int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
    return int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0


def _check_scale(q: QuantizedCheckpoint, name: str) -> str | None:
    t = q.tensor(name)
    if t.dtype == torch.float8_e4m3fn:  # an NVFP4 block scale
        bad = _non_finite(t)
        return f"tensor {name}: {bad} NaN block scales" if bad else None
    if _non_finite(t) or (name.endswith(POSITIVE_SCALES) and bool((t <= 0).any())):
        kind = "positive finite" if name.endswith(POSITIVE_SCALES) else "finite"
        return f"tensor {name}: scale {t.flatten()[:4].tolist()} is not a {kind} number"
    return None


def _quantized_stats(q, src, name: str, stored: torch.Tensor):
    module = name[: -len(".weight")]
    scale_2 = q.tensor(module + ".weight_scale_2") if stored.dtype == torch.uint8 else None
    scale = q.tensor(module + ".weight_scale")
    fmt = "nvfp4" if stored.dtype == torch.uint8 else "fp8"
    if q.compressed_tensors:  # [N, 1] per-channel scale: decoded per row, exactly in FP32
        scale, fmt = scale.float().reshape(-1), "fp8_channel"
    st = error_stats(stored, scale, scale_2, src.read_stored(name))
    problems = []
    if st.bad_input:
        problems.append(f"tensor {name}: the input holds {st.bad_input} inf/NaN values")
    if st.bad_decoded:
        problems.append(f"tensor {name}: decodes to {st.bad_decoded} inf/NaN values (NaN codes "
                        f"or scales in {module}.weight / .weight_scale)")
    if not math.isfinite(st.rel):
        problems.append(f"tensor {name}: dequantization error is {st.rel} ({fmt})")
    elif st.rel > REL_ERR_LIMIT[fmt]:
        problems.append(f"tensor {name}: dequantization error {st.rel:.3f} > "
                        f"{REL_ERR_LIMIT[fmt]} ({fmt})")
    return fmt, st, problems


def _tensor_check(q, src, name: str):
    """(name, format or None, ErrorStats or None, problems) for one tensor of the BF16 layout."""
    stored = q.tensor(name)
    if stored.dtype in QUANTIZED:
        return (name, *_quantized_stats(q, src, name, stored))
    if _non_finite(stored):
        return name, None, None, [f"tensor {name}: holds {_non_finite(stored)} inf/NaN values"]
    if not torch.equal(stored, src.read(name)):  # the input cast to the output dtype
        return name, None, None, [f"tensor {name}: unquantized but differs from the input"]
    return name, None, None, []


def _tensor_errors(q: QuantizedCheckpoint, src, problems: list[str]) -> dict:
    stats: dict[str, list[float]] = {}
    worst = []
    names = list(expected_tensors(q.cfg))
    scales = [n for n in q.names() if n not in set(names)]
    problems += [p for p in ordered_map(lambda n: _check_scale(q, n), scales, _workers())
                 if p is not None]
    for name, fmt, st, found in ordered_map(lambda n: _tensor_check(q, src, n), names,
                                            _workers(), "beam-verify"):
        problems += found
        if st is not None:
            stats.setdefault(fmt, []).append(st.rel)
            worst.append((st.rel, name, st.max_abs))
    worst.sort(key=lambda w: (not math.isfinite(w[0]), w[0]), reverse=True)
    return {"by_format": {f: {"tensors": len(v), "mean_rel_err": sum(v) / len(v),
                              "max_rel_err": max(v)} for f, v in stats.items()},
            "worst": [{"tensor": n, "rel_err": r, "max_abs_err": a} for r, n, a in worst[:5]]}


@torch.inference_mode()
def _logits(q: QuantizedCheckpoint, src, problems: list[str]) -> dict:
    """KL and top-1 of transformers' BeamForCausalLM (FP32) on the input as stored against the
    same model on the dequantized weights, on held-out text."""
    from beam_trtllm.hf_model import logits, model_from_state_dict

    from .calib_data import heldout_tokens

    ids = heldout_tokens(src.dir, *LOGIT_TEXT_TOKENS)
    names = expected_tensors(q.cfg)
    ref = model_from_state_dict(q.cfg, {n: src.read_stored(n) for n in names}, torch.float32)
    p = torch.log_softmax(logits(ref, ids), -1)
    del ref
    quant = model_from_state_dict(
        q.cfg, {n: q.dequant_tensor(n).to(d) for n, (_, d) in names.items()}, torch.float32)
    lq = torch.log_softmax(logits(quant, ids), -1)
    kl = (p.exp() * (p - lq)).sum(-1).mean().item()
    top1 = (p.argmax(-1) == lq.argmax(-1)).float().mean().item()
    for what, lp in (("the input's", p), ("the quantized model's", lq)):
        if _non_finite(lp):
            problems.append(f"logits: {what} model gives {_non_finite(lp)} inf/NaN "
                            "log-probabilities on the held-out text")
    if not math.isfinite(kl):
        problems.append(f"logits: KL(input || quantized) is {kl}")
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
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the tensors run in parallel threads instead
        try:
            report["tensors"] = _tensor_errors(q, src, problems)
        finally:
            torch.set_num_threads(threads)
        gb = q.cfg.total_params * 2 / 1e9
        report["logits"] = _logits(q, src, problems) if gb <= max_model_gb else {
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
        lines.append(f"  logits vs the input over {lg['tokens']} held-out tokens: KL "
                     f"{lg['kl_mean']:.5f} nats/token, top-1 agreement "
                     f"{100 * lg['top1_agreement']:.1f}%")
    elif lg:
        lines.append(f"  logits check skipped: {lg['skipped']}")
    lines += [f"  PROBLEM: {p}" for p in r["problems"]]
    lines.append("OK" if r["ok"] else "FAILED")
    return "\n".join(lines)
