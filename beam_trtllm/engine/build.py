"""`beam-trt build`: a converted checkpoint -> an engine dir (docs/DESIGN.md §4).

The engine dir is everything a server needs: `engine.json` (config, target, options, kernel
choices, KV memory plan, input checkpoint hash, tool versions, every file's size and SHA-256),
the repacked weights (`weights-NNNNN.safetensors`, one file per group: embedding, each layer,
head), `config.json`, `generation_config.json`, the tokenizer files and, for a GPU target
built on that GPU, `tuned_kernels.json` (the launch shapes searched on it, tuned_kernels.py). It is written into a
temporary sibling directory and renamed into place at the end, so an interrupted build never
leaves a directory that looks complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from .build_parts import (CheckpointReader, _kv_dtype, check_out_dir, read_inputs,
                          sha256_file, write_engine_dir)  # noqa: F401  (sha256_file: the API)
from .parallel.build import build_parallel
from .plan import BuildOptions, kv_plan
from .types import EngineError


def build_engine(ckpt_dir: str | Path, engine_dir: str | Path, opts: BuildOptions,
                 progress: Callable[[str], None] = lambda msg: None, overwrite: bool = False,
                 parallel=None, draft: str | Path | None = None) -> Path:
    """`parallel` (a ParallelMapping): write one engine dir per rank instead
    (parallel/build.py). `draft`: a DFlash2 drafter dir to put into the engine dir (its
    `--draft-tokens`, opts.draft_tokens, default to the drafter's block size - 1)."""
    if parallel is not None and draft is not None:
        raise EngineError("--draft: speculative decoding runs on single-GPU engines (no --tp/--ep)")
    if draft is None and (opts.draft_tokens or opts.draft_quant != "auto"):
        raise EngineError("--draft-tokens / --draft-quant need --draft DIR (a drafter to build)")
    if parallel is not None:
        return build_parallel(ckpt_dir, engine_dir, opts, parallel, progress, overwrite)
    ckpt_dir, engine_dir = Path(ckpt_dir), Path(engine_dir)
    check_out_dir(engine_dir, overwrite)
    cfg, scheme = read_inputs(ckpt_dir)
    reader = CheckpointReader(ckpt_dir)
    reader.check(cfg)
    if draft is not None:
        from .draft_build import draft_options

        opts = draft_options(Path(draft), cfg, opts)
    kv_plan(cfg, opts, _kv_dtype(reader, cfg, opts))  # a plan that cannot work: refused first
    progress(f"checkpoint: {scheme.describe()}")
    tmp = engine_dir.with_name(f".{engine_dir.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_engine_dir(ckpt_dir, reader, cfg, scheme, tmp, opts, progress,
                         draft_dir=Path(draft) if draft is not None else None)
        if engine_dir.exists():
            shutil.rmtree(engine_dir)
        os.replace(tmp, engine_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"engine written to {engine_dir}")
    return engine_dir
