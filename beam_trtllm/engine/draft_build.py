"""`beam-trt build --draft DIR`: a DFlash2 drafter checked against the target and copied into
the engine dir's `draft/` (speculative.py loads it from there)."""

from __future__ import annotations

from pathlib import Path

from .types import EngineError

DRAFT_DIR = "draft"  # an engine dir's drafter


def draft_options(draft_dir: Path, cfg, opts):
    """Build options with a drafter: it fits the target, and --draft-tokens (default: its
    block size - 1) is at most what it drafts."""
    from dataclasses import replace

    from ..draft import DraftConfig, DraftError

    try:
        dcfg = DraftConfig.from_dir(draft_dir)
        dcfg.check_target(cfg)
    except DraftError as exc:
        raise EngineError(f"--draft {draft_dir}: {exc}") from exc
    n = opts.draft_tokens or dcfg.num_draft_tokens
    if n > dcfg.num_draft_tokens:
        raise EngineError(f"--draft-tokens {n}: the drafter at {draft_dir} drafts "
                          f"{dcfg.num_draft_tokens} per step (block_size {dcfg.block_size})")
    return replace(opts, draft_tokens=n)


def copy_draft(draft_dir: Path, cfg, out: Path, progress) -> dict:
    """The drafter's config and weights into `out/draft/` (checked: names, shapes, the fit to
    the target); -> their engine.json file entries."""
    import shutil

    from ..draft import DraftConfig, DraftError
    from ..draft.weights import INDEX_FILE, check_tensors, sha256_file, stored_tensors

    try:
        dcfg = DraftConfig.from_dir(draft_dir)
        dcfg.check_target(cfg)
        infos = stored_tensors(draft_dir)
        check_tensors(dcfg, {n: i[2] for n, i in infos.items()}, str(draft_dir))
        names = ["config.json"] + sorted({i[0].name for i in infos.values()})
        if (draft_dir / INDEX_FILE).is_file():
            names.append(INDEX_FILE)
    except DraftError as exc:
        raise EngineError(f"--draft {draft_dir}: {exc}") from exc
    (out / DRAFT_DIR).mkdir()
    files = {}
    for name in names:
        shutil.copyfile(draft_dir / name, out / DRAFT_DIR / name)
        rel = f"{DRAFT_DIR}/{name}"
        files[rel] = {"bytes": (out / rel).stat().st_size, "sha256": sha256_file(out / rel)}
    progress(f"drafter: {draft_dir} -> {DRAFT_DIR}/ ({len(names)} files)")
    return files
