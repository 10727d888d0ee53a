"""`beam-trt build --tp N --ep M [--attention-dp]`: one engine dir per rank.

    ENGINE/parallel.json      the layout (tp, ep, attention_dp, world) and the rank dirs
    ENGINE/config.json, tokenizer files   (what Dynamo's frontend reads)
    ENGINE/rank{r}/           a complete engine dir: rank r's pieces (parallel/shard.py), its
                              engine.json `parallel` block and its own KV plan

From any checkpoint the build reads (each rank takes its pieces), or from the converter's
`--format trtllm` rank files of the same layout (reassembled, then split by the engine's
rules; rank files of another layout are refused). Written into a hidden sibling dir and
renamed into place at the end, like a single engine dir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from ..build_parts import (CheckpointReader, _copy_side_files, _kv_dtype, check_out_dir,
                     checkpoint_hash, read_inputs, write_engine_dir)
from ..plan import BuildOptions, kv_plan
from .mapping import PARALLEL_FILE, PARALLEL_FORMAT, ParallelMapping
from .shard import RankFilesReader, RankView, is_rank_files

_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def build_parallel(ckpt_dir, engine_dir, opts: BuildOptions, mapping: ParallelMapping,
                   progress: Callable[[str], None] = lambda msg: None,
                   overwrite: bool = False) -> Path:
    ckpt_dir, engine_dir = Path(ckpt_dir), Path(engine_dir)
    check_out_dir(engine_dir, overwrite)
    cfg, scheme = read_inputs(ckpt_dir)
    mapping.check(cfg)
    first = RankFilesReader(ckpt_dir, cfg, mapping) if is_rank_files(ckpt_dir) else None
    kv_plan(mapping.local_config(cfg), opts, _kv_dtype(first or CheckpointReader(ckpt_dir), cfg,
                                                       opts))  # refused before any work
    progress(f"checkpoint: {scheme.describe()}; layout {mapping.describe()}, "
             f"{mapping.world} ranks")
    ckpt_sha = checkpoint_hash(ckpt_dir)
    tmp = engine_dir.with_name(f".{engine_dir.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for r in range(mapping.world):
            rank = mapping.at(r)
            reader = (RankFilesReader(ckpt_dir, cfg, mapping) if is_rank_files(ckpt_dir)
                      else CheckpointReader(ckpt_dir))
            reader.check(cfg)
            (tmp / f"rank{r}").mkdir()
            here = rank.experts(cfg)
            write_engine_dir(ckpt_dir, RankView(reader, cfg, rank), cfg, scheme, tmp / f"rank{r}",
                             opts, _prefixed(progress, f"rank {r}: "), rank, ckpt_sha,
                             not_here=lambda n, here=here: _other_expert(n, here))
        _copy_side_files(ckpt_dir, tmp, cfg)
        (tmp / PARALLEL_FILE).write_text(json.dumps(
            {"format": PARALLEL_FORMAT, **mapping.to_json(), "rank": None,
             "ranks": [f"rank{r}" for r in range(mapping.world)]}, indent=2))
        if engine_dir.exists():
            shutil.rmtree(engine_dir)
        os.replace(tmp, engine_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"engine ({mapping.world} ranks) written to {engine_dir}")
    return engine_dir


def _other_expert(name: str, here: range) -> bool:
    hit = _EXPERT.match(name)
    return hit is not None and int(hit.group(1)) not in here


def _prefixed(progress, prefix: str):
    return lambda msg: progress(prefix + msg)


def read_layout(engine_dir: Path) -> ParallelMapping:
    """The layout of a parallel engine dir (rank 0's mapping), its rank dirs checked present."""
    from ..types import EngineError

    path = Path(engine_dir) / PARALLEL_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineError(f"{path}: not a readable parallel layout ({exc})") from exc
    if raw.get("format") != PARALLEL_FORMAT:
        raise EngineError(f"{path}: format is {raw.get('format')!r}, expected {PARALLEL_FORMAT!r}")
    mapping = ParallelMapping.from_json({**raw, "rank": 0}, str(path))
    for r in range(mapping.world):
        if not (Path(engine_dir) / f"rank{r}" / "engine.json").is_file():
            raise EngineError(f"{engine_dir}: rank{r}/engine.json is missing ({mapping.world} "
                              f"ranks in {PARALLEL_FILE})")
    return mapping
