"""What the trained tiny Beam is judged by: next-token loss on held-out rows, and greedy answers
to a coding request (does the code in the answer parse?) and to a request that needs a tool (is
there a call whose arguments validate against the tool's schema?), read with Beam's response
parser."""

from __future__ import annotations

import ast
import math
import re
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from ..chat.parser import parse_text
from ..chat.tools import tool_schemas
from .data import IGNORE
from .dialogues import TOOLS

CODE_PROMPT = "Write a function that adds two numbers."
TOOL_PROMPT = "What's the weather in Paris in celsius?"
_FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.S)


def autocast(device: str):
    """BF16 autocast on CUDA (FP32 master weights), nothing on the CPU (FP32 throughout)."""
    if device == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def token_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE, reduction=reduction)


@torch.no_grad()
def heldout_loss(model, rows: tuple[torch.Tensor, torch.Tensor], device: str,
                 batch_size: int, amp: bool = True) -> dict:
    """Mean next-token loss (nats) and perplexity over the rows' target tokens."""
    was_training = model.training
    model.eval()
    inputs, labels = rows
    total, count = 0.0, 0
    for i in range(0, inputs.shape[0], batch_size):
        x = inputs[i:i + batch_size].to(device)
        y = labels[i:i + batch_size].to(device)
        with autocast(device) if amp else nullcontext():
            logits = model(input_ids=x, use_cache=False).logits
        total += float(token_loss(logits, y, "sum"))
        count += int((y != IGNORE).sum())
    model.train(was_training)
    loss = total / max(count, 1)
    return {"loss": round(loss, 4), "perplexity": round(math.exp(min(loss, 50.0)), 3),
            "tokens": count}


def greedy_answer(model, tok, messages: list[dict], tools: list[dict] | None, device: str,
                  max_new_tokens: int) -> str:
    """The model's turn after the chat prompt, greedy, special tokens kept (parser input)."""
    from ..hf_model import stream
    from ..tokenizer import EOS_TOKENS

    ids = tok.chat_ids(messages, tools=tools)
    eos = [tok.token_id(t) for t in EOS_TOKENS]
    was_training = model.training
    model.eval()
    out = [int(t[0]) for t in stream(model, torch.tensor([ids], device=device), max_new_tokens,
                                     eos_token_id=eos)]
    model.train(was_training)
    return tok.decode(out, skip_special_tokens=False)


def code_check(model, tok, device: str, max_new_tokens: int = 160) -> dict:
    text = greedy_answer(model, tok, [{"role": "user", "content": CODE_PROMPT}], None, device,
                         max_new_tokens)
    msg = parse_text(text)
    blocks = _FENCE.findall(msg["content"] or "")
    parses = False
    if blocks:
        try:
            ast.parse(blocks[0])
            parses = bool(blocks[0].strip())
        except SyntaxError:
            parses = False
    return {"prompt": CODE_PROMPT, "reasoning": msg["reasoning"], "content": msg["content"],
            "code_parses": parses}


def tool_check(model, tok, device: str, max_new_tokens: int = 96) -> dict:
    tools = [TOOLS["get_weather"], TOOLS["add"]]
    text = greedy_answer(model, tok, [{"role": "user", "content": TOOL_PROMPT}], tools, device,
                         max_new_tokens)
    msg = parse_text(text, tool_schemas(tools))
    calls = [{"name": c.name, "arguments": c.arguments} for c in msg["tool_calls"]]
    return {"prompt": TOOL_PROMPT, "reasoning": msg["reasoning"], "content": msg["content"],
            "tool_calls": calls, "arguments_valid": bool(calls) and all(
                _valid(c["name"], c["arguments"]) for c in calls)}


def _valid(name: str, args: dict) -> bool:
    """Arguments against the tool's schema: required keys present, no others, types, enums."""
    schema = TOOLS.get(name, {}).get("function", {}).get("parameters")
    if schema is None:
        return False
    props = schema["properties"]
    if set(schema.get("required", [])) - set(args) or set(args) - set(props):
        return False
    py = {"string": str, "integer": int, "number": (int, float), "boolean": bool}
    for key, value in args.items():
        prop = props[key]
        if isinstance(value, bool) and prop["type"] != "boolean":
            return False
        if not isinstance(value, py[prop["type"]]) or value not in prop.get("enum", [value]):
            return False
    return True
