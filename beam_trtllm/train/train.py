"""`beam-trt train-tiny`: train transformers' BeamForCausalLM (the architecture of model.py) on
the corpus of data.py with its own tokenizer, and write a checkpoint dir that `beam-trt build`
and `beam-trt generate` read.

Seeded throughout (corpus, tokenizer, init, batch order). AdamW with linear warmup and a
cosine decay; BF16 autocast on CUDA, FP32 on the CPU. With `--seconds` and no `--steps` the
step count is fixed after the first steps from their measured speed (and recorded, so
`--steps N` repeats the schedule exactly); training also stops when the budget is spent.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .checks import autocast, code_check, heldout_loss, token_loss, tool_check
from .data import Corpus, gather_sources, tokenize_corpus
from .model import (
    AUTOCAST_EXPERTS, SIZES, RouterBalancer, build_model, register_autocast_experts,
    save_checkpoint, weight_bytes,
)
from .tokenizer import train_tokenizer

MEASURE_STEPS = (3, 13)  # steps [3, 13) time the step (the first ones warm up the allocator)
EVALS = 4  # held-out evaluations during training, evenly spaced


@dataclass
class TrainOptions:
    out_dir: Path
    device: str = "cpu"
    seconds: float = 150.0
    steps: int | None = None
    seed: int = 0
    size: str = "canonical"
    batch_size: int | None = None  # default 64 on CUDA, 8 on the CPU
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dialogues: int = 12000
    max_stdlib_mb: float | None = None
    heldout_tokens: int = 65536
    bias_rate: float = 1e-3
    log_every: int = 20
    checks: bool = True
    command: list[str] = field(default_factory=lambda: list(sys.argv))

    @property
    def rows_per_step(self) -> int:
        return self.batch_size or (64 if self.device == "cuda" else 8)


class Log:
    """Progress to stdout (or `echo`) and to OUT_DIR/train_log.txt."""

    def __init__(self, path: Path, echo: Callable[[str], None] = print):
        self.file = path.open("w")
        self.echo = echo
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        self.echo(line)
        self.file.write(line + "\n")
        self.file.flush()


def lr_at(step: int, total: int, opts: TrainOptions) -> float:
    warm = min(opts.warmup, max(1, total // 10))
    if step < warm:
        return opts.lr * (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, total - warm))
    cosine = 0.5 * (1 + math.cos(math.pi * frac))
    return opts.lr * (opts.min_lr_ratio + (1 - opts.min_lr_ratio) * cosine)


def optimizer_for(model, opts: TrainOptions) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=opts.lr,
                             betas=(0.9, 0.95), eps=1e-8, fused=opts.device == "cuda")


def pick_experts_implementation(model, corpus: Corpus, opts: TrainOptions, log: Log) -> str:
    """The first experts implementation whose forward and backward run on this device: on
    CUDA transformers' grouped_mm on BF16-cast weights (model.autocast_grouped_mm), then
    plain grouped_mm (FP32: torch's per-expert fallback), then transformers' eager loop."""
    register_autocast_experts()
    x, y = (t[:2].to(opts.device) for t in corpus.train)
    choices = (AUTOCAST_EXPERTS, "grouped_mm", "eager") if opts.device == "cuda" else (
        "grouped_mm", "eager")
    for impl in choices:
        model.set_experts_implementation(impl)
        try:
            with autocast(opts.device):
                loss = token_loss(model(input_ids=x, use_cache=False).logits, y)
            loss.backward()
        except (RuntimeError, NotImplementedError) as exc:
            log(f"experts: {impl} failed on {opts.device} ({str(exc).splitlines()[0][:120]})")
            continue
        finally:
            model.zero_grad(set_to_none=True)
        return impl
    raise RuntimeError(f"no experts implementation of transformers runs on {opts.device}")


def prepare(opts: TrainOptions, log: Log):
    """Corpus, tokenizer (written to OUT_DIR), model config with the tokenizer's ids."""
    from ..tokenizer import END_OF_TEXT, EOS_TOKENS, PAD

    base = SIZES[opts.size]
    max_bytes = None if opts.max_stdlib_mb is None else int(opts.max_stdlib_mb * 1e6)
    src = gather_sources(opts.seed, opts.dialogues, max_bytes)
    log(f"corpus: {src.meta['stdlib_train_files']} stdlib files "
        f"({src.meta['stdlib_train_bytes'] / 1e6:.1f} MB, Python {src.meta['python']}), "
        f"{src.meta['stdlib_heldout_files']} held out; {len(src.train_dialogues)} dialogue "
        f"examples, {len(src.heldout_dialogues)} held out")
    tok, ids = train_tokenizer(opts.out_dir, src, base.vocab_size, base.max_position_embeddings)
    log(f"tokenizer: byte-level BPE, {base.vocab_size} tokens ({len(ids)} special)")
    corpus = tokenize_corpus(tok, src, opts.seq_len, ids[END_OF_TEXT], ids[PAD],
                             opts.heldout_tokens, opts.seed)
    m = corpus.meta
    log(f"tokens: {m['train_tokens']:,} training ({m['train_target_tokens']:,} targets, "
        f"{corpus.train[0].shape[0]:,} rows of {opts.seq_len}); held out: "
        f"{m['heldout_code_tokens']:,} code, {m['heldout_chat_target_tokens']:,} chat targets")
    cfg = base.replace(bos_token_id=ids[END_OF_TEXT], pad_token_id=ids[PAD],
                       eos_token_id=tuple(ids[t] for t in EOS_TOKENS))
    return tok, ids, corpus, cfg


def plan_steps(opts: TrainOptions, step_seconds: float, elapsed: float) -> int:
    """Steps that fit the budget at the measured speed (evaluations cost ~2 steps each)."""
    left = max(0.0, opts.seconds - elapsed)
    return MEASURE_STEPS[1] + max(1, int(0.97 * left / step_seconds) - 2 * EVALS)


class Batches:
    """Training rows on the device (a pageable host-to-device copy per step would sync), in a
    new seeded order every epoch."""

    def __init__(self, corpus: Corpus, opts: TrainOptions):
        self.corpus, self.seed, self.device = corpus, opts.seed, opts.device
        self.bs = opts.rows_per_step
        self.inputs, self.labels = (t.to(opts.device) for t in corpus.train)
        self.n_rows = self.inputs.shape[0]
        if self.n_rows < self.bs:
            raise ValueError(f"the corpus packs into {self.n_rows} rows, fewer than "
                             f"--batch-size {self.bs}")
        self.epoch, self.cursor = 0, 0
        self.order = corpus.epoch_order(0, self.seed).to(self.device)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cursor + self.bs > self.n_rows:
            self.epoch, self.cursor = self.epoch + 1, 0
            self.order = self.corpus.epoch_order(self.epoch, self.seed).to(self.device)
        idx = self.order[self.cursor:self.cursor + self.bs]
        self.cursor += self.bs
        return self.inputs[idx], self.labels[idx]

    @property
    def epochs(self) -> float:
        return round(self.epoch + self.cursor / self.n_rows, 2)


def train_step(model, opt, x, y, lr: float, opts: TrainOptions) -> torch.Tensor:
    for g in opt.param_groups:
        g["lr"] = lr
    with autocast(opts.device):
        loss = token_loss(model(input_ids=x, use_cache=False).logits, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), opts.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def evaluate(model, corpus: Corpus, opts: TrainOptions, step: int, log: Log) -> dict:
    ev = heldout_loss(model, corpus.heldout_code, opts.device, opts.rows_per_step)
    log(f"held-out code at step {step}: loss {ev['loss']:.4f} ppl {ev['perplexity']:.2f}")
    return {"step": step, **ev}


def train_loop(model, corpus: Corpus, opts: TrainOptions, log: Log) -> dict:
    opt, balancer, batches = optimizer_for(model, opts), RouterBalancer(model, opts.bias_rate), \
        Batches(corpus, opts)
    unknown = 10 ** 9
    total = opts.steps or unknown  # fixed after MEASURE_STEPS when only --seconds is given
    loss_sum, seen, recent, first = torch.zeros((), device=opts.device), 0, [], None
    evals = [evaluate(model, corpus, opts, 0, log)]
    t0 = t_measure = time.perf_counter()
    step = 0
    while step < total:
        x, y = batches.next()
        loss_sum += train_step(model, opt, x, y, lr_at(step, total, opts), opts)
        load = balancer.update()
        seen += x.numel()
        step += 1
        if step in MEASURE_STEPS:
            _sync(opts.device)
        if step == MEASURE_STEPS[0]:
            t_measure = time.perf_counter()
        if step == MEASURE_STEPS[1] and opts.steps is None:
            per = (time.perf_counter() - t_measure) / (MEASURE_STEPS[1] - MEASURE_STEPS[0])
            total = plan_steps(opts, per, time.perf_counter() - t0)
            log(f"{per * 1e3:.0f} ms/step: {total} steps fit {opts.seconds:.0f}s "
                f"(repeat this schedule with --steps {total})")
        stop = opts.steps is None and time.perf_counter() - t0 > opts.seconds
        if step % opts.log_every == 0 or step == total or stop:
            mean = float(loss_sum) / ((step - 1) % opts.log_every + 1)
            loss_sum.zero_()
            recent, first = (recent + [mean])[-3:], mean if first is None else first
            el = time.perf_counter() - t0
            log(f"step {step}/{total if total < unknown else '?'}  loss {mean:.4f}  "
                f"lr {lr_at(step - 1, total, opts):.2e}  tok/s {seen / el:,.0f}  expert load "
                f"max/mean {float(load):.2f}  epoch {batches.epoch}  elapsed {el:.1f}s")
        if total < unknown and step % max(1, total // EVALS) == 0 and step < total:
            evals.append(evaluate(model, corpus, opts, step, log))
        if stop:
            log(f"stopping at step {step}: the {opts.seconds:.0f}s budget is spent")
            break
    _sync(opts.device)
    balancer.remove()
    seconds = time.perf_counter() - t0
    return {"steps": step, "planned_steps": total, "epochs": batches.epochs,
            "tokens_seen": seen, "tokens_per_second": round(seen / seconds),
            "first_train_loss": round(first or float("nan"), 4),
            "final_train_loss": round(sum(recent) / len(recent), 4),
            "train_seconds": round(seconds, 1), "heldout_during_training": evals}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train_tiny(opts: TrainOptions, echo: Callable[[str], None] = print) -> dict:
    """The whole pipeline; returns (and writes to OUT_DIR/train_summary.json) the summary."""
    t_start = time.perf_counter()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    log = Log(opts.out_dir / "train_log.txt", echo)
    torch.manual_seed(opts.seed)
    if opts.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    tok, ids, corpus, cfg = prepare(opts, log)
    model = build_model(cfg, opts.seed).to(opts.device).train()
    log(f"model: {cfg.total_params:,} parameters ({cfg.active_params:,} active), "
        f"{weight_bytes(cfg) / 1e6:.1f} MB in BF16; {opts.rows_per_step} x {opts.seq_len} "
        f"tokens per step on {device_name(opts.device)}")
    impl = pick_experts_implementation(model, corpus, opts, log)
    stats = train_loop(model, corpus, opts, log)
    save_checkpoint(model, opts.out_dir, ids, list(cfg.eos_token_id))  # now BF16, routers FP32
    bf16 = {"code": heldout_loss(model, corpus.heldout_code, opts.device, opts.rows_per_step,
                                 amp=False),
            "chat": heldout_loss(model, corpus.heldout_chat, opts.device, opts.rows_per_step,
                                 amp=False)}
    log(f"held-out (BF16 weights): code loss {bf16['code']['loss']:.4f} ppl "
        f"{bf16['code']['perplexity']:.2f}; chat loss {bf16['chat']['loss']:.4f}")
    checks = {}
    if opts.checks:
        checks = {"code": code_check(model, tok, opts.device),
                  "tool": tool_check(model, tok, opts.device)}
        log(f"checks: code parses {checks['code']['code_parses']}; tool call arguments valid "
            f"{checks['tool']['arguments_valid']}")
    summary = summarize(opts, cfg, corpus, stats, bf16, checks, impl,
                        time.perf_counter() - t_start)
    (opts.out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
    verify_checkpoint(opts.out_dir)
    return summary


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def verify_checkpoint(out_dir: Path) -> None:
    """The dir reads back through beam-trt's strict loader (every tensor, shape and dtype)."""
    from ..checkpoint import load_state_dict
    from ..config import BeamConfig

    load_state_dict(out_dir, BeamConfig.from_hf(out_dir))


def summarize(opts, cfg, corpus, stats, bf16, checks, impl, total_seconds) -> dict:
    import transformers

    size = sum(p.stat().st_size for p in opts.out_dir.iterdir() if p.is_file())
    return {
        "params": cfg.total_params, "active_params": cfg.active_params,
        "weights_mb": round(weight_bytes(cfg) / 1e6, 2), "out_dir_mb": round(size / 1e6, 2),
        "tokens_seen": stats["tokens_seen"], "final_train_loss": stats["final_train_loss"],
        "heldout_loss": bf16["code"]["loss"], "heldout_perplexity": bf16["code"]["perplexity"],
        "heldout_chat_loss": bf16["chat"]["loss"], "seconds": stats["train_seconds"],
        "total_seconds": round(total_seconds, 1), "device": device_name(opts.device),
        "steps": stats["steps"], "training": stats, "heldout_bf16": bf16, "checks": checks,
        "experts_implementation": impl, "corpus": corpus.meta,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
    }
