"""manifest.json: written last, it marks a finished conversion. Per output file: size, sha256
and each tensor's dtype and shape; per side file (config, tokenizer...): size and sha256; the
recipe, options, calibration summary, input fingerprint and tool versions."""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path

from .outdir import CALIB_STATE, MANIFEST, STATE, atomic_write_text
from .st_io import NAMES, sha256_file
TOOLS = ("beam-trt", "torch", "safetensors", "numba", "nvidia-modelopt")


def tool_versions() -> dict:
    out = {"python": platform.python_version()}
    for name in TOOLS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _calibration(tokens, calib, why, fmt: str = "hf") -> dict:
    if calib is None:  # compressed-tensors FP8_DYNAMIC: activations scaled per token at run time
        return {"mode": "dynamic" if fmt == "compressed-tensors" else "weight-only",
                "reason": why}
    counts = calib.expert_tokens
    return {"mode": "max", "source": tokens.source, "data_sha256": tokens.sha256,
            "documents": tokens.documents,
            "samples": int(tokens.ids.shape[0]), "seq_len": int(tokens.ids.shape[1]),
            "data_tokens": tokens.unique_tokens,
            "experts_routed_per_layer": {str(k): v for k, v in calib.coverage.items()},
            "min_tokens_per_expert": min((min(c) for c in counts.values()), default=None),
            "tokens_per_expert": {str(k): c for k, c in counts.items()},
            "unrouted_experts": "input amax = max over the layer's experts (ModelOpt's rule)"}


def write_manifest(out_dir: Path, src, plan, opts, files, writer, side, tokens, calib, why,
                   mapping) -> None:
    weights = {}
    for f in files:
        weights[f.name] = {
            "size": (out_dir / f.name).stat().st_size, "sha256": writer.done[f.name],
            "tensors": {n: {"dtype": NAMES[d], "shape": list(s)} for n, _, d, s in f.specs}}
    extra = [n for n in ("model.safetensors.index.json",) if (out_dir / n).is_file()]
    manifest = {
        "producer": "beam-trt convert", "tools": tool_versions(),
        "format": opts.fmt, "recipe": plan.recipe.to_json(), "kv_cache": opts.kv_cache,
        "mapping": mapping.to_json() if mapping else None, "device": opts.device,
        "input": {"dir": str(src.dir.resolve()), "files": src.fingerprint(),
                  "tensors_sha256": writer.chain},
        "calibration": _calibration(tokens, calib, why, opts.fmt),
        "files": weights,
        "side_files": {n: {"size": (out_dir / n).stat().st_size, "sha256": sha256_file(out_dir / n)}
                       for n in side + extra},
    }
    for leftover in (STATE, CALIB_STATE):
        if (out_dir / leftover).exists():
            os.remove(out_dir / leftover)
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2))
