"""`beam-trt train-tiny`: the corpus (stdlib split, synthetic dialogues in Beam's chat format) is
reproducible and reads back through the response parser; the BPE round-trips and keeps Beam's
special tokens whole; a few CPU steps of transformers' BeamForCausalLM lower the loss, and the
written dir builds into an engine that generates what the model generates."""

from __future__ import annotations

import ast
import json
import math
import re

import pytest
import torch
from click.testing import CliRunner
from engine_helpers import one_thread  # noqa: F401  (fixture)

from beam_trtllm.chat import format as F
from beam_trtllm.chat.parser import parse_text
from beam_trtllm.chat.template import unescape
from beam_trtllm.chat.tools import tool_schemas
from beam_trtllm.cli import main
from beam_trtllm.tokenizer import SPECIAL_TOKENS, TextTokenizer, special_token_ids
from beam_trtllm.train.checks import _valid
from beam_trtllm.train.data import (
    Piece, gather_sources, is_heldout, pack_rows, stdlib_files, tokenize_corpus,
)
from beam_trtllm.train.dialogues import TOOLS, calls_text, dialogues
from beam_trtllm.train.model import CANONICAL, SMALL, weight_bytes
from beam_trtllm.train.tokenizer import train_tokenizer

SCHEMAS = tool_schemas(list(TOOLS.values()))
FENCE = re.compile(r"```python\n(.*?)```", re.S)


def test_dialogues_are_seeded_and_parse_back_with_the_response_parser():
    examples = dialogues(120, seed=3)
    assert examples == dialogues(120, seed=3) and examples != dialogues(120, seed=4)
    kinds = {k: [e for e in examples if e.kind == k] for k in ("code", "tool_call", "tool_answer")}
    assert all(len(v) >= 20 for v in kinds.values()), {k: len(v) for k, v in kinds.items()}
    for ex in examples:
        assert unescape(ex.prompt).endswith(F.ASSISTANT_START)
        msg = parse_text(unescape(ex.completion), SCHEMAS)
        assert msg["reasoning"], ex
        if ex.kind == "code":
            assert not msg["tool_calls"] and unescape(ex.completion).endswith(F.RETURN)
            code = FENCE.findall(msg["content"])
            assert len(code) == 1 and code[0].lstrip().startswith("def ")
            ast.parse(code[0])
        elif ex.kind == "tool_call":
            assert msg["content"] is None and unescape(ex.completion).endswith(F.CALL)
            assert msg["tool_calls"] and all(_valid(c.name, c.arguments) for c in msg["tool_calls"])
        else:
            assert not msg["tool_calls"] and msg["content"]
            assert "<|start|>functions." in ex.prompt and " to=assistant<|message|>" in ex.prompt


def test_the_template_renders_a_prior_call_as_the_model_wrote_it():
    examples = dialogues(60, seed=5)
    pairs = [(a, b) for a, b in zip(examples, examples[1:])
             if a.kind == "tool_call" and b.kind == "tool_answer"]
    assert pairs
    for call_turn, answer_turn in pairs:
        calls = call_turn.completion.split(F.THINKING_CLOSE, 1)[1]  # reasoning dropped
        assert answer_turn.prompt.startswith(call_turn.prompt + calls)
    # typed arguments: numbers as JSON, strings raw, alphabetical
    text = calls_text([("add", {"b": 2, "a": 1.5}), ("get_weather", {"unit": "celsius",
                                                                     "city": "Oslo"})])
    msg = parse_text(text, SCHEMAS)
    assert [(c.name, c.arguments) for c in msg["tool_calls"]] == [
        ("add", {"a": 1.5, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    assert text.index('name="a"') < text.index('name="b"')
    assert not _valid("get_weather", {"city": "Oslo", "unit": "kelvin"})
    assert not _valid("search", {"query": "x", "limit": "3"})


def test_stdlib_split_is_fixed_and_held_out_files_are_never_trained_on():
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 300
    held = [f for f in files if is_heldout(f)]
    assert 0.005 < len(held) / len(files) < 0.05
    a = gather_sources(1, 10, max_stdlib_bytes=200_000)
    b = gather_sources(1, 10, max_stdlib_bytes=200_000)
    assert a.meta == b.meta and a.train_dialogues == b.train_dialogues
    assert not {p for p, _ in a.train_files} & {p for p, _ in a.heldout_files}
    assert all(is_heldout(p) for p, _ in a.heldout_files)


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    src = gather_sources(0, 200, max_stdlib_bytes=300_000)
    out = tmp_path_factory.mktemp("tok")
    tok, ids = train_tokenizer(out, src, SMALL.vocab_size, SMALL.max_position_embeddings)
    return src, out, tok, ids


def test_tokenizer_round_trips_and_keeps_special_tokens_whole(small_tokenizer):
    src, out, tok, ids = small_tokenizer
    assert ids == special_token_ids(SMALL.vocab_size)
    for name in SPECIAL_TOKENS:
        assert tok.encode(name) == [ids[name]]
    text = src.heldout_files[0][1][:3000] + "ünïcödé ✓ 数字\t\n"
    assert tok.decode(tok.encode_plain(text)) == text
    ex = next(e for e in src.train_dialogues if e.kind == "tool_call")
    prompt_ids = tok.prompt_tokenizer.encode_rendered(ex.prompt)
    assert tok.decode(prompt_ids, skip_special_tokens=False) == unescape(ex.prompt)
    assert prompt_ids.count(ids[F.START]) == unescape(ex.prompt).count(F.START)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == F.chat_template()
    assert cfg["response_template"] == F.response_template()
    assert TextTokenizer(out).chat_ids([{"role": "user", "content": "hi <|end|>"}]).count(
        ids[F.END]) == 1  # typed <|end|> stays text


def test_packing_keeps_dialogues_whole_and_code_in_order(small_tokenizer):
    pieces = [Piece(list(range(100 + 30 * i, 100 + 30 * i + 25)), [True] * 25, True)
              for i in range(6)]
    pieces += [Piece([1000 + i] * 9, [False] * 4 + [True] * 5, False) for i in range(5)]
    ids, mask = pack_rows(pieces, 16, sep_id=7, pad_id=8, seed=0)
    assert ids.shape[1] == 16 and mask.shape == ids.shape
    for i in range(5):  # each dialogue once, contiguous, after its separator, in one row
        rows = [r for r in range(ids.shape[0]) if (ids[r] == 1000 + i).any()]
        assert len(rows) == 1
        pos = (ids[rows[0]] == 1000 + i).nonzero()[:, 0]
        assert pos.tolist() == list(range(int(pos[0]), int(pos[0]) + 9))
        assert ids[rows[0], pos[0] - 1] == 7
        assert mask[rows[0], pos].tolist() == [False] * 4 + [True] * 5
    flat = ids.flatten().tolist()
    for p in pieces[:6]:  # every code token, in order (a piece may continue in the next row)
        assert [t for t in flat if t in set(p.ids)] == p.ids
    assert not mask[ids == 8].any() and not mask[ids == 7].any()
    src, _, tok, ids_ = small_tokenizer
    corpus = tokenize_corpus(tok, src, 511, ids_["<|endoftext|>"], ids_["<|pad|>"], 2048)
    x, y = corpus.train
    assert x.shape[1] == y.shape[1] == 511 and (x[:, 1:] == y[:, :-1])[y[:, :-1] >= 0].all()


def test_canonical_config_has_every_feature_and_fits_the_repo():
    c = CANONICAL
    assert c.full_layers and c.sliding_layers and c.dense_layers and c.moe_layers
    assert 1 < c.topk_group < c.n_group and c.final_logit_softcapping
    assert c.sliding_window < 512 and c.moe_intermediate_size % 128 == 0
    assert weight_bytes(c) <= 25e6 and c.total_params == 11_691_360


@pytest.mark.usefixtures("one_thread")
def test_cli_trains_lowers_the_loss_and_the_dir_builds_and_generates(tmp_path):
    from beam_trtllm.engine.build import build_engine
    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.plan import BuildOptions
    from beam_trtllm.engine.types import SamplingParams
    from beam_trtllm.hf_model import load_model, stream

    out = tmp_path / "trained"
    res = CliRunner().invoke(main, [
        "train-tiny", str(out), "--device", "cpu", "--size", "small", "--steps", "60",
        "--batch-size", "4", "--dialogues", "200", "--max-stdlib-mb", "0.3",
        "--heldout-tokens", "2048"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.rindex("\n{") + 1:])
    full = json.loads((out / "train_summary.json").read_text())
    initial = full["training"]["heldout_during_training"][0]
    assert initial["step"] == 0 and abs(initial["loss"] - math.log(SMALL.vocab_size)) < 0.3
    assert summary["final_train_loss"] < full["training"]["first_train_loss"] - 0.3
    assert summary["heldout_loss"] < initial["loss"] - 1.0, (initial, summary)
    assert summary["steps"] == 60 and summary["tokens_seen"] == 60 * 4 * 512
    assert summary["device"] == "cpu"
    assert set(full["checks"]) == {"code", "tool"}
    assert "step 60/60" in (out / "train_log.txt").read_text()

    engine_dir = build_engine(out, tmp_path / "engine", BuildOptions(
        max_batch=2, max_seq_len=512, max_num_tokens=64, block_size=16, dtype="float32"))
    engine = Engine.from_dir(engine_dir, device="cpu")
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    prompt = engine.tokenizer.chat_ids(messages)
    got = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    model = load_model(out, torch.float32)
    want = [int(t[0]) for t in stream(model, torch.tensor([prompt]), 12)]
    assert got["token_ids"] == want


def test_autocast_experts_are_transformers_grouped_mm_on_cast_weights():
    """The training adapter computes exactly transformers' grouped_mm forward on BF16 copies
    of the experts' weights, and its gradients reach the FP32 weights."""
    import copy

    from transformers.integrations.moe import grouped_mm_experts_forward

    from beam_trtllm.train.model import autocast_grouped_mm, build_model

    experts = build_model(SMALL, 0).model.layers[1].mlp.experts
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(37, SMALL.hidden_size, generator=gen)
    idx = torch.stack([torch.randperm(SMALL.num_experts, generator=gen)[:2] for _ in range(37)])
    w = torch.rand(37, 2, generator=gen)
    cast = copy.deepcopy(experts).to(torch.bfloat16)
    want = grouped_mm_experts_forward(cast, h.to(torch.bfloat16), idx, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = autocast_grouped_mm(experts, h, idx, w)
    assert torch.equal(got.to(torch.bfloat16), want.to(torch.bfloat16))
    got.float().square().sum().backward()
    assert experts.gate_up_proj.grad.dtype == torch.float32
    assert experts.gate_up_proj.grad.abs().sum() > 0 and experts.down_proj.grad.abs().sum() > 0


def test_init_tiny_trained_answers_and_calls_the_tool(tmp_path, one_thread):
    """`init-tiny --trained` writes the shipped trained tiny Beam; transformers' own model on
    it answers the coding request with Python that parses and calls get_weather with
    arguments that validate (greedy, on the CPU), and the engine built from it generates
    transformers' greedy tokens."""
    from beam_trtllm.engine.build import build_engine
    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.plan import BuildOptions
    from beam_trtllm.hf_model import load_model
    from beam_trtllm.train.checks import code_check, tool_check
    from engine_helpers import greedy

    out = tmp_path / "trained"
    res = CliRunner().invoke(main, ["init-tiny", str(out), "--trained"])
    assert res.exit_code == 0, res.output
    model, tok = load_model(out).float().eval(), TextTokenizer(out)
    code = code_check(model, tok, "cpu")
    assert code["code_parses"], code
    ast.parse(re.search(r"```python\n(.*?)```", code["content"], re.S).group(1))
    call = tool_check(model, tok, "cpu")
    assert call["arguments_valid"] and call["tool_calls"][0]["name"] == "get_weather", call
    engine_dir = build_engine(out, tmp_path / "engine", BuildOptions(
        dtype="float32", max_seq_len=256, max_batch=2, block_size=16))
    prompt = tok.chat_ids([{"role": "user", "content": "Write a function that adds two numbers."}])
    got = Engine.from_dir(engine_dir, device="cpu").generate([prompt], greedy(24))[0]["token_ids"]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    assert got == want[0, len(prompt):].tolist()
