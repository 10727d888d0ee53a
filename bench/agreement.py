"""Greedy agreement of the trained tiny Beam: the engines (BF16, FP8, NVFP4) against
transformers' BeamForCausalLM, token for token, on 20 fixed prompts.

    python bench/agreement.py [--device cpu|cuda] [--out DIR]       # writes agreement.json/.md
    python bench/agreement.py --compare CPU.json CUDA.json [--out DIR]  # two runs, token for token
    python bench/agreement.py --smoke                               # 2 prompts x 8 tokens, CPU

The prompts (bench/_trained.py): coding requests and tool requests through the chat template,
and code prefixes as plain text. The reference is transformers' model of the BF16 checkpoint
in FP32 on the CPU (the oracle, the same on every machine), greedy, with its KV cache. The
engines are `beam-trt build`s of the trained tiny (`init-tiny --trained`) and of its
`beam-trt convert --quant fp8` / `nvfp4` checkpoints (shipped calibration set, CPU), built for
the CPU (the ops' torch references) or for `--target` (default sm90) and run on the GPU with
CUDA graphs for the decode steps; all prompts decode as one batch. Each generates the first
`--tokens` (64) tokens (ignore_eos). Per engine: how many prompts agree with the reference
over all 64 tokens, and per prompt the first diverging index, with the reference's margin there
(its log-probability of its own token minus that of the engine's): a margin under 0.1 nats is
a near-tie that BF16 rounding flips (the BF16 LM head resolves logits of ~10 to 0.06); for
the BF16 engine a large one is a defect, while the quantized engines run other weights and
part from the reference wherever quantization moves a choice. On the CPU an FP32 engine of the
BF16 checkpoint runs too: the same ops without BF16 rounding. --compare puts two runs (CPU
and CUDA) side by side: the same engine on both devices, token for token, and whether they
converted the same checkpoint bytes. About 70 s on the 2-core CPU box (20 x 64 tokens
through transformers and 4 engines, one thread), expected under 3 minutes on an H200 (most
of it Triton compiling the kernels); --smoke about 15 s.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _trained as T  # noqa: E402
from _common import environment  # noqa: E402

ENGINES = ("bf16", "fp8", "nvfp4")  # checkpoints: the trained tiny and two conversions


# ----------------------------------------------------------------------------- generation
@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation with its KV cache (argmax of the FP32 logits)."""
    from transformers import DynamicCache

    cache, feed, out = DynamicCache(config=model.config), torch.tensor([ids]), []
    for _ in range(n):
        logits = model(input_ids=feed, cache=cache, use_cache=True).logits[0, -1]
        out.append(int(logits.float().argmax()))
        feed = torch.tensor([[out[-1]]])
    return out


@torch.inference_mode()
def hf_margin(model, ids: list[int], want: int, got: int) -> float:
    """The reference's log-probability of `want` minus that of `got` after `ids`."""
    lp = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float().log_softmax(-1)
    return float(lp[want] - lp[got])


def engine_greedy(engine_path: Path, prompts: list[list[int]], n: int, device: str) -> dict:
    """All prompts as one batch through the engine: tokens, seconds, decode steps in graphs."""
    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.types import SamplingParams

    engine = Engine.from_dir(engine_path, device=device)
    t0 = time.perf_counter()
    results = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    if device == "cuda":
        torch.cuda.synchronize()
    return {"tokens": [r["token_ids"] for r in results],
            "seconds": round(time.perf_counter() - t0, 2), "steps": engine.stats["steps"],
            "graph_steps": engine.stats["graph_steps"]}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


# ----------------------------------------------------------------------------- one run
def prepare(work: Path, target: str, batch: int, log) -> dict:
    """Checkpoints (BF16 and the two conversions) and their engines; sha256 of each weight."""
    ckpts = {"bf16": T.trained_checkpoint(work)}
    for recipe in ENGINES[1:]:
        log(f"convert --quant {recipe}")
        ckpts[recipe] = T.quantized_checkpoint(work, recipe, kv_fp8=False)
    # On the CPU also an FP32 engine of the BF16 checkpoint: the same ops without BF16
    # rounding, so its tokens are transformers' exactly and a BF16 divergence is rounding.
    builds = [("fp32", "bf16", "float32")] if target == "cpu" else []
    builds += [(name, name, "bfloat16") for name in ENGINES]
    engines = {}
    for name, ckpt, dtype in builds:
        log(f"build {name} --target {target} --dtype {dtype}")
        engines[name] = T.engine_dir(ckpts[ckpt], work, name, target, batch,
                                     graph_sizes=(batch,), dtype=dtype)
    sums = {name: hashlib.sha256(b"".join(p.read_bytes() for p in sorted(c.glob("*.safetensors"))))
            .hexdigest() for name, c in ckpts.items()}
    return {"checkpoints": ckpts, "engines": engines, "weights_sha256": sums}


def run(args, log) -> dict:
    from beam_trtllm.tokenizer import TextTokenizer

    target = args.target or ("sm90" if args.device == "cuda" else "cpu")
    prompts = T.PROMPTS[:2] if args.smoke else T.PROMPTS
    n = 8 if args.smoke else args.tokens
    made = prepare(args.work, target, len(prompts), log)
    tok = TextTokenizer(made["checkpoints"]["bf16"])
    ids = [T.prompt_ids(tok, p) for p in prompts]
    model = T.hf_model(made["checkpoints"]["bf16"])
    t0 = time.perf_counter()
    ref = []
    for i, p in enumerate(ids):
        ref.append(hf_greedy(model, p, n))
        log(f"transformers {i + 1}/{len(ids)}: {T.prompt_label(prompts[i])}")
    out = {"env": environment(), "device": args.device, "target": target, "tokens": n,
           "prompts": [{"label": T.prompt_label(p), "ids": i} for p, i in zip(prompts, ids)],
           "weights_sha256": made["weights_sha256"],
           "reference": {"tokens": ref, "seconds": round(time.perf_counter() - t0, 2)},
           "engines": {}}
    for name, path in made["engines"].items():
        log(f"engine {name} on {args.device}")
        res = engine_greedy(path, ids, n, args.device)
        res["first_divergence"], res["margin"] = [], []
        for p, want, got in zip(ids, ref, res["tokens"]):
            d = first_divergence(want, got)
            res["first_divergence"].append(d)
            res["margin"].append(None if d is None or d >= min(len(want), len(got)) else
                                 round(hf_margin(model, p + want[:d], want[d], got[d]), 4))
        res["agree"] = sum(d is None for d in res["first_divergence"])
        out["engines"][name] = res
    out["text"] = {"reference": [tok.decode(t, skip_special_tokens=False) for t in ref]}
    return out


# ----------------------------------------------------------------------------- tables
def _cell(d, margin) -> str:
    if d is None:
        return "="
    if margin is None:
        return f"{d}"
    tie = " tie" if margin < T.NEAR_TIE_NATS else ""
    return f"{d} ({margin:.3f}{tie})"


def table(run_: dict) -> str:
    names = list(run_["engines"])
    lines = [f"Greedy agreement with transformers' BeamForCausalLM (FP32, CPU), first "
             f"{run_['tokens']} tokens; engines on {run_['device']} (target {run_['target']}). "
             f"{run_['env']['date']}, commit {run_['env']['commit']}, {run_['env']['machine']}.",
             "", "Cell: `=` all tokens equal, else the first diverging index (the reference's "
             "margin there in nats; `tie` under 0.1).", "",
             "| # | prompt | " + " | ".join(names) + " |", "| ---: | --- |" + " --- |" * len(names)]
    for i, p in enumerate(run_["prompts"]):
        cells = [_cell(run_["engines"][e]["first_divergence"][i], run_["engines"][e]["margin"][i])
                 for e in names]
        lines.append(f"| {i + 1} | {p['label']} | " + " | ".join(cells) + " |")
    lines.append("| | **agree** | " + " | ".join(
        f"**{run_['engines'][e]['agree']}/{len(run_['prompts'])}**" for e in names) + " |")
    lines.append("| | decode steps in CUDA graphs | " + " | ".join(
        f"{run_['engines'][e]['graph_steps']}/{run_['engines'][e]['steps']}" for e in names) + " |")
    return "\n".join(lines) + "\n"


def compare(a: dict, b: dict) -> dict:
    """Two runs (e.g. CPU and CUDA), the same engine token for token, and the reference."""
    if [p["ids"] for p in a["prompts"]] != [p["ids"] for p in b["prompts"]]:
        raise SystemExit("--compare: the two runs have different prompts")
    rows = {"reference": [first_divergence(x, y) for x, y in
                          zip(a["reference"]["tokens"], b["reference"]["tokens"])]}
    for name in a["engines"]:
        if name in b["engines"]:
            rows[name] = [first_divergence(x, y) for x, y in
                          zip(a["engines"][name]["tokens"], b["engines"][name]["tokens"])]
    ckpt = {"reference": "bf16", "fp32": "bf16"}  # which checkpoint a row ran
    same = {n: a["weights_sha256"].get(ckpt.get(n, n)) == b["weights_sha256"].get(
        ckpt.get(n, n)) for n in rows}
    return {"a": f"{a['device']} ({a['env']['machine']})",
            "b": f"{b['device']} ({b['env']['machine']})", "first_divergence": rows,
            "agree": {n: sum(d is None for d in r) for n, r in rows.items()},
            "same_checkpoint_bytes": same, "labels": [p["label"] for p in a["prompts"]]}


def compare_table(c: dict) -> str:
    names = list(c["first_divergence"])
    lines = [f"{c['a']} against {c['b']}: first diverging token (`=`: all equal).", "",
             "| # | prompt | " + " | ".join(names) + " |", "| ---: | --- |" + " --- |" * len(names)]
    for i, label in enumerate(c["labels"]):
        cells = ["=" if c["first_divergence"][n][i] is None else str(c["first_divergence"][n][i])
                 for n in names]
        lines.append(f"| {i + 1} | {label} | " + " | ".join(cells) + " |")
    lines.append("| | **agree** | " + " | ".join(f"**{c['agree'][n]}/{len(c['labels'])}**"
                                               for n in names) + " |")
    lines.append("| | same checkpoint bytes | " + " | ".join(
        {True: "yes", False: "**no**"}.get(c["same_checkpoint_bytes"].get(n), "-") for n in names)
        + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = T.device_parser(__doc__)
    ap.add_argument("--target", choices=("cpu", "sm90", "sm100"), default=None,
                    help="engine build target (default: cpu on the CPU, sm90 on CUDA)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None,
                    help="where agreement.json/.md go (default out/agreement)")
    ap.add_argument("--work", type=Path, default=None, help="checkpoints and engines")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("A.json", "B.json"))
    ap.add_argument("--smoke", action="store_true", help="2 prompts x 8 tokens on the CPU")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="agreement-") as tmp:  # --smoke's, removed after
        out = args.out or (Path(tmp) if args.smoke else T.ROOT / "out" / "agreement")
        return _main(args, out)


def _main(args, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        c = compare(*(json.loads(p.read_text()) for p in args.compare))
        (out / "compare.json").write_text(json.dumps(c, indent=1))
        (out / "compare.md").write_text(compare_table(c))
        print(compare_table(c) + f"wrote {out}/compare.json and compare.md")
        return 0
    if args.smoke:
        args.device = "cuda" if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    # One host thread: the tiny model's ops are far too small to share out; two threads on a
    # busy 2-core box made transformers' decode 9x slower (150 against 16 ms a token).
    torch.set_num_threads(1)
    args.work = args.work or out / "work"
    t0 = time.perf_counter()
    result = run(args, lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}", flush=True))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "agreement.json").write_text(json.dumps(result))
    (out / "agreement.md").write_text(table(result))
    print(table(result) + f"wrote {out}/agreement.json and agreement.md ({result['seconds']} s)")
    if args.smoke:  # --compare's path too: a run against itself agrees everywhere
        c = compare(result, json.loads((out / "agreement.json").read_text()))
        print(compare_table(c))
        if set(c["agree"].values()) != {len(result["prompts"])}:
            raise SystemExit("--compare of a run with itself found a difference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
