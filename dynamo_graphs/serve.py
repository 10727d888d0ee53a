"""What `beam-trt serve` and `beam-trt k8s` call (the CLI only parses options)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from beam_trtllm.config import BeamConfig, ConfigError, preset

from .graph import GraphError, load_graph
from .launch import launch, serve_forever, stop_on_signals


def serve(graph_file: Path, engine_dir: Path | None, port: int | None,
          run_dir: Path | None) -> None:
    graph = load_graph(graph_file, engine_dir)
    _check_engine_dir(graph.engine_dir, graph_file)
    if port is not None:
        from dataclasses import replace

        graph = replace(graph, frontend=replace(graph.frontend, http_port=port))

    def progress(line: str) -> None:
        print(f"[serve] {line}", file=sys.stderr, flush=True)

    n = sum(w.count for w in graph.workers)
    progress(f"starting {graph.name}: frontend + {n} worker(s) serving {graph.engine_dir}")
    stop_on_signals()  # also while starting
    running = launch(graph, run_dir, echo=sys.stdout, progress=progress)
    print(f"[serve] {graph.name} ready: {running.url}/v1 (model {graph.served_model_name!r}); "
          f"logs in {running.run_dir / 'logs'}; Ctrl-C stops", file=sys.stderr, flush=True)
    serve_forever(running)


def render_k8s(graph_file: Path, engine_dir: Path | None, preset_name: str | None) -> str:
    from .k8s import render_dgd

    graph = load_graph(graph_file, engine_dir)
    if preset_name:
        cfg = preset(preset_name)
    else:
        config = graph.engine_dir / "config.json"
        if not config.is_file():
            raise GraphError(f"{graph_file}: {config} not found; give --engine-dir DIR or "
                             "--preset NAME for the model's architecture")
        cfg = BeamConfig.from_hf(config)
    return yaml.safe_dump(render_dgd(graph, cfg), sort_keys=False, width=100)


def _check_engine_dir(engine_dir: Path, graph_file: Path) -> None:
    missing = [f for f in ("config.json", "tokenizer.json", "tokenizer_config.json")
               if not (engine_dir / f).is_file()]
    if missing:
        raise GraphError(f"{graph_file}: engine_dir {engine_dir} lacks {', '.join(missing)} "
                         "(build one with `beam-trt build`, or pass --engine-dir)")
    try:
        BeamConfig.from_hf(engine_dir / "config.json")
    except ConfigError as exc:
        raise GraphError(str(exc)) from None
