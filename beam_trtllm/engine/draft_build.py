"""`beam-trt build --draft DIR [--draft-quant auto|bf16|fp8]`: a DFlash2 drafter checked
against the target and written into the engine dir's `draft/` (speculative.py loads it from
there): copied as it is, or quantized to FP8 per channel (beam_trtllm/draft/quant.py)."""

from __future__ import annotations

from pathlib import Path

from .types import EngineError

DRAFT_DIR = "draft"  # an engine dir's drafter


def draft_options(draft_dir: Path, cfg, opts):
    """Build options with a drafter: it fits the target, --draft-tokens (default: its block
    size - 1) is at most what it drafts, and --draft-quant bf16 is not asked of a drafter
    stored in FP8."""
    from dataclasses import replace

    from ..draft import DraftConfig, DraftError
    from ..draft.quant import QUANT_FILE, read_quant

    try:
        dcfg = DraftConfig.from_dir(draft_dir)
        dcfg.check_target(cfg)
        stored_fp8 = read_quant(draft_dir, dcfg)
    except DraftError as exc:
        raise EngineError(f"--draft {draft_dir}: {exc}") from exc
    n = opts.draft_tokens or dcfg.num_draft_tokens
    if n > dcfg.num_draft_tokens:
        raise EngineError(f"--draft-tokens {n}: the drafter at {draft_dir} drafts "
                          f"{dcfg.num_draft_tokens} per step (block_size {dcfg.block_size})")
    if stored_fp8 and opts.draft_quant == "bf16":
        raise EngineError(f"--draft-quant bf16: the drafter at {draft_dir} is stored in FP8 "
                          f"({QUANT_FILE}); build from its BF16 checkpoint")
    return replace(opts, draft_tokens=n)


def target_is_quantized(layer_plan: dict) -> bool:
    """Whether the build's layer plan (build_parts: per layer, each packed Linear's segments
    and the experts' format) runs any of the target's Linears or experts in FP8 / NVFP4."""
    for layer in layer_plan.values():
        for name, entry in layer.items():
            formats = [entry] if name == "experts" else [seg["format"] for seg in entry]
            if any(fmt != "bf16" for fmt in formats):
                return True
    return False


def resolve_draft_quant(choice: str, layer_plan: dict) -> str:
    """--draft-quant: auto = fp8 when the target's own weights are quantized, else bf16."""
    if choice == "auto":
        return "fp8" if target_is_quantized(layer_plan) else "bf16"
    return choice


def copy_draft(draft_dir: Path, cfg, out: Path, progress, draft_quant: str,
               layer_plan: dict) -> dict:
    """The drafter's config and weights into `out/draft/` (checked: names, shapes, dtypes, the
    fit to the target), quantized when `draft_quant` (BuildOptions) resolves to fp8 and the
    drafter is not FP8 already; -> their engine.json file entries."""
    from ..draft import DraftConfig, DraftError
    from ..draft.quant import fp8_modules, read_quant
    from ..draft.weights import sha256_file

    quant = resolve_draft_quant(draft_quant, layer_plan)
    try:
        dcfg = DraftConfig.from_dir(draft_dir)
        dcfg.check_target(cfg)
        stored_fp8 = read_quant(draft_dir, dcfg)
        if quant == "fp8" and not stored_fp8:
            names = _write_quantized(draft_dir, dcfg, out / DRAFT_DIR)
            how = f"{len(fp8_modules(dcfg))} Linears quantized to FP8 per channel"
        else:
            names = _copy_checked(draft_dir, dcfg, out / DRAFT_DIR)
            how = f"{len(names)} files" + (", stored in FP8" if stored_fp8 else "")
    except DraftError as exc:
        raise EngineError(f"--draft {draft_dir}: {exc}") from exc
    why = f" (--draft-quant auto: {quant})" if draft_quant == "auto" else ""
    progress(f"drafter: {draft_dir} -> {DRAFT_DIR}/, {how}{why}")
    files = {}
    for name in names:
        rel = f"{DRAFT_DIR}/{name}"
        files[rel] = {"bytes": (out / rel).stat().st_size, "sha256": sha256_file(out / rel)}
    return files


def _copy_checked(draft_dir: Path, dcfg, dest: Path) -> list[str]:
    """Copy the drafter's files unchanged once their tensors check out; -> the names."""
    import shutil

    from ..draft.quant import QUANT_FILE, read_quant
    from ..draft.weights import INDEX_FILE, check_tensors, load_draft_weights, stored_tensors

    infos = stored_tensors(draft_dir)
    if read_quant(draft_dir, dcfg):
        load_draft_weights(draft_dir, dcfg)  # an FP8 drafter: its dtypes and scales too
    else:
        check_tensors(dcfg, {n: i[2] for n, i in infos.items()}, str(draft_dir),
                      files={n: str(i[0]) for n, i in infos.items()})
    names = ["config.json"] + sorted({i[0].name for i in infos.values()})
    for extra in (INDEX_FILE, QUANT_FILE):
        if (draft_dir / extra).is_file():
            names.append(extra)
    dest.mkdir()
    for name in names:
        shutil.copyfile(draft_dir / name, dest / name)
    return names


def _write_quantized(draft_dir: Path, dcfg, dest: Path) -> list[str]:
    """config.json unchanged, the FP8 weights (model.safetensors) and quant.json; -> names."""
    import json
    import shutil

    from safetensors.torch import save_file

    from ..draft.quant import QUANT_FILE, quant_record, quantize_draft
    from ..draft.weights import WEIGHTS_FILE, load_draft_weights

    state = quantize_draft(dcfg, load_draft_weights(draft_dir, dcfg))
    dest.mkdir()
    shutil.copyfile(draft_dir / "config.json", dest / "config.json")
    save_file(state, str(dest / WEIGHTS_FILE), metadata={"format": "pt"})
    (dest / QUANT_FILE).write_text(json.dumps(quant_record(dcfg), indent=2) + "\n")
    return ["config.json", WEIGHTS_FILE, QUANT_FILE]
