"""`beam-trt train-draft` (beam_trtllm/draft/train*.py): prompt windows, the loss going down,
the offline speculative loop committing exactly the target's greedy tokens, a CPU smoke run
of the command, and the shipped drafter of the trained tiny Beam."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from click.testing import CliRunner
from engine_helpers import one_thread  # noqa: F401  (fixture)

from beam_trtllm.cli import main
from beam_trtllm.draft import DFlash2Drafter, DraftConfig
from beam_trtllm.draft.train import (
    DraftTrainOptions, Trainer, default_draft_config, target_layer_ids,
)
from beam_trtllm.draft.train_data import SequencePool, Target, window_ends
from beam_trtllm.draft.train_eval import speculative_greedy
from beam_trtllm.tiny import TRAINED_DIR, init_trained_tiny
from beam_trtllm.train.data import IGNORE

SHIPPED = TRAINED_DIR / "draft"
CODE = ('def read_lines(path):\n    """Return the lines of the file at path."""\n'
        '    with open(path) as f:\n        return [line.rstrip("\\n") for line in f]\n\n\n'
        'def count_words(text):\n    """Count the words of text."""\n    counts = {}\n')
LAYERS = (1, 2, 4, 6, 7)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Target(TRAINED_DIR, LAYERS, "cpu")


def test_target_layers_spread_from_layer_one_to_the_last():
    assert target_layer_ids(8) == LAYERS
    assert target_layer_ids(4) == (1, 2, 3)
    ids = target_layer_ids(52)
    assert len(ids) == 5 and ids[0] == 1 and ids[-1] == 51 and list(ids) == sorted(set(ids))


def test_windows_are_free_of_padding_and_end_where_an_answer_starts():
    pad = 9
    inputs = torch.tensor([[1, 2, 3, 4, 5, 6, 7, pad, pad],
                           [1, 2, 3, 4, 5, 6, 7, 8, 1]])
    labels = torch.tensor([[IGNORE, IGNORE, IGNORE, 5, 6, 7, IGNORE, IGNORE, IGNORE],
                           [2, 3, 4, 5, 6, 7, 8, 1, 2]])
    assert window_ends(inputs, labels, pad, 3, answers=True).tolist() == [[0, 4]]
    plain = window_ends(inputs, labels, pad, 3, answers=False).tolist()
    assert plain == [[0, 4], [0, 5], [0, 6]] + [[1, e] for e in range(3, 10)]
    for row, end in plain:
        assert pad not in inputs[row, end - 3:end].tolist()


def test_the_target_capture_is_the_residual_stream_before_the_final_norm(target):
    ids = torch.randint(0, 4000, (2, 24), generator=torch.Generator().manual_seed(1))
    states, logits = target.forward(ids)
    out = target.model(input_ids=ids, use_cache=False, output_hidden_states=True)
    hs = out.hidden_states  # [embeddings, after layer 0, ...]; the last entry is post-norm
    want = torch.cat([hs[i + 1] for i in LAYERS[:-1]], -1)
    assert torch.equal(states[..., :-target.cfg.hidden_size], want)
    last = states[..., -target.cfg.hidden_size:]
    normed = target.model.model.norm(last)
    assert torch.equal(normed, hs[-1]) and not torch.allclose(last, hs[-1])
    assert torch.equal(logits, out.logits.float())


def test_a_few_steps_on_a_fixed_pool_lower_the_loss(target, one_thread):
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, 4000, (4, 24), generator=gen)
    tokens = torch.cat([prompts, target.greedy(prompts, 24)], 1)
    pool = SequencePool(tokens, torch.full((4,), 47), 24)
    dcfg = default_draft_config(target.cfg, 4088)
    opts = DraftTrainOptions(out_dir=None, target=TRAINED_DIR, batch_size=4, blocks_per_seq=8,
                             seed=3)
    tr = Trainer(target, dcfg, pool, opts)
    first = tr.step(3e-3)
    for _ in range(10):
        last = tr.step(3e-3)
    assert float(last["unary"]) < float(first["unary"]) - 1.0, (first, last)
    assert all(p.grad is None for p in tr.params.values())  # the step cleared them


def test_speculative_loop_commits_the_targets_greedy_tokens(target, one_thread):
    """With the shipped drafter: the committed tokens are transformers' greedy continuation,
    and drafts do get accepted."""
    drafter = DFlash2Drafter.from_dir(SHIPPED, target.cfg, target.embed_tokens, target.lm_head,
                                      "cpu", torch.float32)
    tok = target.tok
    eos = set(target.cfg.eos_token_id)
    accepted = steps = committed = 0
    chat = tok.chat_ids([{"role": "user", "content": "Write a function that adds two numbers."}])
    for prompt in (tok.encode_plain(CODE)[-24:], chat):
        prompts = torch.tensor([prompt])
        got, stats = speculative_greedy(target, drafter, prompts, 24, batch=1)
        want = target.greedy(prompts, 24)[0].tolist()
        stop = next((i for i, t in enumerate(want) if t in eos), len(want) - 1)
        assert got[0] == want[:stop + 1]
        accepted, steps, committed = (accepted + stats["accepted"], steps + stats["steps"],
                                      committed + len(got[0]))
    assert accepted > 0 and steps < committed - 1
    code = tok.encode_plain(CODE)
    batch = torch.tensor([code[:24], code[-24:]])  # right-padded rows of one target forward
    got, _ = speculative_greedy(target, drafter, batch, 16, batch=2)
    assert got == target.greedy(batch, 16).tolist()


def test_train_draft_smoke_on_the_cpu(tmp_path, one_thread):
    out = tmp_path / "draft"
    args = ["train-draft", str(out), "--target", str(TRAINED_DIR), "--device", "cpu",
            "--seconds", "5", "--steps", "2", "--sequences", "4", "--prompt-len", "32",
            "--gen-tokens", "16", "--batch-size", "4", "--blocks-per-seq", "4",
            "--max-stdlib-mb", "0.1", "--dialogues", "60", "--eval-prompts", "2",
            "--eval-tokens", "6", "--log-every", "1"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    run = json.loads((out / "RUN.json").read_text())
    assert run["steps"] == 2 and run["seed"] == 0 and run["sequences_generated"] <= 4
    assert run["command"].startswith(f"beam-trt train-draft {out} --target {TRAINED_DIR} ")
    assert " --steps 2 " in run["command"] and " --seconds 5" in run["command"]
    assert run["model_safetensors_sha256"] == hashlib.sha256(
        (out / "model.safetensors").read_bytes()).hexdigest()
    assert set(run["final_losses"]) == {"step", "unary", "selector", "accept"}
    acc = run["heldout_acceptance"]
    assert set(acc) >= {"code", "chat", "all"} and acc["all"]["mean_acceptance_length"] >= 1.0
    assert "step 2/2" in (out / "train_log.txt").read_text()
    cfg = DraftConfig.from_dir(out)
    assert cfg.target_layer_ids == LAYERS and cfg.block_size == 8
    again = CliRunner().invoke(main, args)
    assert again.exit_code != 0 and "already holds a drafter" in again.output


def test_the_shipped_drafter_fits_the_trained_tiny_and_init_tiny_writes_it(tmp_path):
    run = json.loads((SHIPPED / "RUN.json").read_text())
    out = init_trained_tiny(tmp_path / "tiny")
    assert (out / "draft" / "model.safetensors").read_bytes() == (
        SHIPPED / "model.safetensors").read_bytes()
    assert hashlib.sha256((out / "draft" / "model.safetensors").read_bytes()).hexdigest() == \
        run["model_safetensors_sha256"]
    from beam_trtllm.config import BeamConfig

    cfg = BeamConfig.from_hf(out)
    embed = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    drafter = DFlash2Drafter.from_dir(out / "draft", cfg, embed, embed, "cpu", torch.float32)
    assert drafter.cfg.target_layer_ids == LAYERS
    assert run["heldout_acceptance"]["all"]["mean_acceptance_length"] > 1.0
