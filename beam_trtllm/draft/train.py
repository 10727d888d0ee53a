"""`beam-trt train-draft`: train a DFlash2 drafter for a Beam target on the target's own outputs
(docs/SPECULATIVE.md "Training the drafter"), and write it in the vLLM / SGLang layout with a
RUN.json saying how it was made.

1. prompts: windows of the training corpus of beam_trtllm/train/data.py (seeded);
2. the target continues them greedily (its KV cache) for a share of the budget;
3. each step: the target's forward over a batch of those sequences gives the captured states
   and next-token distributions; blocks are cut at random anchors; the loss of train_loss.py;
4. held-out acceptance: speculative decoding of held-out prompts with the inference path,
   greedy verification against transformers' target (train_eval.py).

Seeded throughout. AdamW, linear warmup, cosine decay; BF16 autocast on CUDA, FP32 on the CPU.
With `--seconds` and no `--steps`, the step count is fixed from the speed of the first steps.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .config import DraftConfig
from .train_data import SequencePool, Target, build_pool, mixed_prompts
from .train_loss import block_states, draft_loss, lr_at, sample_blocks

MEASURE = (2, 6)  # steps [2, 6) time a step after the first ones warm up
PROMPT_POOL = 200_000  # prompt windows drawn; generation takes them in order


@dataclass
class DraftTrainOptions:
    out_dir: Path
    target: Path
    device: str = "cpu"
    seconds: float = 150.0          # generation + training (not corpus, held-out check, save)
    steps: int | None = None
    sequences: int | None = None    # greedy sequences to generate (default: as the budget allows)
    seed: int = 0
    gen_fraction: float = 0.4       # share of `seconds` spent generating
    prompt_len: int = 128
    gen_tokens: int = 128
    batch_size: int | None = None   # sequences per step (64 on CUDA, 8 on the CPU)
    blocks_per_seq: int = 16
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    gamma: float = 4.0              # position weight exp(-(s-1)/gamma)
    num_layers: int = 2
    dialogues: int = 12000
    max_stdlib_mb: float | None = None
    eval_prompts: int | None = None  # held-out prompts (128 on CUDA, 16 on the CPU)
    eval_tokens: int | None = None   # new tokens each (128 on CUDA, 64 on the CPU)
    log_every: int = 20
    command: list[str] = field(default_factory=lambda: _argv())

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def pick(self, value, cuda, cpu):
        return value if value is not None else (cuda if self.cuda else cpu)


def _argv() -> list[str]:
    """The command line, `python3 -m beam_trtllm.cli ...` when run that way."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("beam_trtllm/cli.py", "beam_trtllm\\cli.py")):
        argv[0:1] = ["python3", "-m", "beam_trtllm.cli"]
    return argv


def target_layer_ids(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` target layers spread from layer 1 to the last, round(1 + i (Lt - 2) / (n - 1)):
    the engines' default spread starts at 1 (SGLang's build_target_layer_ids), and in a shallow
    target the last layers are where the next tokens take shape, so the spread ends there.
    8 layers -> (1, 2, 4, 6, 7)."""
    count = min(count, num_layers - 1)
    if count <= 1:
        return (num_layers // 2,)
    ids = sorted({round(1 + i * (num_layers - 2) / (count - 1)) for i in range(count)})
    return tuple(ids)


def default_draft_config(cfg, mask_token_id: int, num_layers: int = 2) -> DraftConfig:
    """The drafter for target `cfg` (a BeamConfig): its width, heads and window; 2 layers
    (the second mixes what the first attention gave each mask row), MLP 2H, block 8 (7
    drafts), conv K=4 over groups of H/16 channels, selector rank 32 and top-8."""
    h = cfg.hidden_size
    return DraftConfig(
        hidden_size=h, num_hidden_layers=num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        intermediate_size=2 * h, rms_norm_eps=cfg.rms_norm_eps, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        sliding_window=cfg.sliding_window, target_layer_ids=target_layer_ids(cfg.num_hidden_layers),
        block_size=8, conv_kernel_size=4, conv_group_size=max(1, h // 16), selector_rank=32,
        selector_top_k=8, final_logit_softcapping=float(cfg.final_logit_softcapping or 30.0),
        mask_token_id=mask_token_id, num_target_layers=cfg.num_hidden_layers)


def corpus_prompts(target: Target, opts: DraftTrainOptions, log) -> tuple[torch.Tensor, dict]:
    """(training prompt windows, held-out prompt windows by kind) from the corpus."""
    from ..tokenizer import END_OF_TEXT, PAD
    from ..train.data import gather_sources, tokenize_corpus

    max_bytes = None if opts.max_stdlib_mb is None else int(opts.max_stdlib_mb * 1e6)
    src = gather_sources(opts.seed, opts.dialogues, max_bytes)
    tok = target.tok
    pad = tok.token_id(PAD)
    corpus = tokenize_corpus(tok, src, 512, tok.token_id(END_OF_TEXT), pad, 1 << 17, opts.seed)
    log(f"corpus: {src.meta['stdlib_train_files']} stdlib files, {len(src.train_dialogues)} "
        f"dialogue examples (Python {src.meta['python']}); {corpus.train[0].shape[0]} rows")
    gen = torch.Generator().manual_seed(opts.seed)
    count = max(opts.sequences or 0, PROMPT_POOL)  # the same list whatever --sequences says
    train = mixed_prompts(*corpus.train, corpus.train, pad, opts.prompt_len, count, gen)
    n_eval = opts.pick(opts.eval_prompts, 128, 16)
    held = {"code": _windows(corpus.heldout_code, pad, opts.prompt_len, n_eval - n_eval // 2,
                             False, gen),
            "chat": _windows(corpus.heldout_chat, pad, opts.prompt_len, n_eval // 2, True, gen)}
    return train, held


def _windows(rows, pad, length, count, answers, gen):
    from .train_data import sample_windows

    return sample_windows(rows[0], rows[1], pad, length, count, answers, gen)


def init_params(dcfg: DraftConfig, opts: DraftTrainOptions) -> dict[str, torch.nn.Parameter]:
    from .weights import init_draft_weights

    return {n: torch.nn.Parameter(t.to(opts.device))
            for n, t in init_draft_weights(dcfg, opts.seed).items()}


def optimizer_for(params: dict, opts: DraftTrainOptions) -> torch.optim.Optimizer:
    decay = [p for n, p in params.items() if p.ndim >= 2 and "base_kernel" not in n]
    rest = [p for n, p in params.items() if p.ndim < 2 or "base_kernel" in n]
    return torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=opts.lr,
                             betas=(0.9, 0.95), fused=opts.cuda)


class Trainer:
    """The drafter's parameters, optimizer and one step."""

    def __init__(self, target: Target, dcfg: DraftConfig, pool: SequencePool,
                 opts: DraftTrainOptions):
        from .layers import rope_inv_freq

        self.target, self.cfg, self.pool, self.opts = target, dcfg, pool, opts
        self.params = init_params(dcfg, opts)
        self.opt = optimizer_for(self.params, opts)
        self.inv_freq = rope_inv_freq(dcfg.head_dim, dcfg.rope_theta, opts.device)
        self.gen = torch.Generator().manual_seed(opts.seed + 1)
        self.batch = min(opts.pick(opts.batch_size, 64, 8), pool.tokens.shape[0])
        self.order, self.cursor, self.epoch = self._order(), 0, 0

    def _order(self) -> torch.Tensor:
        return torch.randperm(self.pool.tokens.shape[0], generator=self.gen)

    def next_batch(self) -> torch.Tensor:
        if self.cursor + self.batch > self.order.shape[0]:
            self.order, self.cursor, self.epoch = self._order(), 0, self.epoch + 1
        idx = self.order[self.cursor:self.cursor + self.batch]
        self.cursor += self.batch
        return idx

    def losses(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = self.pool.tokens[idx].to(self.opts.device)
        last = self.pool.last[idx].to(self.opts.device)
        states, logits = self.target.forward(tokens)
        blocks = sample_blocks(last, self.pool.prompt_len, self.opts.blocks_per_seq,
                               self.cfg.num_draft_tokens, self.gen)
        with _autocast(self.opts.device):
            h = block_states(self.params, self.cfg, self.target.embed_tokens, tokens, states,
                             blocks, self.inv_freq)
            return draft_loss(self.params, self.cfg, self.target.lm_head, h, tokens, logits,
                              blocks, self.opts.gamma)

    def step(self, lr: float) -> dict[str, torch.Tensor]:
        for g in self.opt.param_groups:
            g["lr"] = lr
        out = self.losses(self.next_batch())
        (out["unary"] + out["selector"]).backward()
        torch.nn.utils.clip_grad_norm_(list(self.params.values()), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {k: v.detach() for k, v in out.items()}


def _autocast(device: str):
    from contextlib import nullcontext

    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else nullcontext()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train_loop(tr: Trainer, budget_s: float, log) -> dict:
    opts = tr.opts
    total = opts.steps or 10 ** 9
    keys = ("unary", "selector", "accept")
    sums = {k: torch.zeros((), device=opts.device) for k in keys}  # on the device: no sync
    history, t0 = [], time.perf_counter()
    t_measure, step, seen, count = t0, 0, 0, 0
    while step < total:
        out = tr.step(lr_at(step, total, opts.lr, opts.warmup))
        step, seen, count = step + 1, seen + tr.batch, count + 1
        for k in keys:
            sums[k] += out[k].float()
        if step in MEASURE:
            _sync(opts.device)
            t_measure = time.perf_counter() if step == MEASURE[0] else t_measure
        if step == MEASURE[1] and opts.steps is None:
            per = (time.perf_counter() - t_measure) / (MEASURE[1] - MEASURE[0])
            total = max(step + 1, int(0.97 * (budget_s - (time.perf_counter() - t0)) / per) + step)
            log(f"{per * 1e3:.0f} ms/step: {total} steps fit {budget_s:.0f}s "
                f"(repeat this schedule with --steps {total})")
        out_of_time = opts.steps is None and time.perf_counter() - t0 > budget_s
        if step % opts.log_every == 0 or step == total or out_of_time:
            vals = {k: round(float(sums[k]) / count, 4) for k in keys}  # means since the last
            history.append({"step": step, **vals})
            count = 0
            for k in keys:
                sums[k].zero_()
            log(f"step {step}/{total if total < 10 ** 9 else '?'}  unary KL {vals['unary']:.4f}  "
                f"selector CE {vals['selector']:.4f}  teacher-forced accepted drafts "
                f"{vals['accept']:.2f}  epoch {tr.epoch}  elapsed {time.perf_counter() - t0:.1f}s")
        if out_of_time:
            log(f"stopping at step {step}: the training budget is spent")
            break
    _sync(opts.device)
    return {"steps": step, "planned_steps": total, "sequences_seen": seen, "epochs": tr.epoch,
            "train_seconds": round(time.perf_counter() - t0, 1), "history": history,
            "final": history[-1] if history else {}}


def heldout(target: Target, dcfg: DraftConfig, params: dict, held: dict,
            opts: DraftTrainOptions, log) -> dict:
    """Mean acceptance under greedy verification on held-out prompts, per kind and overall
    (the drafter in the inference dtype: BF16 on CUDA)."""
    from .model import DFlash2Drafter
    from .train_eval import speculative_greedy, summarize

    dtype = torch.bfloat16 if opts.cuda else torch.float32
    drafter = DFlash2Drafter(dcfg, {n: p.detach() for n, p in params.items()},
                             target.embed_tokens, target.lm_head, opts.device, dtype)
    new = opts.pick(opts.eval_tokens, 128, 64)
    out, merged = {}, {"steps": 0, "accepted": 0, "hist": [0] * dcfg.block_size}
    for kind, prompts in held.items():
        _, stats = speculative_greedy(target, drafter, prompts, new, batch=64)
        out[kind] = summarize(stats)
        for key in ("steps", "accepted"):
            merged[key] += stats[key]
        merged["hist"] = [a + b for a, b in zip(merged["hist"], stats["hist"])]
        log(f"held-out {kind}: {prompts.shape[0]} prompts x {new} tokens, mean acceptance "
            f"length {out[kind]['mean_acceptance_length']:.3f} ({out[kind]['steps']} steps)")
    out["all"] = summarize(merged)
    out.update(prompts={k: int(v.shape[0]) for k, v in held.items()}, new_tokens=new,
               prompt_len=opts.prompt_len, verification="greedy, transformers' target",
               drafter_dtype=str(dtype).replace("torch.", ""))
    return out


def train_draft(opts: DraftTrainOptions, echo: Callable[[str], None] = print) -> dict:
    """The whole pipeline; writes OUT_DIR/{config.json, model.safetensors, RUN.json,
    train_log.txt} and returns the RUN.json dict."""
    from ..config import BeamConfig
    from ..tokenizer import PAD, TextTokenizer
    from ..train.train import Log
    from .weights import save_draft

    t_start = time.perf_counter()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    log = Log(opts.out_dir / "train_log.txt", echo)
    torch.manual_seed(opts.seed)
    cfg = BeamConfig.from_hf(opts.target)
    dcfg = default_draft_config(cfg, TextTokenizer(opts.target).token_id(PAD), opts.num_layers)
    dcfg.check_target(cfg)
    target = Target(opts.target, dcfg.target_layer_ids, opts.device)
    log(f"target {opts.target} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}) on "
        f"{_device_name(opts.device)}; drafter: {dcfg.num_hidden_layers} layers, block "
        f"{dcfg.block_size}, target layers {list(dcfg.target_layer_ids)}, conv K="
        f"{dcfg.conv_kernel_size} g={dcfg.conv_group_size}, selector r={dcfg.selector_rank} "
        f"k={dcfg.selector_top_k}, window {dcfg.sliding_window}, mask id {dcfg.mask_token_id}")
    train_prompts, held = corpus_prompts(target, opts, log)
    t_budget = time.perf_counter()
    deadline = None if opts.sequences else t_budget + opts.gen_fraction * opts.seconds
    pool = build_pool(target, train_prompts[:opts.sequences], opts.gen_tokens,
                      opts.pick(None, 1024, 32), deadline, log)
    gen_seconds = time.perf_counter() - t_budget
    trainer = Trainer(target, dcfg, pool, opts)
    n_params = sum(p.numel() for p in trainer.params.values())
    log(f"pool: {pool.tokens.shape[0]} sequences of {pool.tokens.shape[1]} tokens in "
        f"{gen_seconds:.1f}s; drafter {n_params:,} parameters; {trainer.batch} sequences x "
        f"{opts.blocks_per_seq} blocks a step")
    stats = train_loop(trainer, opts.seconds - gen_seconds, log)
    acceptance = heldout(target, dcfg, trainer.params, held, opts, log)
    sha = save_draft(opts.out_dir, dcfg, trainer.params)
    check_written(opts.out_dir, target)
    run = run_record(opts, dcfg, pool, stats, acceptance, sha, n_params, gen_seconds,
                     time.perf_counter() - t_start)
    (opts.out_dir / "RUN.json").write_text(json.dumps(run, indent=2) + "\n")
    log(f"wrote {opts.out_dir} (model.safetensors SHA-256 {sha[:16]}...); held-out mean "
        f"acceptance length {acceptance['all']['mean_acceptance_length']:.3f}")
    return run


def check_written(out_dir: Path, target: Target) -> None:
    """The dir reads back through the strict loader, against the target."""
    from .model import DFlash2Drafter

    DFlash2Drafter.from_dir(out_dir, target.cfg, target.embed_tokens, target.lm_head, "cpu",
                            torch.float32)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def run_record(opts, dcfg, pool, stats, acceptance, sha, n_params, gen_seconds,
               total_seconds) -> dict:
    import platform

    import transformers

    n = dcfg.num_draft_tokens
    seq_len = pool.tokens.shape[1]
    return {
        "what": "a DFlash2BeamDraftModel drafter trained by beam_trtllm/draft/train.py on the "
                "target's greedy continuations of corpus windows and its next-token "
                "distributions",
        "command": " ".join(opts.command), "date": time.strftime("%Y-%m-%d"),
        "machine": f"{_device_name(opts.device)}, torch {torch.__version__}, Python "
                   f"{platform.python_version()}, transformers {transformers.__version__}, "
                   f"{torch.get_num_threads()} CPU threads",
        "target": str(opts.target), "seed": opts.seed, "params": n_params,
        "steps": stats["steps"], "epochs": stats["epochs"],
        "sequences_generated": int(pool.tokens.shape[0]),
        "tokens_generated": int((pool.last - pool.prompt_len + 1).clamp(min=0).sum()),
        "target_tokens_forwarded": stats["sequences_seen"] * seq_len,
        "label_rows": stats["sequences_seen"] * opts.blocks_per_seq * n,
        "generation_seconds": round(gen_seconds, 1), "train_seconds": stats["train_seconds"],
        "total_seconds": round(total_seconds, 1), "final_losses": stats["final"],
        "heldout_acceptance": acceptance, "loss_history": stats["history"],
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()
                    if k != "command"},
        "model_safetensors_sha256": sha,
    }
