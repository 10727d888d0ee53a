"""Beam's response parser on raw texts (special tokens kept), streamed and whole."""

import json
import random

import pytest

from beam_trtllm.chat.parser import BeamResponseParser, assemble, parse_text

H = " to={}<|channel|>analysis <|constrain|>xml<|message|>"
NEXT = "<|end|><|start|>assistant"
TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "integer"}}},
    "typed": {"type": "object", "properties": {
        "i": {"type": "integer"}, "f": {"type": "number"}, "b": {"type": "boolean"},
        "z": {"type": "null"}, "o": {"type": "object"}, "a": {"type": "array"},
        "s": {"type": "string"}, "u": {"type": ["integer", "string"]},
        "opt": {"anyOf": [{"type": "number"}, {"type": "null"}]}}},
}


def param(k, v):
    return f'<rfl:parameter name="{k}">\n{v}\n</rfl:parameter>'


def streamed(text, tools=TOOLS, seed=0):
    """Feed `text` in random pieces (1-7 characters) and assemble the deltas."""
    rng, p, deltas, i = random.Random(seed), BeamResponseParser(tools), [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        deltas += p.feed(text[i:i + n])
        i += n
    return assemble(deltas + p.finish())


def _same(a, b):
    calls = lambda m: [(c.name, c.arguments) for c in m["tool_calls"]]  # noqa: E731
    return (a["reasoning"], a["content"], calls(a)) == (b["reasoning"], b["content"], calls(b))


CASES = {
    "answer_with_reasoning": "<|channel|>analysis<|message|>17*3 = 51.<|end|><|start|>assistant"
                             "<|channel|>final<|message|>17 x 3 = 51.<|return|>",
    "one_call": H.format("get_weather") + param("city", "Paris") + "<|call|>",
    "two_calls": "<|channel|>analysis<|message|>two<|end|><|start|>assistant"
                 + H.format("get_weather") + param("city", "Paris") + "\n" + param("days", "3")
                 + NEXT + H.format("get_weather") + param("city", "Tokyo") + "<|call|>",
    "newlines": H.format("typed") + param("s", "line 1\n\nline 3\n") + "<|call|>",
    "cut_off": H.format("get_weather") + param("city", "Paris") + '<rfl:parameter name="days">\n1',
    "malformed": H.format("get_weather") + "garbage" + NEXT + H.format("get_weather")
                 + param("city", "Rome") + "<|call|>",
    "unknown": H.format("launch_missiles") + param("x", "1") + "<|call|>",
    "every_type": H.format("typed") + "\n".join([
        param("i", "42"), param("f", "2.5"), param("b", "True"), param("z", "null"),
        param("o", '{"k": [1, 2]}'), param("a", "[1, \"x\"]"), param("s", "007"),
        param("u", "12"), param("opt", "null"), param("undeclared", "5")]) + "<|call|>",
}


def test_answer_with_reasoning():
    m = parse_text(CASES["answer_with_reasoning"], TOOLS)
    assert m == {"reasoning": "17*3 = 51.", "content": "17 x 3 = 51.", "tool_calls": []}


def test_one_and_several_tool_calls():
    one = parse_text(CASES["one_call"], TOOLS)["tool_calls"]
    assert [(c.name, c.arguments) for c in one] == [("get_weather", {"city": "Paris"})]
    m = parse_text(CASES["two_calls"], TOOLS)
    assert m["reasoning"] == "two" and m["content"] is None
    assert [(c.name, c.arguments) for c in m["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Tokyo"})]
    assert len({c.id for c in m["tool_calls"]}) == 2


def test_arguments_of_every_json_type():
    args = parse_text(CASES["every_type"], TOOLS)["tool_calls"][0].arguments
    assert args == {"i": 42, "f": 2.5, "b": True, "z": None, "o": {"k": [1, 2]}, "a": [1, "x"],
                    "s": "007", "u": 12, "opt": None, "undeclared": "5"}
    assert json.loads(json.dumps(args)) == args
    # a failed cast stays the raw text
    bad = parse_text(H.format("typed") + param("i", "four") + "<|call|>", TOOLS)
    assert bad["tool_calls"][0].arguments == {"i": "four"}


def test_value_with_newlines_is_kept_verbatim():
    args = parse_text(CASES["newlines"], TOOLS)["tool_calls"][0].arguments
    assert args == {"s": "line 1\n\nline 3\n"}


def test_cut_off_malformed_and_unknown_calls_are_dropped(caplog):
    assert parse_text(CASES["cut_off"], TOOLS)["tool_calls"] == []
    assert "cut off" in caplog.text
    m = parse_text(CASES["malformed"], TOOLS)
    assert [(c.name, c.arguments) for c in m["tool_calls"]] == [("get_weather", {"city": "Rome"})]
    assert "malformed" in caplog.text
    assert parse_text(CASES["unknown"], TOOLS)["tool_calls"] == []
    assert "undeclared" in caplog.text


def test_partial_delimiters_are_held_back():
    p = BeamResponseParser(TOOLS)
    out = p.feed("<|channel|>final<|message|>abc<|re")
    assert [d.text for d in out] == ["abc"]  # '<|re' could be <|return|>
    assert [d.text for d in p.feed("ally")] == ["<|really"]
    out = p.feed("<|return|>")
    assert out == [] and p.finish() == []


def test_reasoning_cut_inside_its_closer_ends_there():
    assert parse_text("<|channel|>analysis<|message|>x<|end|>")["reasoning"] == "x"


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_deltas_reassemble_to_the_whole_message(name):
    whole = parse_text(CASES[name], TOOLS)
    for seed in range(5):
        assert _same(streamed(CASES[name], seed=seed), whole)
    # one character at a time
    p = BeamResponseParser(TOOLS)
    deltas = [d for ch in CASES[name] for d in p.feed(ch)] + p.finish()
    assert _same(assemble(deltas), whole)
