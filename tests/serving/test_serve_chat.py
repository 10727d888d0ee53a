"""Beam's chat format through the served disaggregated graph with the `openai` client, on the
tiny Beam (random weights: the grammar forces the structure). One graph start per module."""

import json

import jsonschema
import openai
import pytest

from beam_trtllm.tokenizer import TextTokenizer
from helpers.serving import client, launch_graph, wait_all_free

TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["n"], "additionalProperties": False}}}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "call f"}]


@pytest.fixture(scope="module")
def graph(tmp_path_factory, engine_dir):
    running = launch_graph("disagg.yaml", {}, tmp_path_factory, engine_dir)
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def _all_kv_free_after_each_test(graph):
    yield
    wait_all_free(graph)


def _call(c, messages, max_tokens=60, **kw):
    return c.chat.completions.create(model="beam", messages=messages, tools=[TOOL],
                                     parallel_tool_calls=False, max_tokens=max_tokens,
                                     temperature=0, extra_body=NO_THINK, **kw)


def test_tool_choice_required_and_named_stream_agrees_logprobs_from_the_first_token(graph):
    c = client(graph)
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        r = _call(c, ASK, tool_choice=choice, logprobs=True)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        (call,) = ch.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "f" and isinstance(args["n"], int) and 1 <= args["n"] <= 9
        assert len(ch.logprobs.content) == r.usage.completion_tokens  # the prefill's token too
    stream = _call(c, ASK, tool_choice="required", stream=True)
    chunks = [x.choices[0] for x in stream if x.choices]
    calls = [tc for x in chunks for tc in (x.delta.tool_calls or [])]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [
        ("f", call.function.arguments)]
    assert chunks[-1].finish_reason == "tool_calls"


def test_json_schema_response_validates(graph):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "k": {
        "type": "integer", "minimum": 0, "maximum": 99}}, "required": ["ok", "k"],
        "additionalProperties": False}
    r = client(graph).chat.completions.create(
        model="beam", messages=ASK, max_tokens=40, temperature=0, extra_body=NO_THINK,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"


def test_agents_loop_reasoning_on_and_off(graph, engine_dir):
    """call tool -> send the result -> answer; with reasoning on the answer carries it."""
    c = client(graph)
    first = _call(c, ASK, tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    off = _call(c, history, tool_choice="none", max_tokens=12)
    on = c.chat.completions.create(model="beam", messages=history, tools=[TOOL], max_tokens=48,
                                   tool_choice="none", temperature=0, extra_body={
                                       "chat_template_kwargs": {"enable_thinking": True},
                                       "thinking_token_budget": 4})
    # the history (call, tool result) is rendered; tool_choice none declares no tools
    assert off.usage.prompt_tokens == len(TextTokenizer(engine_dir).chat_ids(history))
    assert off.choices[0].message.content and off.choices[0].message.tool_calls is None
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    msg = on.choices[0].message.model_extra
    assert msg["reasoning_content"] and on.choices[0].message.content


def test_unsupported_parameters_get_a_400_naming_them(graph):
    c = client(graph)
    for extra, name in (({"echo": True}, "echo"), ({"guided_choice": ["a"]}, "guided_choice"),
                        ({"chat_template_kwargs": {"x": 1}}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError, match=name):
            c.chat.completions.create(model="beam", messages=ASK, max_tokens=2, extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        c.chat.completions.create(model="beam", messages=ASK, tools=[TOOL], max_tokens=2,
                                  tool_choice={"type": "function", "function": {"name": "g"}})


def test_n_choices_run_at_once_each_with_its_own_seed(graph):
    """n = 3 sampled choices: each is what one request with seed + index gives (the processor
    runs them as three routed requests at once), streamed or not."""
    c = client(graph)
    body = dict(model="beam", messages=ASK, max_tokens=10, temperature=1.0, seed=11,
                extra_body=NO_THINK)
    many = c.chat.completions.create(n=3, **body)
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2]
    alone = [c.chat.completions.create(**{**body, "seed": 11 + i}).choices[0] for i in range(3)]
    for ch in many.choices:
        assert ch.message.content == alone[ch.index].message.content
        assert ch.finish_reason == alone[ch.index].finish_reason
    assert len({a.message.content for a in alone}) > 1  # (the seeds do sample differently)
    texts = {}
    for chunk in c.chat.completions.create(n=3, stream=True, **body):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert texts == {ch.index: ch.message.content for ch in many.choices}


def test_n_choices_stop_with_the_client(graph):
    """A client that leaves mid-stream stops every choice at once (all KV free within 3 s),
    and the graph answers the next request."""
    c = client(graph)
    stream = c.chat.completions.create(model="beam", messages=ASK, max_tokens=400, n=3,
                                       temperature=1.0, stream=True, extra_body={
                                           **NO_THINK, "ignore_eos": True})
    seen = set()
    for chunk in stream:
        seen |= {ch.index for ch in chunk.choices if ch.delta.content}
        if len(seen) == 3:
            break
    stream.close()
    # the three would decode ~400 tokens each for many seconds more on this CPU if left on
    wait_all_free(graph, timeout_s=3.0)
    after = c.chat.completions.create(model="beam", messages=ASK, max_tokens=4, temperature=0,
                                      extra_body=NO_THINK)
    assert after.choices[0].finish_reason in ("length", "stop")
