"""Reading an engine dir: everything is checked before a weight is used, and a corrupt or
mismatched dir is refused with the reason (file, field or tensor named)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config import BeamConfig, ConfigError
from .build_parts import ENGINE_FORMAT, ENGINE_FORMAT_VERSION, sha256_file
from .plan import BuildOptions, KVPlan
from .tuned_kernels import TUNED_FILE, read_table
from .types import EngineError

TARGET_CAPABILITY = {"sm90": (9, 0), "sm100": (10, 0)}


@dataclass(frozen=True)
class EngineSpec:
    path: Path
    raw: dict
    cfg: BeamConfig
    options: BuildOptions
    kv: KVPlan
    layer_plan: dict
    tuned: dict | None = None  # tuned_kernels.json, validated (tuned_kernels.py)
    parallel: object = None    # a rank dir of a parallel engine: its ParallelMapping

    @property
    def target(self) -> str:
        return self.options.target

    @property
    def weight_files(self) -> list[str]:
        return sorted(n for n in self.raw["files"] if n.startswith("weights-"))


def read_engine_dir(path: str | Path, verify: bool = True) -> EngineSpec:
    """Parse and validate engine.json, config.json and the file list (sizes always, SHA-256
    too when `verify`)."""
    path = Path(path)
    where = f"engine dir {path}"
    spec_file = path / "engine.json"
    if (path / "parallel.json").is_file() and not spec_file.is_file():
        raise EngineError(f"{where} is a parallel engine (parallel.json): its ranks run in one "
                          "process each; use `beam-trt generate` on it or "
                          "beam_trtllm.engine.parallel.launch, which load rank{r}/ per rank")
    if not spec_file.is_file():
        raise EngineError(f"{where}: no engine.json (not an engine dir, or its build did not finish)")
    try:
        raw = json.loads(spec_file.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{spec_file}: not valid JSON ({exc})") from exc
    if raw.get("format") != ENGINE_FORMAT:
        raise EngineError(f"{spec_file}: format is {raw.get('format')!r}, expected {ENGINE_FORMAT!r}")
    version = raw.get("format_version")
    if version != ENGINE_FORMAT_VERSION:
        raise EngineError(f"{spec_file}: format_version {version!r}, this beam-trt reads version "
                          f"{ENGINE_FORMAT_VERSION}; rebuild the engine with `beam-trt build`")
    try:
        cfg = BeamConfig.from_hf(raw["config"])
        disk_cfg = json.loads((path / "config.json").read_text())
        options = BuildOptions(**{**raw["options"], "cuda_graph_batch_sizes":
                                  tuple(raw["options"]["cuda_graph_batch_sizes"])})
        kv = KVPlan.from_json(raw["kv_plan"])
        layer_plan, files = raw["quantization"]["layers"], raw["files"]
    except (KeyError, TypeError) as exc:
        raise EngineError(f"{spec_file}: missing or malformed field {exc}") from exc
    except (ConfigError, FileNotFoundError, json.JSONDecodeError) as exc:
        raise EngineError(f"{where}: {exc}") from exc
    if disk_cfg != raw["config"]:
        diff = sorted(k for k in set(disk_cfg) | set(raw["config"])
                      if disk_cfg.get(k) != raw["config"].get(k))
        raise EngineError(f"{where}: config.json differs from the config the engine was built "
                          f"with (field {diff[0]}{' and more' if len(diff) > 1 else ''}); rebuild")
    _check_files(path, files, verify)
    tuned = None
    if TUNED_FILE in files:  # a corrupt or malformed table refuses the dir, on any device
        tuned = read_table(path / TUNED_FILE)
    parallel = None
    if raw.get("parallel") is not None:
        from .parallel.mapping import ParallelMapping

        parallel = ParallelMapping.from_json(raw["parallel"], f"{spec_file}: parallel")
        parallel.check(cfg)
    return EngineSpec(path, raw, cfg, options, kv, layer_plan, tuned, parallel)


def _check_files(path: Path, files: dict, verify: bool) -> None:
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            raise EngineError(f"engine dir {path}: {name} is missing")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise EngineError(f"engine dir {path}: {name} has {size} bytes, engine.json says "
                              f"{meta['bytes']} (truncated or replaced)")
        if verify and sha256_file(f) != meta["sha256"]:
            raise EngineError(f"engine dir {path}: {name} does not match its SHA-256 in "
                              "engine.json (corrupted or modified)")


def check_device(spec: EngineSpec, device: torch.device) -> None:
    """Refuse to run an engine on a device other than the one it was built for."""
    target = spec.target
    if device.type == "cpu":
        if target != "cpu":
            raise EngineError(f"engine dir {spec.path}: built for --target {target}, but loading "
                              "on the CPU; rebuild with --target cpu")
        return
    if device.type != "cuda":
        raise EngineError(f"engine dir {spec.path}: device {device} is not supported (cpu or cuda)")
    if target == "cpu":
        raise EngineError(f"engine dir {spec.path}: built for --target cpu, but loading on "
                          f"{torch.cuda.get_device_name(device)}; rebuild with --target sm90 or sm100")
    cap = torch.cuda.get_device_capability(device)
    if cap[0] != TARGET_CAPABILITY[target][0]:
        raise EngineError(f"engine dir {spec.path}: built for --target {target}, but "
                          f"{torch.cuda.get_device_name(device)} is sm{cap[0]}{cap[1]}")


def load_weights(spec: EngineSpec, device: torch.device) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in spec.weight_files:
        f = spec.path / name
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as handle:
                for key in handle.keys():
                    if key in out:
                        raise EngineError(f"engine dir {spec.path}: tensor {key} appears twice")
                    out[key] = handle.get_tensor(key)
        except SafetensorError as exc:
            raise EngineError(f"engine dir {spec.path}: {name} is not a readable safetensors "
                              f"file ({exc})") from exc
    return out
