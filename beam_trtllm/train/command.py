"""`beam-trt train-tiny`: the command (registered by beam_trtllm/cli.py); the work is train.py's."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("train-tiny")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="[default: cuda if a GPU is visible, else cpu]")
@click.option("--seconds", default=150.0, show_default=True, type=click.FloatRange(min=1),
              help="Wall-time budget of the training loop (the step count is fixed from the "
              "measured speed after the first steps).")
@click.option("--steps", default=None, type=click.IntRange(min=1), help="Exact step count (repeats a recorded "
              "schedule; the budget then does not stop training).")
@click.option("--seed", default=0, show_default=True)
@click.option("--size", type=click.Choice(["canonical", "small"]), default="canonical",
              show_default=True, help="small: the same features at test size.")
@click.option("--batch-size", default=None, type=int, help="Rows per step [default: 64 on "
              "CUDA, 8 on the CPU].")
@click.option("--seq-len", default=512, show_default=True, help="Tokens per row.")
@click.option("--lr", default=2e-3, show_default=True, help="Peak learning rate.")
@click.option("--dialogues", default=12000, show_default=True, help="Synthetic dialogues.")
@click.option("--max-stdlib-mb", default=None, type=float,
              help="Use only the first N MB of stdlib training files [default: all].")
@click.option("--heldout-tokens", default=65536, show_default=True)
@click.option("--no-checks", is_flag=True, help="Skip the greedy code / tool-call answers.")
def train_tiny_cmd(out_dir, device, seconds, steps, seed, size, batch_size, seq_len, lr,
                   dialogues, max_stdlib_mb, heldout_tokens, no_checks):
    """Train the tiny Beam (transformers' BeamForCausalLM) on the stdlib and synthetic chat
    dialogues; write a checkpoint dir with its tokenizer, log and summary."""
    import torch

    from .train import TrainOptions, train_tiny

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            click.echo("no GPU visible: training on the CPU", err=True)
    elif device == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("--device cuda: no CUDA device is visible")
    if (out_dir / "config.json").exists():
        raise click.ClickException(f"{out_dir} already holds a checkpoint (config.json); give a new dir")
    opts = TrainOptions(out_dir=out_dir, device=device, seconds=seconds, steps=steps, seed=seed,
                        size=size, batch_size=batch_size, seq_len=seq_len, lr=lr,
                        dialogues=dialogues, max_stdlib_mb=max_stdlib_mb,
                        heldout_tokens=heldout_tokens, checks=not no_checks)
    summary = train_tiny(opts, echo=click.echo)
    keys = ("params", "active_params", "weights_mb", "out_dir_mb", "tokens_seen",
            "final_train_loss", "heldout_loss", "heldout_perplexity", "heldout_chat_loss",
            "seconds", "total_seconds", "steps", "device", "experts_implementation")
    short = {k: summary[k] for k in keys}
    if summary["checks"]:
        short["code_parses"] = summary["checks"]["code"]["code_parses"]
        short["tool_arguments_valid"] = summary["checks"]["tool"]["arguments_valid"]
    click.echo(json.dumps(short, indent=2))
