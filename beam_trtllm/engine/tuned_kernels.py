"""Tuned kernel tables of an engine dir (docs/ENGINE.md "Kernel autotuning").

Build (`beam-trt build --target sm90|sm100`): on a machine whose GPU is the target, the search
of autotune.py runs and its table is written as `tuned_kernels.json` (listed and hashed in
engine.json like every file; `kernels.autotune` records the device and tool versions). Without
such a GPU the build records "left to first load".

Load (`Engine.from_dir` on CUDA): a `tuned_kernels.json` tuned on this GPU (same name and
compute capability) is installed into `plugins.tuning`. One tuned on another GPU is refused
with a progress line saying so, and the engine is re-tuned for this GPU as if the build had
left it to the first load: that search runs (bounded, autotune.BUDGET_S) and its table is
cached as `tuned_kernels.local.json` inside the engine dir when the dir is writable (keyed by
the GPU and the engine.json hash; not listed in engine.json), else kept in memory. The mode
(auto | quick | off) comes from `from_dir(autotune=...)`, else $BEAM_TRT_AUTOTUNE, else the
build's --autotune; "off" installs a matching build table but never searches. On the CPU
nothing is installed (the ops run their references).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch

from .autotune import BUDGET_S, MODES, engine_problems, search
from .types import EngineError

TUNED_FILE = "tuned_kernels.json"
LOCAL_FILE = "tuned_kernels.local.json"
TABLE_FORMAT = "beam-trt-tuned-kernels"
TABLE_VERSION = 1
ENV = "BEAM_TRT_AUTOTUNE"
TARGET_MAJOR = {"sm90": 9, "sm100": 10}


def device_identity(device: torch.device | str) -> dict:
    device = torch.device(device)
    if device.type != "cuda":
        return {"name": "Triton interpreter", "capability": "cpu"}
    major, minor = torch.cuda.get_device_capability(device)
    return {"name": torch.cuda.get_device_name(device), "capability": f"sm{major}{minor}"}


def tool_versions() -> dict:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__}


def _same_device(a: dict, b: dict) -> bool:
    return a.get("name") == b.get("name") and a.get("capability") == b.get("capability")


def _describe(identity: dict) -> str:
    return f"{identity.get('name')} ({identity.get('capability')})"


def check_mode(mode: str, where: str) -> str:
    if mode not in MODES:
        raise EngineError(f"{where}: autotune mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


# ---------------------------------------------------------------------------- table documents
def tune_document(cfg, layer_plan: dict, options, kv_dtype: str, device, mode: str,
                  progress: Callable[[str], None]) -> dict:
    """Run the search for this engine on `device` -> the table document."""
    from plugins.tuning import to_json

    problems = engine_problems(cfg, layer_plan, options, kv_dtype, device)
    identity = device_identity(device)
    progress(f"kernels: searching launch shapes of {len(problems)} problems on "
             f"{_describe(identity)} ({mode}, at most {BUDGET_S[mode]:.0f} s)")
    result = search(problems, mode, device, progress=progress)
    improved = len(result["entries"])
    progress(f"kernels: {improved} of {len(problems)} problems run faster than the defaults "
             f"({result['search_s']:.0f} s)")
    return {"format": TABLE_FORMAT, "version": TABLE_VERSION, "device": identity,
            "versions": tool_versions(), "mode": mode, "search_s": result["search_s"],
            "problems": len(problems), **to_json(result["entries"]), "report": result["report"]}


def read_table(path: Path) -> dict:
    """Parse and validate a table document; EngineError names the file and the field."""
    from plugins.tuning import TuningError, from_json

    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineError(f"{path}: not a readable JSON table ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != TABLE_FORMAT:
        raise EngineError(f"{path}: format is {doc.get('format') if isinstance(doc, dict) else doc!r}, "
                          f"expected {TABLE_FORMAT!r}")
    if doc.get("version") != TABLE_VERSION:
        raise EngineError(f"{path}: version {doc.get('version')!r}, this beam-trt reads {TABLE_VERSION}")
    device = doc.get("device")
    if not isinstance(device, dict) or not {"name", "capability"} <= set(device):
        raise EngineError(f"{path}: field 'device' must hold the GPU's name and capability")
    try:
        from_json(doc)
    except TuningError as exc:
        raise EngineError(f"{path}: {exc}") from exc
    return doc


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- build
def gpu_for_target(target: str) -> str | None:
    """None if this machine's GPU is a `target` GPU, else why not."""
    if not torch.cuda.is_available():
        return "no GPU on the build machine"
    major, minor = torch.cuda.get_device_capability()
    if major != TARGET_MAJOR[target]:
        return f"the build machine's {torch.cuda.get_device_name()} (sm{major}{minor}) is not a {target} GPU"
    return None


def build_autotune(cfg, layer_plan: dict, options, kv_dtype: str, out_dir: Path,
                   progress: Callable[[str], None]) -> tuple[dict, list[str]]:
    """-> (engine.json `kernels.autotune`, names of the files written into out_dir)."""
    mode = check_mode(options.autotune, "--autotune")
    if options.target == "cpu":
        return {"status": "not applicable: the CPU runs the ops' plain-torch references"}, []
    if mode == "off":
        return {"status": "off (--autotune off): the launchers' default shapes", "mode": mode}, []
    why = gpu_for_target(options.target)
    if why is not None:
        return {"status": f"left to first load: {why}; the launch shapes are searched when the "
                          "engine first loads on its GPU (cached in the engine dir)",
                "mode": mode}, []
    doc = tune_document(cfg, layer_plan, options, kv_dtype, torch.device("cuda"), mode, progress)
    _write_json(out_dir / TUNED_FILE, doc)
    return {"status": f"tuned at build on {_describe(doc['device'])}: {len(doc['entries'])} of "
                      f"{doc['problems']} problems with a faster launch shape",
            "device": doc["device"], "versions": doc["versions"], "mode": mode,
            "file": TUNED_FILE, "search_s": doc["search_s"]}, [TUNED_FILE]


# ---------------------------------------------------------------------------- load
def load_autotune(spec, device: torch.device, mode: str | None,
                  progress: Callable[[str], None]) -> str:
    """Install this engine's tuned table for `device` (CUDA), tuning first if needed; returns
    what was done (also reported through `progress`)."""
    from plugins import tuning

    mode = check_mode(mode or os.environ.get(ENV) or spec.options.autotune,
                      f"engine dir {spec.path}")
    here = device_identity(device)
    if spec.tuned is not None:
        if _same_device(spec.tuned["device"], here):
            n = tuning.install(spec.tuned)
            return _say(progress, f"kernels: {n} tuned launch shapes installed from {TUNED_FILE}")
        progress(f"kernels: {TUNED_FILE} was tuned on {_describe(spec.tuned['device'])}, this is "
                 f"{_describe(here)}: refused, its shapes are not installed")
    if mode == "off":
        return _say(progress, "kernels: launcher defaults (autotune off)")
    engine_id = hashlib.sha256((spec.path / "engine.json").read_bytes()).hexdigest()
    cache = spec.path / LOCAL_FILE
    if cache.is_file():
        try:
            doc = read_table(cache)
            if _same_device(doc["device"], here) and doc.get("engine") == engine_id:
                n = tuning.install(doc)
                return _say(progress, f"kernels: {n} tuned launch shapes installed from {cache}")
            progress(f"kernels: {cache} belongs to another GPU or build: tuning again")
        except EngineError as exc:
            progress(f"kernels: ignoring the cached table ({exc}): tuning again")
    progress(f"kernels: tuning for {_describe(here)} now (left to first load)")
    doc = tune_document(spec.cfg, spec.layer_plan, spec.options, spec.kv.kv_dtype, device, mode,
                        progress)
    doc["engine"] = engine_id
    n = tuning.install(doc)
    try:
        _write_json(cache, doc)
        where = f"cached in {cache}"
    except OSError as exc:
        where = f"kept in memory ({cache} is not writable: {exc.strerror})"
    return _say(progress, f"kernels: {n} tuned launch shapes installed, {where}")


def _say(progress: Callable[[str], None], line: str) -> str:
    progress(line)
    return line
