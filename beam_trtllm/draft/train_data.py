"""What the drafter trains on: the target's own outputs (docs/SPECULATIVE.md "Training the
drafter").

- `Target`: transformers' BeamForCausalLM of the target dir, with forward hooks on its decoder
  layers at `target_layer_ids` (a layer's output is the post-layer residual stream before the
  final norm: what vLLM / SGLang capture; `output_hidden_states` would give the last layer
  after the norm).
- Prompts: fixed-length windows of the training corpus of beam_trtllm/train/data.py (code at
  random points, dialogues ending where the assistant's answer starts), held-out ones from its
  held-out rows.
- Sequences: each prompt continued greedily by the target. Under greedy verification a draft
  is accepted iff it is the target's greedy token after the target's greedy prefix, so the
  drafter trains on exactly the contexts it drafts in; the target's full next-token
  distributions along them (a forward per training step) are the soft labels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..train.data import IGNORE


class Target:
    """The target model, its tokenizer and its capture hooks."""

    def __init__(self, target_dir: Path, layer_ids: tuple[int, ...], device: str):
        from ..config import BeamConfig
        from ..hf_model import load_model
        from ..tokenizer import TextTokenizer

        self.dir, self.device, self.layer_ids = Path(target_dir), device, tuple(layer_ids)
        self.cfg = BeamConfig.from_hf(self.dir)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.model = load_model(self.dir, dtype, attn_implementation="sdpa").to(device)
        self.model.set_experts_implementation("grouped_mm")
        self.tok = TextTokenizer(self.dir)
        self.dtype = dtype
        self.eos = torch.tensor(list(self.cfg.eos_token_id or []), dtype=torch.long,
                                device=device)
        self._captured: dict[int, torch.Tensor] = {}
        for i in self.layer_ids:
            self.model.model.layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def keep(module, args, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output
        return keep

    @property
    def embed_tokens(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight.detach()

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight.detach()

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] -> (states [B, T, n*H] at target_layer_ids, concatenated in that order;
        FP32 logits [B, T, V], softcapped as the model returns them)."""
        self._captured.clear()
        logits = self.model(input_ids=ids, use_cache=False).logits.float()
        states = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        self._captured.clear()
        return states, logits

    @torch.no_grad()
    def greedy(self, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """prompts [B, Lp] -> the target's greedy continuation [B, new_tokens] (its KV cache)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=prompts, cache=cache, use_cache=True)
        tokens = [out.logits[:, -1].argmax(-1)]
        for _ in range(new_tokens - 1):
            out = self.model(input_ids=tokens[-1][:, None], cache=cache, use_cache=True)
            tokens.append(out.logits[:, -1].argmax(-1))
        self._captured.clear()
        return torch.stack(tokens, dim=1)

    def first_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        """Index of each row's first stop token in tokens [B, G] (G where there is none)."""
        is_eos = torch.isin(tokens, self.eos)
        idx = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return torch.where(is_eos, idx, tokens.shape[1]).min(dim=1).values


def window_ends(inputs: torch.Tensor, labels: torch.Tensor, pad_id: int, length: int,
                answers: bool) -> torch.Tensor:
    """(row, end) pairs [P, 2] of windows inputs[row, end - length:end] free of padding that
    end where a prediction starts: with `answers`, where an assistant answer starts (the last
    prompt token's label is not a target, the next one is); otherwise at any target."""
    target = labels != IGNORE
    ok = target.clone()
    if answers:
        ok[:, 1:] &= ~target[:, :-1]
        ok[:, 0] = False
    pad = (inputs == pad_id).int().cumsum(1)
    # no pad in inputs[end-length:end], i.e. in positions end-length .. end-1
    last = torch.arange(inputs.shape[1])
    ok[:, :length - 1] = False
    before = torch.where(last >= length, pad[:, (last - length).clamp(min=0)], 0)
    ok &= (pad - before) == 0
    pairs = ok.nonzero()
    pairs[:, 1] += 1  # end is exclusive: the window holds the token whose label starts it
    return pairs


def sample_windows(inputs: torch.Tensor, labels: torch.Tensor, pad_id: int, length: int,
                   count: int, answers: bool, gen: torch.Generator) -> torch.Tensor:
    """`count` windows [count, length] (seeded, without repeats while there are enough)."""
    pairs = window_ends(inputs, labels, pad_id, length, answers)
    if pairs.shape[0] == 0:
        kind = "answer-start" if answers else "plain"
        raise ValueError(f"no {kind} window of {length} tokens in the corpus rows")
    pick = torch.randperm(pairs.shape[0], generator=gen)
    pick = pick.repeat(-(-count // pairs.shape[0]))[:count]
    rows, ends = pairs[pick, 0], pairs[pick, 1]
    offsets = torch.arange(-length, 0)
    return inputs[rows[:, None], ends[:, None] + offsets[None]]


def mixed_prompts(inputs: torch.Tensor, labels: torch.Tensor, chat: tuple, pad_id: int,
                  length: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """Half answer starts of dialogues (`chat` rows), half points of the plain rows, shuffled."""
    n_chat = count // 2
    windows = torch.cat([
        sample_windows(chat[0], chat[1], pad_id, length, n_chat, True, gen),
        sample_windows(inputs, labels, pad_id, length, count - n_chat, False, gen)])
    return windows[torch.randperm(count, generator=gen)]


@dataclass
class SequencePool:
    """Prompt windows with their greedy continuations: tokens [S, Lp + G]; `last` [S] is the
    index of each sequence's final valid position (its first stop token, or the end)."""
    tokens: torch.Tensor
    last: torch.Tensor
    prompt_len: int


def build_pool(target: Target, prompts: torch.Tensor, new_tokens: int, batch: int,
               deadline: float | None, log: Callable[[str], None]) -> SequencePool:
    """Continue `prompts` greedily, `batch` at a time, until done or `deadline` (perf_counter)
    passes; keeps the sequences with at least two valid positions past the prompt."""
    seqs, lasts, t0 = [], [], time.perf_counter()
    for i in range(0, prompts.shape[0], batch):
        p = prompts[i:i + batch].to(target.device)
        cont = target.greedy(p, new_tokens)
        seqs.append(torch.cat([p, cont], dim=1))
        lasts.append(p.shape[1] + target.first_eos(cont).clamp(max=new_tokens - 1))
        done = i + p.shape[0]
        if (i // batch) % 4 == 3 or done == prompts.shape[0]:
            el = time.perf_counter() - t0
            log(f"target greedy: {done}/{prompts.shape[0]} sequences of {new_tokens} new tokens "
                f"({done * new_tokens / el:,.0f} tok/s)")
        if deadline is not None and time.perf_counter() > deadline:
            log(f"generation budget spent after {done} sequences")
            break
    tokens, last = torch.cat(seqs), torch.cat(lasts)
    keep = last >= prompts.shape[1] + 1
    return SequencePool(tokens[keep], last[keep], prompts.shape[1])
