"""What bench/agreement.py and bench/quant_quality.py share: the trained tiny Beam
(`beam-trt init-tiny --trained`) and its quantized checkpoints and engines made in one work
dir, its held-out text, the 20 fixed agreement prompts, every row of an engine's logits for a
prompt, and KL / top-1 of two sets of logits.

Held-out text is the trained tiny's own (beam_trtllm/train/data.py): the standard library
files whose crc32(path) % 50 == 0, none of which it was trained on, and the dialogues of the
held-out seed (training seed 0 + 7919, as `gather_sources` makes them), scored on the
assistant's turn only (the tokens the model writes).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HELDOUT_DIALOGUE_SEED = 7919  # train.data.gather_sources: dialogues(n // 10, seed + 7919), seed 0
HELDOUT_DIALOGUES = 1200  # 12,000 training dialogues / 10
RECIPE_BF16 = ROOT / "bench" / "data" / "bf16.yaml"  # nothing quantized: BF16 + FP8 KV
# The reference's top two within this many nats: a near-tie, which BF16 rounding flips about
# half the time (the BF16 LM head resolves logits of magnitude ~10 to 2^-4 = 0.06).
NEAR_TIE_NATS = 0.1


# ----------------------------------------------------------------------------- the 20 prompts
def _chat(text: str, tools: tuple[str, ...] = (), system: str | None = None,
          history: list[dict] | None = None) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": text}] + (history or [])
    return {"kind": "chat", "messages": messages, "tools": list(tools)}


def _code(text: str) -> dict:
    return {"kind": "code", "text": text}


_WEATHER_CALL = [
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_0001", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_0001",
     "content": '{"city": "Oslo", "temperature": 4, "unit": "celsius", "condition": "snowy"}'}]

# Coding requests and tool requests in the chat template (the tools named are declared), and
# code prefixes in the standard library's style, fed as plain text. Fixed text, so that runs
# on different machines (another Python, another stdlib) see the same tokens.
PROMPTS: tuple[dict, ...] = (
    _chat("Write a function that adds two numbers."),
    _chat("Write a Python function that reverses a string."),
    _chat("Can you write a function that checks whether a number is prime?"),
    _chat("Implement a function that computes the factorial of a number."),
    _chat("I need a Python function that counts the vowels in a string."),
    _chat("Please write a function that merges two dictionaries."),
    _chat("Write a function that converts Celsius to Fahrenheit. Keep it short.",
          system="You are a helpful coding assistant."),
    _chat("Write a function that adds two numbers.", tools=("get_weather", "add", "search")),
    _chat("What's the weather in Paris in celsius?", tools=("get_weather", "add")),
    _chat("How warm is it in Tokyo? Use fahrenheit.", tools=("get_weather",)),
    _chat("What is 12 plus 30?", tools=("add", "get_weather")),
    _chat("Compute 7.5 + 2 with the add tool.", tools=("add",),
          system="You are a helpful assistant."),
    _chat("Search for python dataclasses, give me 3 results.", tools=("search", "add")),
    _chat("Is it cold in Oslo right now? Answer in celsius.", tools=("get_weather", "search"),
          history=_WEATHER_CALL),
    _code('"""Helpers for reading configuration files."""\n\nimport os\nimport sys\n\n\n'
          'def read_lines(path):\n    """Return the lines of the file at path."""\n'),
    _code("class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n"
          "        self._items = []\n\n    def push(self, item):\n"),
    _code("import unittest\n\n\nclass ParseTests(unittest.TestCase):\n\n"
          "    def test_empty_string(self):\n"),
    _code("def _split_header(line):\n    \"\"\"Split a 'Name: value' header line.\"\"\"\n"
          "    name, sep, value = line.partition(':')\n    if not sep:\n"),
    _code("    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, "),
    _code("try:\n    import threading\nexcept ImportError:\n"),
)


def prompt_ids(tok, prompt: dict) -> list[int]:
    """A prompt's token ids: a chat through the checkpoint's chat template (its tools from
    the training dialogues' definitions), code as plain text."""
    if prompt["kind"] == "code":
        return tok.encode_plain(prompt["text"])
    from beam_trtllm.train.dialogues import TOOLS

    tools = [TOOLS[n] for n in prompt["tools"]] or None
    return tok.chat_ids(prompt["messages"], tools=tools)


def prompt_label(prompt: dict) -> str:
    if prompt["kind"] == "code":
        return "code: " + prompt["text"].splitlines()[0][:48]
    user = [m for m in prompt["messages"] if m["role"] == "user"][0]["content"]
    return ("tool " if prompt["tools"] else "chat ") + user[:48]


# ----------------------------------------------------------------------------- held-out text
def heldout_code_windows(tok, windows: int, length: int) -> list[list[int]]:
    """`windows` windows of `length` tokens, evenly spaced over the held-out stdlib files of
    this Python, back to back with <|endoftext|> between them."""
    from beam_trtllm.train.data import is_heldout, read_source, stdlib_files, stdlib_root

    root, sep = stdlib_root(), tok.token_id("<|endoftext|>")
    stream: list[int] = []
    for rel in stdlib_files(root):
        text = read_source(root, rel) if is_heldout(rel) else None
        if text:
            stream += [sep] + tok.encode_plain(text)
    step = (len(stream) - length) // max(1, windows)
    if step < 1:
        raise ValueError(f"{root}: the held-out files give {len(stream)} tokens, fewer than "
                         f"{windows} windows of {length}")
    return [stream[i * step:i * step + length] for i in range(windows)]


def heldout_chats(tok, count: int) -> list[tuple[list[int], int]]:
    """The first `count` held-out dialogue examples: (ids of prompt + completion, index of
    the first completion token)."""
    from beam_trtllm.train.dialogues import dialogues

    out = []
    for ex in dialogues(HELDOUT_DIALOGUES, HELDOUT_DIALOGUE_SEED)[:count]:
        prompt = tok.prompt_tokenizer.encode_rendered(ex.prompt)
        completion = tok.prompt_tokenizer.encode_rendered(ex.completion)
        out.append((prompt + completion, len(prompt)))
    return out


# ----------------------------------------------------------------------------- models
def trained_checkpoint(work: Path) -> Path:
    from beam_trtllm.tiny import init_trained_tiny

    out = work / "bf16"
    if not (out / "model.safetensors").is_file():
        init_trained_tiny(out)
    return out


def quantized_checkpoint(work: Path, recipe: str, kv_fp8: bool, device: str = "cpu") -> Path:
    """`beam-trt convert` of the trained tiny with the shipped calibration set (made once)."""
    from convert import ConvertOptions, convert

    out = work / (Path(recipe).stem + ("-kv" if kv_fp8 else ""))
    if not (out / "manifest.json").is_file():
        convert(trained_checkpoint(work), out,
                ConvertOptions(quant=recipe, kv_cache="fp8" if kv_fp8 else "none", device=device,
                               overwrite=out.exists()))
    return out


def engine_dir(ckpt: Path, work: Path, name: str, target: str, max_batch: int,
               kv_dtype: str | None = None, graph_sizes: tuple[int, ...] = (),
               dtype: str = "bfloat16") -> Path:
    """`beam-trt build` into work/engines/name (rebuilt each run: the target may differ).
    No kernel search (`--autotune off`: the default launch shapes, chosen on the H200), so a
    GPU run spends its minutes on the comparison, not on tuning a model this small."""
    from beam_trtllm.engine.build import build_engine
    from beam_trtllm.engine.plan import BuildOptions

    opts = BuildOptions(target=target, max_batch=max_batch, max_seq_len=768,
                        max_num_tokens=max(768, max_batch), block_size=16, kv_dtype=kv_dtype,
                        cuda_graph_batch_sizes=graph_sizes if target != "cpu" else (),
                        autotune="off", dtype=dtype)
    return build_engine(ckpt, work / "engines" / name, opts, overwrite=True)


def hf_model(ckpt: Path):
    """transformers' BeamForCausalLM of the checkpoint in FP32 on the CPU: the oracle."""
    from beam_trtllm.hf_model import load_model

    return load_model(ckpt, torch.float32)


def dequantized_model(qdir: Path, cfg):
    """transformers' model (FP32) on a quantized checkpoint's decoded weights (`verify`'s)."""
    from beam_trtllm.checkpoint import expected_tensors
    from beam_trtllm.hf_model import model_from_state_dict
    from convert import dequant

    state = dequant(qdir)
    return model_from_state_dict(
        cfg, {n: state[n].to(d) for n, (_, d) in expected_tensors(cfg).items()}, torch.float32)


# ----------------------------------------------------------------------------- logits
def engine_rows(engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The engine's logits at every prompt position ([len(prompt), V] FP32 on the CPU), from
    its prefill: the engine samples only a chunk's last row, so the LM head is asked for every
    row of the same forward pass (the test suite's `all_logits` does the same)."""
    from beam_trtllm.engine.types import SamplingParams

    rows: list[torch.Tensor] = []
    sampled = engine.model.logits

    def every_row(x, s):
        every = torch.arange(x.shape[0], device=x.device)
        rows.append(sampled(x, dataclasses.replace(s, logits_rows=every)).cpu())
        return sampled(x, s)

    engine.model.logits = every_row
    out = []
    try:
        for ids in prompts:
            rows.clear()
            engine.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
            out.append(torch.cat(rows)[:len(ids)])
    finally:
        engine.model.logits = sampled
    return out


@torch.inference_mode()
def hf_rows(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    from beam_trtllm.hf_model import logits

    return [logits(model, torch.tensor([ids]))[0] for ids in prompts]


def kl_top1(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Mean KL(ref || got) in nats per position, top-1 agreement, and how many positions are
    near-ties of the reference (its top two within 0.1 nats), where any perturbation flips the
    choice about half the time."""
    lp, lq = ref.float().log_softmax(-1), got.float().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    agree = lp.argmax(-1) == lq.argmax(-1)
    top2 = lp.topk(2, -1).values
    tie = (top2[:, 0] - top2[:, 1]) < NEAR_TIE_NATS
    return {"positions": int(kl.numel()), "kl": float(kl.mean()),
            "top1": float(agree.float().mean()),
            "top1_outside_near_ties": float(agree[~tie].float().mean()) if (~tie).any() else 1.0,
            "near_ties": float(tie.float().mean())}


def device_parser(doc: str):
    """The argument parser both trained-tiny benchmarks start from: the module docstring's
    first paragraph as the description, the rest as the epilog, and --device."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0].replace("\n", " "),
                                 epilog=doc.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return ap
