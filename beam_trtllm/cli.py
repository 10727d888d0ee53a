"""`beam-trt`: the command line. Commands parse options and call library functions; no logic here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .config import PRESETS, BeamConfig, ConfigError, preset


class BeamCLIError(click.ClickException):
    """Shown as `Error: ...` with exit code 1 (no traceback)."""


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """beam-trt: Beam 1.0 from Hugging Face checkpoint to a served deployment."""


from .train.command import train_draft_cmd, train_tiny_cmd  # noqa: E402  (the training options)

main.add_command(train_tiny_cmd)
main.add_command(train_draft_cmd)


@main.command("info")
@click.argument("ckpt_dir", required=False, type=click.Path(path_type=Path))
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)), help="A shipped preset.")
@click.option("--context", default=1 << 20, show_default=True, help="Context length for the KV estimate.")
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp8"]), default="fp8", show_default=True)
@click.option("--max-num-tokens", type=int, default=None,
              help="Prefill chunk for the activation estimate (default: an engine dir's "
                   "--max-num-tokens, else 8192).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def info_cmd(ckpt_dir, preset_name, context, kv_dtype, max_num_tokens, as_json):
    """Parameter counts, layer map, KV, weight and activation memory of a preset, checkpoint
    or engine dir (an engine dir also gets its plan: weights + KV + activations)."""
    from .info import engine_plan_inputs, format_report, report

    if (ckpt_dir is None) == (preset_name is None):
        raise click.UsageError("give exactly one of CKPT_DIR or --preset")
    try:
        cfg = preset(preset_name) if preset_name else BeamConfig.from_hf(ckpt_dir)
    except ConfigError as exc:
        raise BeamCLIError(str(exc)) from exc
    if cfg.report_unknown():
        click.echo(f"warning: {cfg.report_unknown()}", err=True)
    try:
        precision, chunk = engine_plan_inputs(ckpt_dir) if ckpt_dir is not None else (None, None)
    except ValueError as exc:
        raise BeamCLIError(str(exc)) from exc
    r = report(cfg, context, kv_dtype, max_num_tokens or chunk or 8192, precision)
    if ckpt_dir is not None and precision is None and any(ckpt_dir.glob("*.safetensors")):
        from .engine.types import EngineError
        from .info import checkpoint_quantization, format_checkpoint
        from .quant_schemes import SchemeError

        try:
            r["checkpoint"] = checkpoint_quantization(ckpt_dir)
        except (SchemeError, EngineError, ValueError) as exc:
            raise BeamCLIError(str(exc)) from exc
    text = format_report(r) + ("\n" + format_checkpoint(r["checkpoint"]) if "checkpoint" in r else "")
    if ckpt_dir is not None and (ckpt_dir / "parallel.json").is_file():  # a parallel engine dir
        from .engine.types import EngineError
        from .info import engine_ranks, format_ranks

        try:
            r["parallel"] = engine_ranks(ckpt_dir)
        except (EngineError, KeyError, ValueError) as exc:
            raise BeamCLIError(f"{ckpt_dir}: {exc}") from exc
        text += "\n" + format_ranks(r["parallel"])
    click.echo(json.dumps(r, indent=2) if as_json else text)


@main.command("init-tiny")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights.")
@click.option("--trained", is_flag=True, help="The trained tiny Beam shipped with beam-trt "
              "(beam_trtllm/data/trained_tiny; `beam-trt train-tiny` makes one) instead of "
              "random weights.")
def init_tiny_cmd(out_dir, seed, trained):
    """Write a complete, deterministic tiny Beam checkpoint (HF layout, with tokenizer)."""
    from .tiny import init_tiny, init_trained_tiny

    if trained:
        path = init_trained_tiny(out_dir)
        cfg = BeamConfig.from_hf(path)
        click.echo(f"wrote the trained tiny Beam ({cfg.total_params:,} parameters) to {path}")
        return
    path = init_tiny(out_dir, seed=seed)
    cfg = BeamConfig.from_hf(path)
    click.echo(f"wrote tiny Beam ({cfg.total_params:,} parameters, seed {seed}) to {path}")


@main.command("build")
@click.argument("ckpt_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--target", type=click.Choice(["cpu", "sm90", "sm100"]), default="cpu", show_default=True)
@click.option("--max-batch", default=8, show_default=True, help="Concurrent sequences.")
@click.option("--max-seq-len", default=4096, show_default=True, help="Prompt + generated tokens.")
@click.option("--max-num-tokens", default=512, show_default=True, help="Tokens per step.")
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp32", "fp8"]), default=None,
              help="KV cache dtype [default: fp8 if the checkpoint has KV scales, else the "
              "activations' dtype].")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
              show_default=True, help="Activations and unquantized weights (float32: a CPU "
              "engine for numerics checks against the FP32 model).")
@click.option("--kv-memory", type=float, default=None,
              help="GiB for the KV cache [default: room for --max-batch x --max-seq-len].")
@click.option("--block-size", default=32, show_default=True, help="Tokens per KV block.")
@click.option("--cuda-graph-batch-sizes", default="", help="Comma-separated decode batch sizes to capture.")
@click.option("--autotune", type=click.Choice(["auto", "quick", "off"]), default="auto",
              show_default=True, help="Search the Triton launch shapes on the target GPU (at "
              "build if this machine has it, else at the first load); quick: fewer candidates.")
@click.option("--overwrite", is_flag=True, help="Replace an existing ENGINE_DIR.")
@click.option("--tp", default=1, show_default=True, help="Tensor-parallel ranks (world size): "
              "attention heads and dense MLPs split tp ways; > 1 writes one engine dir per rank.")
@click.option("--ep", default=1, show_default=True, help="Expert-parallel groups (divides --tp): "
              "each holds num_experts / ep experts, split tp / ep ways.")
@click.option("--attention-dp", is_flag=True, help="Attention data parallel: every rank its own "
              "requests and KV cache (attention and dense MLPs whole), the MoE over all ranks.")
@click.option("--draft", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="A DFlash2 drafter checkpoint dir for speculative decoding "
              "(copied to ENGINE_DIR/draft/).")
@click.option("--draft-tokens", default=0, help="Drafts verified per step [default: the "
              "drafter's block_size - 1].")
@click.option("--draft-quant", default="auto", show_default=True, help="The drafter's weights: "
              "auto (fp8 when the target's are quantized), bf16 or fp8 (per channel).")
def build_cmd(ckpt_dir, engine_dir, target, max_batch, max_seq_len, max_num_tokens, kv_dtype,
              dtype, kv_memory, block_size, cuda_graph_batch_sizes, autotune, overwrite, tp, ep,
              attention_dp, draft, draft_tokens, draft_quant):
    """Build an engine dir (repacked weights, KV plan, tokenizer) from a converted checkpoint."""
    from .checkpoint import CheckpointError
    from .engine.build import build_engine
    from .engine.plan import BuildOptions
    from .engine.types import EngineError

    try:
        sizes = tuple(int(s) for s in cuda_graph_batch_sizes.split(",") if s.strip())
    except ValueError as exc:
        raise BeamCLIError(f"--cuda-graph-batch-sizes {cuda_graph_batch_sizes!r}: {exc}") from exc
    try:
        opts = BuildOptions(target=target, max_batch=max_batch, max_seq_len=max_seq_len,
                            max_num_tokens=max_num_tokens, kv_dtype=kv_dtype,
                            kv_memory_gib=kv_memory, block_size=block_size,
                            cuda_graph_batch_sizes=sizes, autotune=autotune, dtype=dtype,
                            draft_tokens=draft_tokens, draft_quant=draft_quant)
        if draft is None and draft_quant != "auto":
            raise EngineError(f"--draft-quant {draft_quant}: there is no drafter (add --draft DIR)")
        parallel = None
        if (tp, ep, attention_dp) != (1, 1, False):
            from .engine.parallel import ParallelMapping

            parallel = ParallelMapping(tp, ep, attention_dp)
        build_engine(ckpt_dir, engine_dir, opts, progress=click.echo, overwrite=overwrite,
                     parallel=parallel, draft=draft)
    except (EngineError, ConfigError, CheckpointError) as exc:
        raise BeamCLIError(str(exc)) from exc


@main.command("generate")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompt", required=True, help="Prompt text (a user message with --chat).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the chat template.")
@click.option("--max-new-tokens", default=32, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", default=None, type=int)
@click.option("--stop", multiple=True, help="Stop string (repeatable; engine dirs only).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Parallel engine dirs: the ranks' device (cpu: gloo; cuda: NCCL, rank r on "
              "cuda:r) [default: cuda if available].")
@click.option("--speculative/--no-speculative", default=None, help="Drafts from the engine "
              "dir's drafter [default: on when it has one].")
@click.option("--draft-tokens", default=None, type=int, help="Drafts verified per step.")
@click.option("--adaptive", is_flag=True, help="Adaptive verification: verify only the drafts "
              "the acceptance estimator and the step costs say are worth it.")
@click.option("--batch-invariant", is_flag=True, help="Every decode and verify step at one "
              "shape, never beside a prompt (single-GPU engine dirs; docs/ENGINE.md "
              "\"Batch-invariant mode\").")
def generate_cmd(model_dir, prompt, chat, max_new_tokens, temperature, top_k, top_p, seed, stop,
                 device, speculative, draft_tokens, adaptive, batch_invariant):
    """Generate text, streaming: with the engine for an engine dir (from `beam-trt build`; a
    parallel one starts its ranks), with transformers' BeamForCausalLM (FP32, CPU) for an
    unquantized checkpoint dir."""
    if batch_invariant and not (model_dir / "engine.json").is_file():
        raise BeamCLIError("--batch-invariant needs a single-GPU engine dir (engine.json)")
    if (model_dir / "parallel.json").is_file():
        _generate_parallel(model_dir, prompt, chat, device, max_new_tokens, temperature, top_k,
                           top_p, seed, stop)
    elif (model_dir / "engine.json").is_file():
        spec = speculative
        if speculative is not False and (draft_tokens or adaptive):
            from .engine.speculative import SpecConfig

            spec = SpecConfig(tokens=draft_tokens, adaptive=adaptive)
        _generate_engine(model_dir, prompt, chat, max_new_tokens, temperature, top_k, top_p, seed,
                         stop, spec, batch_invariant)
    else:
        if stop:
            raise BeamCLIError("--stop needs an engine dir (the transformers path has no stop "
                               "strings)")
        _generate_reference(model_dir, prompt, chat, max_new_tokens, temperature, top_k, top_p, seed)


def _generate_engine(engine_dir, prompt, chat, max_new_tokens, temperature, top_k, top_p, seed,
                     stop, speculative=None, batch_invariant=False):
    from .engine.engine import Engine
    from .engine.types import EngineError, SamplingParams

    try:
        engine = Engine.from_dir(engine_dir, speculative=speculative,
                                 batch_invariant=batch_invariant)
        text = (engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                if chat else prompt)
        ids = engine.tokenizer.encode(text)
        sampling = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                  top_p=top_p, seed=seed, stop=tuple(stop))
        engine.add_request("cli", ids, sampling)
    except (EngineError, FileNotFoundError, ValueError) as exc:
        raise BeamCLIError(str(exc)) from exc
    click.echo(text, nl=False)
    reason = None
    while engine.has_unfinished():
        for out in engine.step():
            click.echo(out.text, nl=False)
            sys.stdout.flush()
            reason = out.finish_reason or reason
    click.echo()
    spec = engine.spec.summary() if engine.spec is not None else ""
    click.echo(f"[{reason}; {engine.stats['generated_tokens']} tokens, {engine.device}{spec}]",
               err=True)


def _generate_parallel(engine_dir, prompt, chat, device, max_new_tokens, temperature, top_k,
                       top_p, seed, stop):
    import torch

    from .engine.parallel.build import read_layout
    from .engine.parallel.launch import launch, stream_prompt_rank
    from .engine.types import EngineError, SamplingParams

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        layout = read_layout(engine_dir)
        sampling = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                  top_p=top_p, seed=seed, stop=tuple(stop))
        launch(layout.world, stream_prompt_rank, str(engine_dir), device, prompt, chat, sampling,
               device=device)
    except (EngineError, ValueError) as exc:
        raise BeamCLIError(str(exc)) from exc


def _generate_reference(model_dir, prompt, chat, max_new_tokens, temperature, top_k, top_p, seed):
    import torch

    from .checkpoint import CheckpointError
    from .hf_model import load_model, stream
    from .tokenizer import TextTokenizer

    try:
        cfg = BeamConfig.from_hf(model_dir)
        model = load_model(model_dir, torch.float32)
        tok = TextTokenizer(model_dir)
    except (ConfigError, CheckpointError, FileNotFoundError) as exc:
        raise BeamCLIError(str(exc)) from exc
    if cfg.report_unknown():
        click.echo(f"warning: {cfg.report_unknown()}", err=True)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tok.encode(text)
    if not ids:
        raise BeamCLIError("the prompt encodes to zero tokens")
    eos = cfg.eos_token_id
    eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    click.echo(text, nl=False)
    new: list[int] = []
    shown = ""
    for token in stream(model, torch.tensor([ids]), max_new_tokens, temperature, top_k, top_p,
                        seed, eos_ids):
        new.append(int(token[0]))
        text_now = tok.decode(new)
        click.echo(text_now[len(shown):], nl=False)
        sys.stdout.flush()
        shown = text_now
    click.echo()


@main.command("convert")
@click.argument("in_dir", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--quant", required=True, help="Recipe: fp8, fp8-block, nvfp4, nvfp4-all, "
              "fp8-dynamic (with --format compressed-tensors), or a .yaml.")
@click.option("--kv-cache", type=click.Choice(["fp8", "none"]), default="none", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["hf", "trtllm", "compressed-tensors"]),
              default="hf", show_default=True,
              help="hf: ModelOpt unified HF checkpoint; trtllm: rank{r}.safetensors per rank; "
              "compressed-tensors: the compressed-tensors library's FP8_DYNAMIC checkpoint.")
@click.option("--tp", default=1, show_default=True, help="Tensor-parallel ranks (--format trtllm).")
@click.option("--ep", default=1, show_default=True, help="Expert-parallel ranks (divides --tp).")
@click.option("--calib-data", default=None, help="Calibration data: a .jsonl (text or messages), "
              ".parquet or text file, or a directory of them; 'none' for weight-only scales. "
              "Default: the set shipped with beam-trt (convert/data/calib.jsonl).")
@click.option("--calib-samples", default=32, show_default=True)
@click.option("--calib-seq-len", default=256, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--workers", default=None, type=int, help="Quantization threads (default: cores).")
@click.option("--shard-size", "shard_size_mb", default=5000.0, show_default=True,
              help="Max output shard size in MB (--format hf).")
@click.option("--overwrite", is_flag=True, help="Remove OUT_DIR's checkpoint files first "
              "(a finished or interrupted conversion, stale shards); other files are refused.")
def convert_cmd(in_dir, out_dir, quant, kv_cache, fmt, tp, ep, calib_data, calib_samples,
                calib_seq_len, device, workers, shard_size_mb, overwrite):
    """Quantize a Beam checkpoint (FP32, BF16 or FP16) to ModelOpt FP8 / NVFP4 or
    compressed-tensors FP8_DYNAMIC (streamed, resumable)."""
    import os

    from convert import ConvertError
    from convert.pipeline import ConvertOptions, convert

    opts = ConvertOptions(quant, kv_cache, fmt, tp, ep, calib_data, calib_samples, calib_seq_len,
                          device, workers or max(1, os.cpu_count() or 1), shard_size_mb, overwrite)
    try:
        out = convert(in_dir, out_dir, opts)
    except (ConvertError, ConfigError) as exc:
        raise BeamCLIError(str(exc)) from exc
    click.echo(f"wrote {out} ({quant}, {fmt}); check it with `beam-trt verify {out} --against {in_dir}`")


@main.command("verify")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--against", "against", type=click.Path(path_type=Path), default=None,
              help="The input checkpoint: per-tensor dequantization error and logits KL / "
              "top-1 (transformers' model on both).")
@click.option("--max-model-gb", default=4.0, show_default=True,
              help="Run the logits comparison only for models up to this size (BF16).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify_cmd(out_dir, against, max_model_gb, as_json):
    """Check a converted checkpoint: hashes, dequantization error, logits against its input."""
    from convert import ConvertError
    from convert.verification import format_report, verify

    try:
        report = verify(out_dir, against, max_model_gb)
    except (ConvertError, ConfigError) as exc:
        raise BeamCLIError(str(exc)) from exc
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
    if not report["ok"]:
        raise BeamCLIError(f"{out_dir}: verification failed: " + "; ".join(report["problems"][:5]))


@main.command("serve")
@click.argument("graph_file", type=click.Path(path_type=Path))
@click.option("--engine-dir", type=click.Path(path_type=Path), help="Overrides the graph's engine_dir.")
@click.option("--port", type=int, default=None, help="Overrides frontend.http_port (0 = a free port).")
@click.option("--run-dir", type=click.Path(path_type=Path), default=None,
              help="Private folder for discovery, logs and offload (default: a new temp dir).")
def serve_cmd(graph_file, engine_dir, port, run_dir):
    """Serve a Dynamo graph on 127.0.0.1 (frontend + workers) until Ctrl-C."""
    from dynamo_graphs.serve import serve

    _run_graph_command(lambda: serve(graph_file, engine_dir, port, run_dir))


@main.command("k8s")
@click.argument("graph_file", type=click.Path(path_type=Path))
@click.option("--engine-dir", type=click.Path(path_type=Path), help="Overrides the graph's engine_dir.")
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)),
              help="Take the architecture from a preset instead of ENGINE_DIR/config.json.")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Write here instead of stdout.")
def k8s_cmd(graph_file, engine_dir, preset_name, output):
    """Render a graph as a DynamoGraphDeployment manifest (nvidia.com/v1beta1)."""
    from dynamo_graphs.serve import render_k8s

    text = _run_graph_command(lambda: render_k8s(graph_file, engine_dir, preset_name))
    if output:
        output.write_text(text)
        click.echo(f"wrote {output}")
    else:
        click.echo(text, nl=False)


def _run_graph_command(fn):
    from beam_trtllm.trtllm.errors import LlmArgsError
    from dynamo_graphs.graph import GraphError
    from dynamo_graphs.launch import LaunchError

    try:
        return fn()
    except (GraphError, LaunchError, ConfigError, LlmArgsError) as exc:
        raise BeamCLIError(str(exc)) from exc


if __name__ == "__main__":
    main()
