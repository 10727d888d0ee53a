"""`beam-trt convert`: read -> quantize -> shard -> write, one unit at a time, resumable.

    units (plan) --read+hash--> input tensors --quantize--> output tensors --shard+write--> files

Reading and quantizing run in `workers` threads (numba and torch release the GIL) over a
bounded, ordered window of units, so at most 2 * workers units are in memory; the writer
consumes them in plan order. Peak RSS: the largest units in flight (one tensor or one fused
group each), plus one decoder layer and one expert during calibration.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from beam_trtllm.checkpoint import INDEX_NAME

from .calib_data import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, load_calib_tokens
from .calibrate import Calibration, calibrate
from .errors import ConvertError
from .hfconfig import hf_quant_config, quantization_config
from .inputs import SIDE_FILES, InputCheckpoint
from .manifest import write_manifest
from .outdir import CALIB_STATE, atomic_copy, atomic_write_text, prepare_out_dir
from .outputs import Writer, file_sizes, hf_layout, index_text_size, trtllm_layout, write_index
from .parallel import ordered_map
from .plan import make_plan
from .quantize import quantize_unit
from .recipe import load_recipe
from .shard import check_mapping
from .trtllm import trtllm_config

COMMIT_BYTES, COMMIT_SECONDS = 256 << 20, 2.0
CT = "compressed-tensors"  # --format
MIN_EXPERT_TOKENS = 16  # fewer calibration tokens for an expert than this: warn


@dataclass
class ConvertOptions:
    quant: str
    kv_cache: str = "none"  # "fp8" | "none"
    fmt: str = "hf"  # "hf" | "trtllm" | "compressed-tensors"
    tp: int = 1
    ep: int = 1
    calib_data: str | None = None  # None: the shipped text; "none": weight-only
    calib_samples: int = DEFAULT_SAMPLES
    calib_seq_len: int = DEFAULT_SEQ_LEN
    device: str = "cpu"
    workers: int = max(1, os.cpu_count() or 1)
    shard_size_mb: float = 5000.0
    overwrite: bool = False  # remove OUT_DIR's checkpoint files first (outdir.py)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _check_dirs(src: InputCheckpoint, out_dir: Path) -> None:
    out = out_dir.resolve()
    if out == src.dir.resolve():
        raise ConvertError(f"OUT_DIR {out_dir} is the input directory; the input is never overwritten")
    for f in src.files:
        if f.resolve().parent == out:
            raise ConvertError(f"OUT_DIR {out_dir} holds input file {f.name}; choose another OUT_DIR")


def _calibration_tokens(src: InputCheckpoint, opts: ConvertOptions):
    if opts.fmt == CT:
        return None, "compressed-tensors FP8_DYNAMIC: activations are scaled per token at run time"
    if opts.calib_data == "none" or opts.calib_samples == 0:
        return None, "no calibration data (--calib-data none / --calib-samples 0)"
    if opts.calib_data is None and not (src.dir / "tokenizer.json").is_file():
        return None, f"{src.dir} has no tokenizer.json to tokenize the calibration text"
    return load_calib_tokens(src.dir, opts.calib_data, opts.calib_samples, opts.calib_seq_len), ""


def _plan_hash(src, opts, plan, files, tokens) -> str:
    options = asdict(opts) | {"workers": None, "overwrite": None}  # neither changes the output
    key = {"options": options, "recipe": plan.recipe.to_json(),
           "input": src.fingerprint(), "config": src.config_json,
           "calib": None if tokens is None else tokens.sha256,
           "files": [[f.name, [[n, str(w), str(d), list(s)] for n, w, d, s in f.specs]] for f in files]}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _run_calibration(src, tokens, out_dir: Path, plan_hash: str, device) -> Calibration:
    """Calibrate, or reuse the journaled result of an interrupted run of the same plan."""
    path = out_dir / CALIB_STATE
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            saved = {}
        if saved.get("plan_hash") == plan_hash:
            _log("calibration: reusing the amax values of the interrupted run")
            return Calibration.from_json(saved["calibration"])
    _log(f"calibration: {tokens.ids.shape[0]} x {tokens.ids.shape[1]} tokens from {tokens.source}, "
         "one layer at a time")
    calib = calibrate(src.cfg, src.read, tokens.ids, device=device, log=_log)
    atomic_write_text(path, json.dumps({"plan_hash": plan_hash, "calibration": calib.to_json()}))
    low = {i: sum(c < MIN_EXPERT_TOKENS for c in counts)
           for i, counts in calib.expert_tokens.items()}
    if any(low.values()):
        _log(f"WARNING: {sum(low.values())} experts in {sum(n > 0 for n in low.values())} MoE "
             f"layers received fewer than {MIN_EXPERT_TOKENS} calibration tokens (their input "
             "amax is the layer's max over experts, ModelOpt's rule); more --calib-samples or "
             "--calib-data raise it. Per expert: manifest.json calibration.tokens_per_expert")
    return calib


def _side_texts(src: InputCheckpoint, plan, opts, mapping) -> dict[str, str]:
    """config.json and hf_quant_config.json, known before any tensor is read."""
    config = dict(src.config_json)
    # The unquantized tensors are written in BF16 whatever the input's dtype (inputs.py), and
    # ModelOpt's export of the BF16-loaded model says so too.
    config["dtype"] = "bfloat16"
    if "torch_dtype" in config:  # the pre-5.0 name of the same field
        config["torch_dtype"] = "bfloat16"
    if opts.fmt == CT:  # the compressed-tensors library's own config block, no hf_quant_config
        from . import compressed_tensors

        ignore = [m for m, f in plan.formats.items() if f == "none"]
        return {"config.json": json.dumps(compressed_tensors.quantization_config(config, ignore),
                                          indent=2, sort_keys=True)}
    hfq = hf_quant_config(plan)
    if opts.fmt == "trtllm":
        config = trtllm_config(src.config_json, src.cfg, hfq, mapping)
    else:
        config["quantization_config"] = quantization_config(hfq)
    return {"config.json": json.dumps(config, indent=4),
            "hf_quant_config.json": json.dumps(hfq, indent=4)}


def _copied_side_files(src: InputCheckpoint) -> list[str]:
    return [n for n in SIDE_FILES[1:] if (src.dir / n).is_file()]


def _write_side_files(src: InputCheckpoint, out_dir: Path, texts: dict[str, str]) -> list[str]:
    for name, text in texts.items():
        atomic_write_text(out_dir / name, text)
    copied = _copied_side_files(src)
    for name in copied:
        atomic_copy(src.dir / name, out_dir / name)
    for name in ("tokenizer.json", "generation_config.json"):
        if name not in copied:
            _log(f"warning: {src.dir} has no {name}; the output cannot be served without it")
    return list(texts) + copied


def _planned_sizes(src, files, mapping) -> dict[str, int]:
    """Every output file's size (config.json and hf_quant_config.json, tens of KB, are left to
    the free-space check's slack)."""
    sizes = file_sizes(files) | {n: (src.dir / n).stat().st_size for n in _copied_side_files(src)}
    if mapping is None and len(files) > 1:
        sizes[INDEX_NAME] = index_text_size(files)
    return sizes


def _read_unit(src: InputCheckpoint, unit):
    tensors, h = {}, hashlib.sha256()
    for name in unit.inputs:
        t = src.read(name)
        h.update(name.encode())
        h.update(hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).digest())
        tensors[name] = t
    return tensors, h.hexdigest()


def _stream(src, plan, writer: Writer, calib, opts) -> None:
    from tqdm import tqdm

    todo = list(range(writer.next_unit, len(plan.units)))
    size = lambda u: sum(src.nbytes(n) for n in plan.units[u].inputs)  # noqa: E731
    total = sum(size(u) for u in range(len(plan.units)))
    throttle = float(os.environ.get("BEAM_TRT_CONVERT_THROTTLE_S", "0"))  # tests of resume
    threads = 1 if opts.workers > 1 else max(1, os.cpu_count() or 1)

    def work(u):
        tensors, digest = _read_unit(src, plan.units[u])
        out = quantize_unit(plan.units[u], tensors, calib, opts.device, threads)
        return u, dict(out), digest

    bar = tqdm(total=total, initial=total - sum(size(u) for u in todo), unit="B",
               unit_scale=True, desc=f"convert {opts.quant}", file=sys.stderr, mininterval=0.5,
               smoothing=0.1)
    since, last = 0, time.monotonic()
    try:
        for u, out, digest in ordered_map(work, todo, opts.workers):
            writer.write_unit(u, out, digest)
            bar.update(size(u))
            since += sum(t.numel() * t.element_size() for t in out.values())
            if throttle:
                time.sleep(throttle)
            if since >= COMMIT_BYTES or time.monotonic() - last >= COMMIT_SECONDS:
                writer.commit()
                since, last = 0, time.monotonic()
    finally:
        bar.close()
    writer.commit()


def _fixed_mmap_threshold() -> None:
    """glibc raises its mmap threshold to the size of the last freed large block (up to 32 MB),
    after which 26 MB expert buffers come from per-thread heaps that are not returned to the OS,
    so RSS creeps up with the number of tensors converted. A fixed threshold keeps every
    tensor-sized buffer in its own mapping, unmapped on free: RSS stays flat."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB (also disables the dynamic rule)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def _check_format(recipe, src: InputCheckpoint, opts: ConvertOptions) -> None:
    """compressed-tensors takes fp8_channel recipes only, and fp8_channel only goes there."""
    from .plan import linear_modules

    formats = {m: recipe.format_of(m) for m in linear_modules(src.cfg)}
    if opts.fmt == CT:
        from . import compressed_tensors

        compressed_tensors.check_formats(formats)
        if opts.kv_cache == "fp8":
            raise ConvertError("--kv-cache fp8 needs calibrated ModelOpt k/v scales; "
                               "--format compressed-tensors writes none")
    elif "fp8_channel" in formats.values():
        raise ConvertError(f"--quant {opts.quant}: fp8_channel (FP8_DYNAMIC) is written as a "
                           "compressed-tensors checkpoint; add --format compressed-tensors")


def convert(in_dir: str | Path, out_dir: str | Path, opts: ConvertOptions) -> Path:
    _fixed_mmap_threshold()
    if hasattr(signal, "SIGXFSZ"):  # a file-size limit must raise EFBIG, not kill the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise ConvertError("--device cuda: no CUDA device is available")
    src, out_dir = InputCheckpoint(in_dir), Path(out_dir)
    _check_dirs(src, out_dir)
    recipe = load_recipe(opts.quant)
    mapping = check_mapping(src.cfg, opts.tp, opts.ep) if opts.fmt == "trtllm" else None
    if opts.fmt != "trtllm" and (opts.tp, opts.ep) != (1, 1):
        raise ConvertError("--tp/--ep shard the `trtllm` layout; add --format trtllm")
    _check_format(recipe, src, opts)
    tokens, why = _calibration_tokens(src, opts)
    if tokens is None and opts.fmt == CT:
        _log(f"{why}: no calibration")
    elif tokens is None:
        _log(f"WARNING: {why}: writing WEIGHT-ONLY scales (no input_scale; NVFP4 becomes "
             "W4A16_NVFP4; no k/v scales, so FP8 KV runs with scale 1.0)")
    plan = make_plan(src.cfg, recipe, tokens is not None, opts.kv_cache == "fp8")
    outs = [u.outputs for u in plan.units]
    files = (trtllm_layout(outs, src.cfg, mapping) if mapping
             else hf_layout(outs, int(opts.shard_size_mb * 1_000_000)))
    plan_hash = _plan_hash(src, opts, plan, files, tokens)
    resuming = prepare_out_dir(out_dir, plan_hash, _planned_sizes(src, files, mapping),
                               opts.overwrite)
    calib = _run_calibration(src, tokens, out_dir, plan_hash, opts.device) if tokens else None
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, opts.workers)))
    writer = Writer(out_dir, files, plan_hash, fresh=not resuming)
    try:
        if writer.next_unit:
            _log(f"resuming at unit {writer.next_unit}/{len(plan.units)}")
        _stream(src, plan, writer, calib, opts)
    finally:
        writer.close()
    side = _write_side_files(src, out_dir, _side_texts(src, plan, opts, mapping))
    if mapping is None:
        write_index(out_dir, files)
    write_manifest(out_dir, src, plan, opts, files, writer, side, tokens, calib, why, mapping)
    src.close()
    return out_dir
