"""`make demo`'s answers: the trained tiny Beam's greedy answer to a coding request from
transformers' model and from each engine (BF16, FP8, NVFP4), one after another, with a check
that the answer's Python parses (`ast.parse`) and where the quantized engines' tokens part
from the BF16 engine's.

    python -m dynamo_graphs.demo_answers --checkpoint out/demo/tiny \\
        bf16=out/demo/tiny-engine fp8=out/demo/tiny-fp8-engine nvfp4=out/demo/tiny-nvfp4-engine

The request carries a system prompt, as half of the model's training dialogues do: with the
bare user message the shipped 48-second model often opens its turn in the answer channel
(docs/TRAINING.md). Exits non-zero if an answer holds no Python that parses.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import time
from pathlib import Path

CODE_PROMPT = "Write a function that adds two numbers."
SYSTEM_PROMPT = "You are a helpful coding assistant."
MAX_TOKENS = 160
_FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.S)


def code_messages(prompt: str = CODE_PROMPT) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]


def python_of(content: str | None) -> str | None:
    """The first fenced code block of an answer if it is non-empty Python that parses, else
    None."""
    blocks = _FENCE.findall(content or "")
    if not blocks or not blocks[0].strip():
        return None
    try:
        ast.parse(blocks[0])
    except SyntaxError:
        return None
    return blocks[0]


def engine_answer(engine, messages: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
    """Greedy turn of an `Engine` for a chat: token ids, the parsed message, seconds."""
    from beam_trtllm.chat.parser import parse_text
    from beam_trtllm.engine.types import SamplingParams

    t0 = time.perf_counter()
    ids = engine.tokenizer.chat_ids(messages)
    out = engine.generate([ids], SamplingParams(max_tokens=max_tokens))[0]
    text = engine.tokenizer.decode(out["token_ids"], skip_special_tokens=False)
    return {"token_ids": out["token_ids"], **parse_text(text),
            "seconds": time.perf_counter() - t0}


def transformers_answer(checkpoint: Path, messages: list[dict],
                        max_tokens: int = MAX_TOKENS) -> dict:
    """The same turn from transformers' BeamForCausalLM (FP32, CPU) on the BF16 checkpoint."""
    import torch

    from beam_trtllm.chat.parser import parse_text
    from beam_trtllm.hf_model import load_model, stream
    from beam_trtllm.tokenizer import EOS_TOKENS, TextTokenizer

    t0 = time.perf_counter()
    tok = TextTokenizer(checkpoint)
    model = load_model(checkpoint)
    ids = tok.chat_ids(messages)
    eos = [tok.token_id(t) for t in EOS_TOKENS]
    out = [int(t[0]) for t in stream(model, torch.tensor([ids]), max_tokens, eos_token_id=eos)]
    return {"token_ids": out, **parse_text(tok.decode(out, skip_special_tokens=False)),
            "seconds": time.perf_counter() - t0}


def _versus(a: list[int], b: list[int]) -> str:
    d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if d is None and len(a) == len(b):
        return "same tokens"
    return f"parts at token {d if d is not None else min(len(a), len(b))}"


def show(name: str, answer: dict) -> None:
    print(f"\n== {name}: {len(answer['token_ids'])} tokens, {answer['seconds']:.1f} s")
    print(f"reasoning: {answer['reasoning']}")
    print(f"answer:\n{answer['content']}")


def summary(answers: dict[str, dict], base: str) -> bool:
    """The answers side by side: tokens, whether the Python parses, tokens against `base`'s.
    True if every answer's Python parses."""
    width = max(len(n) for n in answers)
    print(f"\ndemo: the answers side by side\n  {'':{width}}  tokens  Python parses    "
          f"vs the {base}")
    ok = True
    for name, answer in answers.items():
        parses = python_of(answer["content"]) is not None
        ok &= parses
        versus = "-" if name == base else _versus(answers[base]["token_ids"], answer["token_ids"])
        print(f"  {name:{width}}  {len(answer['token_ids']):6d}  "
              f"{'yes (ast.parse)' if parses else 'NO':15s}  {versus}")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engines", nargs="+", metavar="NAME=ENGINE_DIR")
    p.add_argument("--checkpoint", type=Path, help="also answer with transformers' model")
    p.add_argument("--prompt", default=CODE_PROMPT)
    args = p.parse_args(argv)
    specs = [spec.partition("=")[::2] for spec in args.engines]
    if any(not path for _, path in specs):
        p.error("give engines as NAME=ENGINE_DIR")
    import torch

    from beam_trtllm.engine.engine import Engine

    torch.set_num_threads(1)  # a model this small loses more to thread hand-offs than it gains
    messages = code_messages(args.prompt)
    print(f"demo: system: {SYSTEM_PROMPT!r}  user: {args.prompt!r}  (greedy, up to "
          f"{MAX_TOKENS} tokens)")
    answers = {}
    if args.checkpoint:
        answers["transformers (FP32)"] = transformers_answer(args.checkpoint, messages)
        show("transformers' BeamForCausalLM, FP32, on the BF16 checkpoint",
             answers["transformers (FP32)"])
    for name, path in specs:
        answers[f"{name} engine"] = engine_answer(Engine.from_dir(path, device="cpu"), messages)
        show(f"{name} engine ({path})", answers[f"{name} engine"])
    return 0 if summary(answers, f"{specs[0][0]} engine") else 1


if __name__ == "__main__":
    sys.exit(main())
