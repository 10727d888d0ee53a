"""`python -m beam_trtllm.trtllm engine-args ...`: write the TRT-LLM engine-args YAML of a role."""

from __future__ import annotations

from pathlib import Path

import click

from beam_trtllm.config import PRESETS, BeamConfig, ConfigError, preset

from .errors import TrtllmAdapterError
from .llm_args import KV_CACHE_DTYPES, MOE_BACKENDS, ROLES, ServingOptions, engine_args_yaml


@click.group()
def main() -> None:
    """Beam on TensorRT-LLM: helpers that need no TensorRT-LLM install."""


@main.command("engine-args")
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)))
@click.option("--config", "config_path", type=click.Path(path_type=Path),
              help="A checkpoint dir or its config.json.")
@click.option("--role", type=click.Choice(ROLES), required=True)
@click.option("--tp", default=1, show_default=True, help="tensor_parallel_size")
@click.option("--ep", default=None, type=int, help="moe_expert_parallel_size (default: --tp)")
@click.option("--max-seq-len", default=None, type=int, help="default: max_position_embeddings")
@click.option("--max-isl", default=4096, show_default=True, help="longest prompt")
@click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="fp8",
              show_default=True)
@click.option("--moe-backend", type=click.Choice(MOE_BACKENDS), default="CUTLASS",
              show_default=True)
@click.option("-o", "--output", type=click.Path(path_type=Path), help="default: stdout")
def engine_args_cmd(preset_name, config_path, role, tp, ep, max_seq_len, max_isl,
                    kv_cache_dtype, moe_backend, output):
    """The --extra-engine-args / trtllm-serve --config YAML for one role."""
    if (preset_name is None) == (config_path is None):
        raise click.UsageError("give exactly one of --preset or --config")
    try:
        cfg = preset(preset_name) if preset_name else BeamConfig.from_hf(config_path)
        opts = ServingOptions(tensor_parallel_size=tp, moe_expert_parallel_size=ep,
                              max_seq_len=max_seq_len, max_isl=max_isl,
                              kv_cache_dtype=kv_cache_dtype, moe_backend=moe_backend)
        text = engine_args_yaml(cfg, role, opts)
    except (ConfigError, TrtllmAdapterError) as exc:
        raise click.ClickException(str(exc)) from None
    if output is None:
        click.echo(text, nl=False)
    else:
        output.write_text(text)
        click.echo(f"wrote {output}")


if __name__ == "__main__":
    main()
