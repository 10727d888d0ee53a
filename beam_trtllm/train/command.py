"""`beam-trt train-tiny` and `beam-trt train-draft`: the commands (registered by
beam_trtllm/cli.py); the work is train.py's and beam_trtllm/draft/train.py's."""

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
@click.option("--draft-seconds", default=None, type=click.FloatRange(min=0),
              help="Budget of the drafter's training (OUT_DIR/draft/, `beam-trt train-draft`); "
              "0 skips it [default: 150 on CUDA; on the CPU a quarter of the target's training "
              "time, at least 5].")
def train_tiny_cmd(out_dir, device, seconds, steps, seed, size, batch_size, seq_len, lr,
                   dialogues, max_stdlib_mb, heldout_tokens, no_checks, draft_seconds):
    """Train the tiny Beam (transformers' BeamForCausalLM) on the stdlib and synthetic chat
    dialogues; write a checkpoint dir with its tokenizer, log and summary; then train its
    DFlash2 drafter on its outputs into OUT_DIR/draft/."""
    from .train import TrainOptions, train_tiny

    device = _pick_device(device)
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
    if draft_seconds is None:
        draft_seconds = 150.0 if device == "cuda" else max(5.0, summary["seconds"] / 4)
    if draft_seconds > 0:
        from ..draft.train import DraftTrainOptions, train_draft

        run = train_draft(DraftTrainOptions(
            out_dir=out_dir / "draft", target=out_dir, device=device, seconds=draft_seconds,
            seed=seed, dialogues=dialogues, max_stdlib_mb=max_stdlib_mb), echo=click.echo)
        short["draft_acceptance_length"] = run["heldout_acceptance"]["all"][
            "mean_acceptance_length"]
    click.echo(json.dumps(short, indent=2))


def _pick_device(device: str | None) -> str:
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            click.echo("no GPU visible: training on the CPU", err=True)
    elif device == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("--device cuda: no CUDA device is visible")
    return device


def _command_line(ctx: click.Context) -> list[str]:
    """The command as typed, rebuilt from its parameters (the ones not at their default)."""
    words = ["beam-trt", ctx.info_name]
    for param in ctx.command.params:
        value = ctx.params[param.name]
        if isinstance(param, click.Argument):
            words.append(str(value))
        elif value is not None and value != param.default and value is not False:
            words += [param.opts[0]] + ([] if value is True else [str(value)])
    return words


@click.command("train-draft")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--target", "target_dir", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The target checkpoint dir (a Beam with its tokenizer, e.g. "
              "`beam-trt init-tiny DIR --trained`).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="[default: cuda if a GPU is visible, else cpu]")
@click.option("--seconds", default=150.0, show_default=True, type=click.FloatRange(min=1),
              help="Budget of generation + training (the step count is fixed from the "
              "measured speed after the first steps).")
@click.option("--steps", default=None, type=click.IntRange(min=1), help="Exact step count.")
@click.option("--sequences", default=None, type=click.IntRange(min=1),
              help="Greedy sequences to generate [default: as --gen-fraction of the budget "
              "allows].")
@click.option("--seed", default=0, show_default=True)
@click.option("--gen-fraction", default=0.4, show_default=True, type=click.FloatRange(0, 1),
              help="Share of --seconds spent generating the target's continuations.")
@click.option("--prompt-len", default=128, show_default=True, help="Prompt window tokens.")
@click.option("--gen-tokens", default=128, show_default=True, help="Greedy tokens per prompt.")
@click.option("--batch-size", default=None, type=int, help="Sequences per step [default: 64 "
              "on CUDA, 8 on the CPU].")
@click.option("--blocks-per-seq", default=16, show_default=True, help="Blocks per sequence.")
@click.option("--lr", default=3e-3, show_default=True, help="Peak learning rate.")
@click.option("--layers", "num_layers", default=2, show_default=True, help="Drafter layers.")
@click.option("--dialogues", default=12000, show_default=True, help="Synthetic dialogues.")
@click.option("--max-stdlib-mb", default=None, type=float,
              help="Use only the first N MB of stdlib training files [default: all].")
@click.option("--eval-prompts", default=None, type=click.IntRange(min=2),
              help="Held-out prompts [default: 128 on CUDA, 16 on the CPU].")
@click.option("--eval-tokens", default=None, type=click.IntRange(min=2),
              help="New tokens per held-out prompt [default: 128 on CUDA, 64 on the CPU].")
@click.option("--log-every", default=20, show_default=True)
@click.pass_context
def train_draft_cmd(ctx, out_dir, target_dir, device, **kw):
    """Train a DFlash2 drafter for the target on its own outputs (greedy continuations of the
    training corpus, next-token distributions); write it in the vLLM / SGLang layout with
    RUN.json (held-out acceptance under greedy verification)."""
    from ..draft.config import DraftError
    from ..draft.train import DraftTrainOptions, train_draft

    device = _pick_device(device)
    if (out_dir / "config.json").exists():
        raise click.ClickException(f"{out_dir} already holds a drafter (config.json); give a "
                                   "new dir")
    try:
        run = train_draft(DraftTrainOptions(out_dir=out_dir, target=target_dir, device=device,
                                            command=_command_line(ctx), **kw), echo=click.echo)
    except DraftError as exc:
        raise click.ClickException(str(exc)) from exc
    keys = ("params", "steps", "sequences_generated", "train_seconds", "total_seconds",
            "final_losses", "model_safetensors_sha256")
    short = {k: run[k] for k in keys}
    short["heldout_acceptance"] = {k: v["mean_acceptance_length"]
                                   for k, v in run["heldout_acceptance"].items()
                                   if isinstance(v, dict) and "mean_acceptance_length" in v}
    click.echo(json.dumps(short, indent=2))
