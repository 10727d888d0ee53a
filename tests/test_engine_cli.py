"""`beam-trt build` and `beam-trt generate ENGINE_DIR` from the command line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from engine_helpers import one_thread  # noqa: F401

from beam_trtllm.cli import main
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def test_build_then_generate_streams_the_engines_text(tiny_dir, tmp_path):
    runner = CliRunner()
    out_dir = tmp_path / "engine"
    res = runner.invoke(main, ["build", str(tiny_dir), str(out_dir), "--max-seq-len", "256",
                               "--max-batch", "2", "--block-size", "16"])
    assert res.exit_code == 0, res.output
    assert "[8/8] head" in res.output and "engine written to" in res.output
    spec = json.loads((out_dir / "engine.json").read_text())
    assert spec["options"]["max_seq_len"] == 256 and spec["kv_plan"]["num_blocks"] == 2 * 16
    res = runner.invoke(main, ["generate", str(out_dir), "--chat", "--max-new-tokens", "12",
                               "--prompt", "Write a function that adds two numbers."])
    assert res.exit_code == 0, res.output
    engine = Engine.from_dir(out_dir, device="cpu")
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content":
                                                  "Write a function that adds two numbers."}])
    want = engine.generate([text], SamplingParams(max_tokens=12))[0]["text"]
    assert res.stdout == text + want + "\n"
    res = runner.invoke(main, ["generate", str(out_dir), "--max-new-tokens", "6",
                               "--prompt", "def add(", "--batch-invariant"])
    assert res.exit_code == 0, res.output
    engine = Engine.from_dir(out_dir, device="cpu", batch_invariant=True)
    want = engine.generate([engine.tokenizer.encode("def add(")], SamplingParams(max_tokens=6))
    assert res.stdout == "def add(" + want[0]["text"] + "\n"
    res = runner.invoke(main, ["generate", str(tiny_dir), "--prompt", "hi", "--batch-invariant"])
    assert res.exit_code == 1 and "--batch-invariant needs a single-GPU engine dir" in res.output


def test_cli_errors_are_one_line_without_traceback(tiny_dir, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["build", str(tiny_dir), str(tmp_path / "e"), "--max-seq-len",
                               "64", "--kv-memory", "0.000001"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert res.output.startswith("Error: --kv-memory 1e-06 GiB does not even hold the sliding-window rings")
    res = runner.invoke(main, ["build", str(tiny_dir), str(tmp_path / "e"), "--max-seq-len", "64",
                               "--max-batch", "1", "--max-num-tokens", "16"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["generate", str(tmp_path / "e"), "--prompt", "word " * 80])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "the prompt has 162 tokens, --max-seq-len is 64" in res.output
    (tmp_path / "e" / "engine.json").write_text("{}")
    res = runner.invoke(main, ["generate", str(tmp_path / "e"), "--prompt", "hi"])
    assert res.exit_code == 1 and "format is None, expected 'beam-trt-engine'" in res.output
