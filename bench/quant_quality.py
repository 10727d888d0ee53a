"""Quantization quality of the trained tiny Beam: KL and top-1 agreement of every recipe
against BF16 on held-out text, for the weights alone and through the engine.

    python bench/quant_quality.py [--device cpu|cuda] [--out DIR]   # quant_quality.json/.md
    python bench/quant_quality.py --smoke                           # fp8 only, a few windows

Recipes fp8, fp8-block, nvfp4, nvfp4-all (`beam-trt convert`, shipped calibration set), each
without and with `--kv-cache fp8`, plus BF16 weights with an FP8 KV cache alone
(bench/data/bf16.yaml). Two measurements, each against its BF16 ceiling:
- weights: transformers' BeamForCausalLM (FP32, CPU) on the decoded weights against the same
  model on the BF16 weights: what `beam-trt verify --against` computes (there on 4 x 64
  tokens of its own held-out set), independent of the KV cache and of activation scales;
- engine: the engine built from the checkpoint (CPU: the ops' references; CUDA: the kernels)
  against the BF16 engine with a BF16 KV cache, teacher-forced on the same text: weights,
  activations (FP8 W8A8, 128-block FP8 per token) and the FP8 KV cache as the engine runs them.
Text: the trained tiny's own held-out data (bench/_trained.py): windows of the held-out
standard library files, and held-out dialogues scored on the assistant's turn. Per row: mean
KL(BF16 || quantized) in nats per token, top-1 agreement, and top-1 agreement outside the
reference's near-ties (top two within 0.1 nats, `near_ties` of the positions). The noise floor
row is the BF16 engine against transformers in FP32 on the same weights (BF16 rounding alone).
Targets (issue #28): FP8 KL <= 0.01 and top-1 >= 97 %, NVFP4 KL <= 0.05 and top-1 >= 90 %.
About 4 minutes on the 2-core CPU box (9 conversions, 10 engines, one thread); --smoke about
20 s.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _trained as T  # noqa: E402
from _common import environment  # noqa: E402

RECIPES = ("fp8", "fp8-block", "nvfp4", "nvfp4-all")
TARGETS = {"fp8": (0.01, 0.97), "nvfp4": (0.05, 0.90)}  # recipe family -> (KL max, top-1 min)


def family(recipe: str) -> str | None:
    return "fp8" if recipe.startswith("fp8") else "nvfp4" if recipe.startswith("nvfp4") else None


def text_sets(tok, args) -> dict[str, tuple[list[list[int]], list[int]]]:
    """name -> (token id lists, index of the first scored position in each)."""
    code = T.heldout_code_windows(tok, args.code_windows, args.window)
    chats = T.heldout_chats(tok, args.chats)
    return {"code": (code, [0] * len(code)),
            "chat": ([ids for ids, _ in chats], [start - 1 for _, start in chats])}


def scored(rows: list[torch.Tensor], texts) -> torch.Tensor:
    """The rows that predict scored tokens: every window position but the last; a chat's
    positions from the one before its first completion token to the one before its end."""
    ids, starts = texts
    return torch.cat([r[s:len(i) - 1] for r, i, s in zip(rows, ids, starts)])


def measure(ref: dict, got: dict) -> dict:
    return {name: T.kl_top1(ref[name], got[name]) for name in ref}


def weights_rows(args, sets, log) -> dict:
    """transformers on each recipe's decoded weights against the BF16 weights."""
    from beam_trtllm.config import BeamConfig

    ckpt = T.trained_checkpoint(args.work)
    cfg = BeamConfig.from_hf(ckpt)
    model = T.hf_model(ckpt)
    ref = {n: scored(T.hf_rows(model, s[0]), s) for n, s in sets.items()}
    out = {}
    for recipe in args.recipes:
        log(f"weights: {recipe}")
        q = T.dequantized_model(T.quantized_checkpoint(args.work, recipe, False), cfg)
        out[recipe] = measure(ref, {n: scored(T.hf_rows(q, s[0]), s) for n, s in sets.items()})
    return {"ref": ref, "rows": out}


def engine_logits(ckpt: Path, args, name: str, kv: str, sets) -> dict:
    from beam_trtllm.engine.engine import Engine

    target = "sm90" if args.device == "cuda" else "cpu"
    path = T.engine_dir(ckpt, args.work, name, target, 1, kv_dtype=kv)
    engine = Engine.from_dir(path, device=args.device)
    return {n: scored(T.engine_rows(engine, s[0]), s) for n, s in sets.items()}


def engine_rows(args, sets, hf_ref: dict, log) -> dict:
    """Each recipe's engine (BF16 and FP8 KV) against the BF16 engine with a BF16 KV cache."""
    ckpt = T.trained_checkpoint(args.work)
    log("engine: bf16 (the reference)")
    ref = engine_logits(ckpt, args, "bf16", "bf16", sets)
    out = {"noise floor: BF16 engine vs transformers FP32": measure(hf_ref, ref)}
    for recipe in (str(T.RECIPE_BF16), *args.recipes):
        for kv in ("bf16", "fp8"):
            if recipe == str(T.RECIPE_BF16) and kv == "bf16":
                continue
            label = Path(recipe).stem + (" + FP8 KV" if kv == "fp8" else "")
            log(f"engine: {label}")
            q = T.quantized_checkpoint(args.work, recipe, kv == "fp8")
            out[label] = measure(ref, engine_logits(q, args, label.replace(" + FP8 KV", "-kv"),
                                                    kv, sets))
    return out


def verdict(label: str, m: dict) -> str:
    fam = family(label.split()[0])
    if fam is None:
        return ""
    kl_max, top1_min = TARGETS[fam]
    misses = [f"{n} top-1" for n, r in m.items() if r["top1"] < top1_min] + \
        [f"{n} KL" for n, r in m.items() if r["kl"] > kl_max]
    return "meets" if not misses else "misses " + ", ".join(misses)


def table(result: dict) -> str:
    env = result["env"]
    lines = [f"{env['date']}, commit {env['commit']}{' (dirty)' if env['dirty'] else ''}, "
             f"{env['machine']}, engine on {result['device']}; held-out text: "
             f"{result['positions']['code']} code and {result['positions']['chat']} chat "
             "positions.", "",
             "| what | rows | code KL | code top-1 | code top-1 outside near-ties | chat KL | "
             "chat top-1 | targets |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for kind, rows in (("weights (verify's method)", result["weights"]),
                       ("engine", result["engine"])):
        for label, m in rows.items():
            c, h = m["code"], m["chat"]
            lines.append(f"| {kind} | {label} | {c['kl']:.4f} | {100 * c['top1']:.1f}% | "
                         f"{100 * c['top1_outside_near_ties']:.1f}% | {h['kl']:.4f} | "
                         f"{100 * h['top1']:.1f}% | {verdict(label, m)} |")
    near = result["near_ties"]
    lines += ["", f"Near-ties of the BF16 reference (top two within {T.NEAR_TIE_NATS} nats): "
              f"{100 * near['code']:.1f}% of code positions, {100 * near['chat']:.1f}% of chat "
              "positions."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = T.device_parser(__doc__)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES))
    ap.add_argument("--code-windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=256, help="tokens per code window")
    ap.add_argument("--chats", type=int, default=60, help="held-out dialogue examples")
    ap.add_argument("--out", type=Path, default=None, help="default out/quality")
    ap.add_argument("--work", type=Path, default=None, help="checkpoints and engines")
    ap.add_argument("--smoke", action="store_true", help="fp8 only, 2 windows of 32, 2 chats")
    args = ap.parse_args(argv)
    if args.smoke:
        args.recipes, args.code_windows, args.window, args.chats = ["fp8"], 2, 32, 2
    with tempfile.TemporaryDirectory(prefix="quant-quality-") as tmp:  # --smoke's, removed after
        args.out = args.out or (Path(tmp) if args.smoke else T.ROOT / "out" / "quality")
        args.work = args.work or args.out / "work"
        args.out.mkdir(parents=True, exist_ok=True)
        return run(args)


def run(args) -> int:
    torch.set_num_threads(1)  # the tiny model's ops are too small to share out (agreement.py)
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    from beam_trtllm.tokenizer import TextTokenizer

    sets = text_sets(TextTokenizer(T.trained_checkpoint(args.work)), args)
    weights = weights_rows(args, sets, log)
    result = {"env": environment(), "device": args.device, "weights": weights["rows"],
              "engine": engine_rows(args, sets, weights["ref"], log),
              "positions": {n: int(r.shape[0]) for n, r in weights["ref"].items()},
              "near_ties": {n: T.kl_top1(r, r)["near_ties"] for n, r in weights["ref"].items()},
              "targets": TARGETS, "seconds": round(time.perf_counter() - t0, 1)}
    (args.out / "quant_quality.json").write_text(json.dumps(result, indent=1))
    (args.out / "quant_quality.md").write_text(table(result))
    print(table(result) + f"wrote {args.out}/quant_quality.json and .md ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
