"""Calibration data: the shipped set (kinds, Beam's chat format, held-out text disjoint from
it), `--calib-data` as text / JSONL / parquet / a directory, and bad files named."""

from __future__ import annotations

import json

import numpy as np
import pytest

from convert import ConvertError
from convert.calib_data import (DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, heldout_tokens,
                                load_calib_tokens, read_documents, render_messages, windows)


def _jsonl(name: str) -> list[dict]:
    from convert.calib_data import _builtin

    return [json.loads(line) for line in _builtin(name).read_text().splitlines()]


def test_shipped_set_mixes_code_prose_and_beam_chat():
    docs, source = read_documents(None)
    assert source == "builtin:calib.jsonl"
    kinds = {d["kind"] for d in docs}
    assert kinds == {"code", "prose", "chat", "mixed"}
    chats = "".join(d["text"] for d in docs if d["kind"] == "chat")
    for marker in ("<|start|>assistant<|channel|>analysis<|message|>",
                   "<|channel|>final<|message|>", "<|return|>", "<|call|>",
                   '<rfl:parameter name="path">', " to=assistant<|message|>"):
        assert marker in chats, marker
    assert sum(len(d["text"]) for d in docs) > 300_000
    assert [d["kind"] for d in docs[1:4]] == ["code", "prose", "chat"]  # interleaved


def test_heldout_text_is_disjoint_from_calibration(tiny_dir):
    calib, held = _jsonl("calib.jsonl"), _jsonl("heldout.jsonl")
    assert {d["source"] for d in calib}.isdisjoint({d["source"] for d in held})
    corpus = "\n".join(d["text"] for d in calib)
    for d in held:  # other documents (single lines of code may repeat across the library)
        for at in range(0, len(d["text"]) - 300, 300):
            assert d["text"][at: at + 300] not in corpus, (d["source"], at)
    # the token windows verify reads appear nowhere in the calibration token stream
    stream = load_calib_tokens(tiny_dir, None, 1, 10**6).ids.numpy().astype(np.int32).tobytes()
    for window in heldout_tokens(tiny_dir, 4, 64).numpy().astype(np.int32):
        assert window.tobytes() not in stream


def test_default_windows_are_spread_over_the_whole_set(tiny_dir):
    full = load_calib_tokens(tiny_dir, None, 1, 10**6)  # everything, wrapped at the end
    stream = full.ids.reshape(-1)[: full.unique_tokens].tolist()
    tokens = load_calib_tokens(tiny_dir, None, DEFAULT_SAMPLES, DEFAULT_SEQ_LEN)
    assert tokens.ids.shape == (32, 256) and tokens.unique_tokens == len(stream) > 32 * 256
    assert tokens.ids[0].tolist() == stream[:256] and tokens.ids[-1].tolist() == stream[-256:]
    assert windows(list(range(10)), 2, 8).tolist() == [list(range(8)), [8, 9] + list(range(6))]


def test_calib_data_text_jsonl_parquet_and_directory(tiny_dir, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    d = tmp_path / "data"
    d.mkdir()
    (d / "a.txt").write_text("def f(x):\n    return x + 1\n")
    chat = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", "reasoning": "Greet back."}]
    (d / "b.jsonl").write_text(json.dumps({"text": "plain prose."}) + "\n\n"
                               + json.dumps({"messages": chat}) + "\n")
    pq.write_table(pa.table({"text": ["row one", "row two"]}), d / "c.parquet")
    (d / "skip.bin").write_bytes(b"\x00\xff")  # not a calibration file suffix: ignored
    docs, source = read_documents(str(d))
    assert source == str(d.resolve()) and len(docs) == 5
    assert docs[2]["text"] == ("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>"
                               "analysis<|message|>Greet back.<|end|><|start|>assistant"
                               "<|channel|>final<|message|>Hello.<|return|>")
    assert [x["kind"] for x in docs] == ["text", "text", "chat", "text", "text"]
    tokens = load_calib_tokens(tiny_dir, str(d / "c.parquet"), 2, 8)
    assert tokens.ids.shape == (2, 8) and tokens.documents == {"text": 2}


def test_bad_calib_data_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(ConvertError, match=f"--calib-data {bad}:2: not JSON"):
        read_documents(str(bad))
    bad.write_text(json.dumps({"txt": "typo"}) + "\n")
    with pytest.raises(ConvertError, match=f"{bad}:1: expected an object with a string `text`"):
        read_documents(str(bad))
    with pytest.raises(ConvertError, match=r"messages\[1\] needs string `role` and `content`"):
        render_messages([{"role": "user", "content": "a"}, {"role": "assistant"}], "x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match="no .jsonl, .parquet, .txt, .md files in it"):
        read_documents(str(tmp_path / "empty"))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(ConvertError, match=r"needs a `text` or `messages` column, it has \['body'"):
        read_documents(str(tmp_path / "t.parquet"))
    (tmp_path / "u.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ConvertError, match="not a readable parquet file"):
        read_documents(str(tmp_path / "u.parquet"))
