"""The pieces of `beam-trt build` (build.py) that a single engine dir and the per-rank dirs of
a parallel build (parallel/build.py) share: the checkpoint reader, the input checks, the
engine dir's writer and its hashes."""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from ..checkpoint import (CheckpointError, SafetensorsCheckpoint, atomic_save, expected_tensors,
                          is_v1_checkpoint, v1_error)
from ..config import BeamConfig
from ..quant_schemes import Scheme, SchemeError, read_scheme
from .plan import ACT_DTYPES, BuildOptions, kv_plan
from .tuned_kernels import build_autotune
from .types import EngineError
from .weights import iter_engine_tensors

ENGINE_FORMAT = "beam-trt-engine"
ENGINE_FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
EXTRA_FILES = ("special_tokens_map.json", "chat_template.jinja")


class CheckpointReader:
    """Lazy tensor access to a checkpoint (fused experts seen per expert) that remembers which
    tensors were used, so a build can refuse tensors it does not understand (a mismatched or
    foreign checkpoint)."""

    def __init__(self, ckpt_dir: Path):
        self.dir = ckpt_dir
        try:
            self.ckpt = SafetensorsCheckpoint(ckpt_dir)
        except CheckpointError as exc:
            raise EngineError(str(exc)) from exc
        self.used: set[str] = set()

    def dtype(self, name: str) -> torch.dtype | None:
        return self.ckpt.dtype(name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.ckpt.infos:
            raise EngineError(f"{self.dir}: checkpoint has no tensor {name}")
        self.used.add(name)
        try:
            return self.ckpt.get(name)
        except CheckpointError as exc:
            raise EngineError(str(exc)) from exc

    def unused(self) -> list[str]:
        return sorted(set(self.ckpt.infos) - self.used)

    def check(self, cfg: BeamConfig) -> None:
        """Refuse a v1 checkpoint, and name a tensor whose shape the config contradicts (FP8
        weights as their float twins, NVFP4 weights with two codes a byte)."""
        v1 = is_v1_checkpoint(self.ckpt.infos)
        if v1:
            raise EngineError(v1_error(str(self.dir), v1))
        for name, (shape, _) in expected_tensors(cfg).items():
            if name not in self.ckpt.infos:
                continue
            got, dtype = self.ckpt.infos[name]
            want = (*shape[:-1], shape[-1] // 2) if dtype == torch.uint8 else shape
            if tuple(got) != tuple(want):
                raise EngineError(f"{self.dir}: tensor {name} has shape {list(got)}, config.json "
                                  f"implies {list(want)}")


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def checkpoint_hash(ckpt_dir: Path) -> str:
    """SHA-256 over the names and contents of every file of the checkpoint dir."""
    h = hashlib.sha256()
    for path in sorted(p for p in ckpt_dir.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + sha256_file(path).encode())
    return h.hexdigest()


def tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("beam-trt", "triton", "safetensors", "tokenizers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def _kv_dtype(reader: CheckpointReader, cfg: BeamConfig, opts: BuildOptions) -> str:
    layers = range(cfg.num_hidden_layers)
    have = [reader.dtype(f"model.layers.{i}.self_attn.k_proj.k_scale") is not None for i in layers]
    if opts.kv_dtype == "fp8" and not all(have):
        missing = have.index(False)
        raise EngineError(f"--kv-dtype fp8 needs calibrated KV scales, but the checkpoint has no "
                          f"model.layers.{missing}.self_attn.k_proj.k_scale; convert with FP8 KV "
                          "or build with --kv-dtype bf16")
    kv = opts.kv_dtype or ("fp8" if all(have) else ACT_DTYPES[opts.dtype])
    if kv != "fp8":  # the scales are not used: mark them so they are not "unexpected"
        reader.used.update(f"model.layers.{i}.self_attn.{n}_proj.{n}_scale" for i in layers
                           for n in ("k", "v") if reader.dtype(f"model.layers.{i}.self_attn.{n}_proj.{n}_scale"))
    return kv


def kernel_choices(plan: dict, kv_dtype: str) -> dict:
    """Which beam:: op runs each part (the launch shapes: `tuned_kernels.build_autotune`)."""
    experts = sorted({layer.get("experts") for layer in plan.values() if layer.get("experts")})
    linear = sorted({seg["format"] for layer in plan.values() for name, segs in layer.items()
                     if name != "experts" for seg in segs})
    return {"norms": "beam::rmsnorm, beam::add_rmsnorm (their _fp8 forms before FP8 W8A8 GEMMs)",
            "attention": "beam::qk_prep, beam::attention, beam::cache_write",
            "router": "beam::group_router",
            "moe": [f"beam::moe_{fmt}" for fmt in experts],
            "linear": [("torch.matmul" if f == "bf16" else f"beam::linear_{f}") for f in linear],
            "kv_cache": kv_dtype}


def check_out_dir(engine_dir: Path, overwrite: bool) -> None:
    if engine_dir.exists() and any(engine_dir.iterdir()) and not overwrite:
        raise EngineError(f"{engine_dir} exists and is not empty; remove it or pass --overwrite")


def read_inputs(ckpt_dir: Path) -> tuple[BeamConfig, Scheme]:
    """The checkpoint's config and declared quantization (its tokenizer must be there)."""
    cfg = BeamConfig.from_hf(ckpt_dir)
    for name in TOKENIZER_FILES:
        if not (ckpt_dir / name).is_file():
            raise EngineError(f"{ckpt_dir / name} is missing: an engine dir must carry the "
                              "tokenizer (Dynamo's frontend and `beam-trt generate` read it)")
    try:
        return cfg, read_scheme(ckpt_dir)
    except SchemeError as exc:
        raise EngineError(str(exc)) from exc


def write_engine_dir(ckpt_dir: Path, reader, cfg: BeamConfig, scheme: Scheme, tmp: Path,
                     opts: BuildOptions, progress, parallel=None, ckpt_sha: str | None = None,
                     not_here: Callable[[str], bool] = lambda name: False,
                     draft_dir: Path | None = None) -> None:
    """Weights, side files and engine.json into `tmp`. `parallel`: the rank's mapping (its
    reader returns the rank's pieces; `not_here` names the tensors other ranks hold);
    `draft_dir`: a DFlash2 drafter checkpoint, checked against the target and copied to
    `draft/` (speculative.py)."""
    kv_cfg = cfg if parallel is None else parallel.local_config(cfg)
    kv_dtype = _kv_dtype(reader, cfg, opts)
    kv = kv_plan(kv_cfg, opts, kv_dtype)
    experts = None if parallel is None else parallel.experts(cfg)
    layer_plan, files = _write_weights(reader, cfg, tmp, kv_dtype, progress,
                                       getattr(torch, opts.dtype), scheme, experts)
    unused = [n for n in reader.unused() if not not_here(n)]
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise EngineError(f"{ckpt_dir}: unexpected tensor {unused[0]}{more}: not part of a "
                          "Beam checkpoint of this config")
    files.update(_copy_side_files(ckpt_dir, tmp, cfg))
    draft = None
    if draft_dir is not None:
        from .draft_build import copy_draft, resolve_draft_quant

        files.update(copy_draft(draft_dir, cfg, tmp, progress, opts.draft_quant, layer_plan))
        # options keep what was asked (auto); this is what auto chose
        draft = {"quant": resolve_draft_quant(opts.draft_quant, layer_plan)}
    tune, written = build_autotune(kv_cfg, layer_plan, opts, kv_dtype, tmp, progress)
    files.update({name: {"bytes": (tmp / name).stat().st_size,
                         "sha256": sha256_file(tmp / name)} for name in written})
    kernels = {"ops": kernel_choices(layer_plan, kv_dtype), "autotune": tune}
    if opts.target != "cpu":
        progress(f"kernels: {tune['status']}")
    if ckpt_sha is None:
        progress("hashing the input checkpoint")
    spec = {
        "format": ENGINE_FORMAT, "format_version": ENGINE_FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": json.loads((tmp / "config.json").read_text()),
        "target": opts.target, "options": opts.to_json(),
        "quantization": {"scheme": scheme.describe(), "kv_cache": kv_dtype,
                         "layers": layer_plan},
        "kernels": kernels,
        "kv_plan": kv.to_json(),
        "checkpoint": {"path": str(ckpt_dir.resolve()),
                       "sha256": ckpt_sha or checkpoint_hash(ckpt_dir)},
        "tools": tool_versions(),
        "files": files,
    }
    if draft is not None:
        spec["draft"] = draft
    if parallel is not None:
        spec["parallel"] = parallel.to_json()
    (tmp / "engine.json").write_text(json.dumps(spec, indent=2))


def _write_weights(reader, cfg, out: Path, kv_dtype: str, progress, dtype: torch.dtype,
                   scheme: Scheme, experts: range | None = None):
    plan, files = {}, {}
    groups = cfg.num_hidden_layers + 2
    for k, (group, tensors, layer_plan) in enumerate(
            iter_engine_tensors(reader.get, reader.dtype, cfg, dtype, scheme, experts),
            start=1):
        if kv_dtype != "fp8":
            tensors = {n: t for n, t in tensors.items() if not n.endswith(("k_scale", "v_scale"))}
        name = f"weights-{k:05d}-of-{groups:05d}.safetensors"
        atomic_save(out / name, tensors, metadata={"format": "pt", "group": group})
        files[name] = {"bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)}
        if layer_plan:
            plan[group] = layer_plan
        progress(f"[{k}/{groups}] {group}: {len(tensors)} tensors, "
                 f"{sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20:.1f} MiB")
    return plan, files


def _copy_side_files(ckpt_dir: Path, out: Path, cfg: BeamConfig) -> dict:
    names = ["config.json", *TOKENIZER_FILES, *EXTRA_FILES, "generation_config.json"]
    for name in names:
        if (ckpt_dir / name).is_file():
            shutil.copyfile(ckpt_dir / name, out / name)
    if not (out / "generation_config.json").is_file():
        gen = {k: v for k, v in cfg.to_hf().items() if k.endswith("token_id")}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return {name: {"bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)}
            for name in names if (out / name).is_file()}
