"""Grammar-constrained decode throughput against unconstrained, at batch 1 and 32.

    python bench/grammar_bench.py --engine-dir DIR [--batch 1 32] [--tokens 64] [--device cuda]
    python bench/grammar_bench.py --smoke        # tiny Beam on the CPU, a few tokens
    python bench/grammar_bench.py --smoke --vocab 151936 --batch 32 --phases
    python bench/grammar_bench.py --write-checkpoint DIR --vocab 151936   # for beam-trt build
    PYTHONPATH=.:bench python bench/grammar_bench.py --bench-model fp8 --batch 1 32   # H200

Each batch runs the same chat prompt twice through the engine: unconstrained (ignore_eos) and
under Beam's turn grammar with an answer body of free text (reasoning off), so both decode the
same number of tokens; the table gives tokens/s and the constrained run's slowdown (the
ceiling: the same engine unconstrained). --phases adds the host time per decode step of the
engine's parts in both runs (the forward's launch, the sampling rows with their grammar masks
and accepted tokens, the whole step). --vocab builds the tiny Beam with a tokenizer of that
many tokens (Beam's is 151936; the tiny one's 512), trained on the bundled corpus plus
made-up words. --bench-model runs engine_bench's full-width 4-layer canonical Beam instead
(random weights of that format, CUDA graphs), whose decode step the GPU bounds as Beam's
does; the tiny Beam's step on an H200 is host time. About 3 minutes on the 2-core CPU box
with the defaults (64 tokens, best of 3), under a minute on an H200; --smoke with a few
tokens, seconds.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

PHASES = ("_forward", "_sample_rows", "_grammar_masks", "_accept_rows", "_token_output")


def _made_up_corpus(vocab: int) -> list[str]:
    """The bundled corpus plus enough distinct made-up words for a BPE of `vocab` tokens."""
    from beam_trtllm.tokenizer import corpus_text

    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + list("aeiou")
    words: set[str] = set()
    while len(words) < int(vocab * 1.3):
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(2, 5))))
    ordered = sorted(words)
    return corpus_text().splitlines(keepends=True) + [
        " ".join(ordered[i:i + 12]) + ".\n" for i in range(0, len(ordered), 12)]


def _tiny_checkpoint(out: Path, vocab: int | None) -> Path:
    """init_tiny's checkpoint, with a tokenizer of `vocab` tokens when given."""
    from beam_trtllm.config import PRESETS
    from beam_trtllm.tiny import init_tiny

    if vocab is None:
        return init_tiny(out, seed=0)
    return init_tiny(out, seed=0, cfg=PRESETS["tiny"].replace(vocab_size=vocab),
                     corpus_lines=_made_up_corpus(vocab))


def _bench_model_engine(fmt: str, batches: list[int], device: str | None, smoke: bool):
    """engine_bench's canonical Beam (full width, 4 layers, random `fmt` weights) with CUDA
    graphs of `batches` and a tokenizer of its 151936 tokens: a decode step the GPU bounds,
    as at Beam's size, where the tiny Beam's step is host-bound (its GPU time a fraction of
    the host's). smoke: engine_bench's narrow config instead (the code path, on the CPU)."""
    import torch
    from _engine_model import bench_config, make_engine

    from beam_trtllm.engine.graphs import DecodeGraphs
    from beam_trtllm.tokenizer import EOS_TOKENS, TextTokenizer, write_tokenizer_files

    cfg = bench_config(smoke)
    tok_dir = Path(tempfile.mkdtemp(prefix="grammar-bench-tokenizer-"))
    t0 = time.perf_counter()
    ids = write_tokenizer_files(tok_dir, cfg.vocab_size, 4096, _made_up_corpus(cfg.vocab_size))
    print(f"tokenizer of {cfg.vocab_size} tokens trained in {time.perf_counter() - t0:.0f} s",
          flush=True)
    dev = torch.device(device or ("cpu" if smoke else "cuda"))
    engine = make_engine(cfg, fmt, dev, max_num_tokens=4096)
    engine.tokenizer = TextTokenizer(tok_dir)
    engine.eos_token_ids = frozenset(ids[t] for t in EOS_TOKENS)
    if dev.type == "cuda":
        engine.graphs = DecodeGraphs(engine.model, engine.options, engine.kv_plan, engine.cfg,
                                     dev, sizes=tuple(sorted(set(batches))))
    return engine


def _engine(args):
    from beam_trtllm.engine.engine import Engine

    if args.bench_model:
        return _bench_model_engine(args.bench_model, args.batch, args.device, args.smoke)

    if args.smoke and args.engine_dir is None:
        from beam_trtllm.engine.build import build_engine
        from beam_trtllm.engine.plan import BuildOptions

        tmp = Path(tempfile.mkdtemp(prefix="grammar-bench-"))
        ckpt = _tiny_checkpoint(tmp / "tiny", args.vocab)
        args.engine_dir = build_engine(ckpt, tmp / "engine", BuildOptions(
            max_batch=max(args.batch), max_seq_len=256, max_num_tokens=512))
    return Engine.from_dir(args.engine_dir, device=args.device)


class PhaseTimer:
    """Host seconds spent in the engine's methods `PHASES` (those it has) and in whole steps,
    by wrapping them on the instance; `take()` returns them per step and starts over."""

    def __init__(self, engine):
        self.spent: dict[str, float] = defaultdict(float)
        self.steps = 0
        for name in ("step",) + PHASES:
            if hasattr(engine, name):
                setattr(engine, name, self._timed(name, getattr(engine, name)))

    def _timed(self, name, method):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return method(*a, **kw)
            finally:
                self.spent[name] += time.perf_counter() - t0
                self.steps += name == "step"
        return timed

    def take(self, steps: int | None = None) -> dict[str, float]:
        """ms per step (per `steps` when given, else per `step` call timed)."""
        n = steps if steps is not None else max(self.steps, 1)
        per_step = {k: 1e3 * v / n for k, v in self.spent.items()}
        self.spent, self.steps = defaultdict(float), 0
        return per_step


def _rate(engine, prompt, batch, tokens, tag, timer=None) -> tuple[float, dict]:
    from beam_trtllm.engine.types import SamplingParams

    p = SamplingParams(max_tokens=tokens, ignore_eos=True, structural_tag=tag)
    engine.generate([prompt] * batch, SamplingParams(max_tokens=2, ignore_eos=True,
                                                     structural_tag=tag))  # warm-up, compile
    if timer is not None:
        timer.take()
    t0 = time.perf_counter()
    outs = engine.generate([prompt] * batch, p)
    dt = time.perf_counter() - t0
    return sum(len(o["token_ids"]) for o in outs) / dt, (timer.take() if timer else {})


def _sampling_only(engine, prompt, batch, tag, steps, timer) -> dict:
    """Host ms per step of the engine's sampling part alone (`_sample_rows`: masks, sampling,
    accepted tokens, outputs) for `batch` running requests, fed fixed random logits instead of
    forwards: the parts' costs without the forward's noise (nor the overlap with it)."""
    import torch

    from beam_trtllm.engine.types import SamplingParams

    p = SamplingParams(max_tokens=steps + 8, ignore_eos=True, structural_tag=tag)
    ids = [f"sampling-{tag is not None}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, prompt, p)
    while any(not engine.requests[r].output_ids for r in ids):
        engine.step()  # prefill: each has sampled its first token
    reqs = [engine.requests[r] for r in ids]
    g = torch.Generator(device=engine.device).manual_seed(0)
    logits = [torch.randn(batch, engine.cfg.vocab_size, generator=g, device=engine.device)
              for _ in range(4)]
    sampled = [(r, b) for b, r in enumerate(reqs)]
    timer.take()
    with torch.inference_mode():  # as Engine.step
        for i in range(steps):
            engine._sample_rows(sampled, logits[i % 4].clone())
    for rid in ids:
        engine.abort(rid)
    phases = timer.take(steps)
    phases["step"] = phases.pop("_sample_rows")
    return phases


def _phase_rows(b: int, phases: dict[str, dict], title: str = "") -> list[str]:
    names = ["step"] + [n for n in PHASES if any(n in p for p in phases.values())]
    rows = []
    for run, p in phases.items():
        rows.append(f"| {b} | {run} | " + " | ".join(f"{p.get(n, 0.0):.3f}" for n in names) + " |")
    return ["", title or "host ms per step (median run of --repeats)",
            "| batch | run | " + " | ".join(names) + " |",
            "| ---: | --- |" + " ---: |" * len(names)] + rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", type=Path, default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bench-model", default=None, choices=("bf16", "fp8", "nvfp4"),
                    help="instead of an engine dir: engine_bench's full-width 4-layer Beam with "
                         "these random weights (GPU), a step the GPU bounds")
    ap.add_argument("--smoke", action="store_true", help="build the tiny Beam and run on the CPU")
    ap.add_argument("--vocab", type=int, default=None,
                    help="--smoke: the tiny Beam's vocabulary size (Beam's: 151936)")
    ap.add_argument("--write-checkpoint", type=Path, default=None, metavar="DIR",
                    help="write the tiny Beam (of --vocab tokens) to DIR and exit")
    ap.add_argument("--phases", action="store_true",
                    help="host time per step of the engine's parts")
    ap.add_argument("--sampling-only", type=int, default=0, metavar="STEPS",
                    help="also time STEPS sampling steps alone (fixed random logits, no forward)")
    args = ap.parse_args(argv)
    if args.write_checkpoint is not None:
        print(f"wrote {_tiny_checkpoint(args.write_checkpoint, args.vocab)}")
        return
    if args.smoke:
        args.device = args.device or "cpu"
    if args.engine_dir is None and not args.smoke and not args.bench_model:
        ap.error("--engine-dir is required (or --smoke, or --bench-model)")
    from beam_trtllm.chat.grammar import turn_structural_tag

    engine = _engine(args)
    timer = PhaseTimer(engine) if args.phases else None
    prompt = engine.tokenizer.chat_ids([{"role": "user", "content": "Write a haiku."}])
    tag = turn_structural_tag({}, None, {"type": "text"}, False)
    print(f"engine {args.engine_dir or args.bench_model}  device {engine.device}  "
          f"vocab {engine.cfg.vocab_size}  {args.tokens} tokens per sequence")
    print("| batch | unconstrained tok/s | grammar tok/s | slowdown |")
    print("| ---: | ---: | ---: | ---: |")
    notes = []
    for b in args.batch:
        # interleaved, best of --repeats each: a shared CPU's noise and first-run costs
        free = held = 0.0
        runs = {"unconstrained": [], "grammar": []}
        for _ in range(args.repeats):
            rate, phases = _rate(engine, prompt, b, args.tokens, None, timer)
            free, _ = max(free, rate), runs["unconstrained"].append((rate, phases))
            rate, phases = _rate(engine, prompt, b, args.tokens, tag, timer)
            held, _ = max(held, rate), runs["grammar"].append((rate, phases))
        print(f"| {b} | {free:.1f} | {held:.1f} | {100 * (free / held - 1):+.1f}% |", flush=True)
        if timer is not None:
            median = {k: sorted(v, key=lambda r: r[0])[len(v) // 2][1] for k, v in runs.items()}
            notes += _phase_rows(b, median, "decode, host ms per step (run of median tok/s)")
    if args.sampling_only:
        timer = timer or PhaseTimer(engine)
        for b in args.batch:
            best = {}
            for _ in range(args.repeats):
                for run, tag_ in (("unconstrained", None), ("grammar", tag)):
                    got = _sampling_only(engine, prompt, b, tag_, args.sampling_only, timer)
                    if run not in best or got["step"] < best[run]["step"]:
                        best[run] = got
            notes += _phase_rows(b, best, "sampling alone, host ms per step (best of --repeats): "
                                         "step = _sample_rows")
    if notes:
        print("\n".join(notes))


if __name__ == "__main__":
    sys.exit(main())
