"""`make demo`'s answer paths on the trained tiny Beam, without the rest of the demo:
- dynamo_graphs/demo_answers.py: the BF16 engine's answer to the coding request holds Python
  that `ast.parse` accepts (the function the demo calls, on the engine the demo builds);
- dynamo_graphs/demo_chat.py: through a served graph's OpenAI API (the aggregated graph, one
  worker: the demo's disaggregated graph serves the same engine through the same frontend),
  the coding request's streamed answer parses and the `get_weather` request returns a call
  whose arguments validate against the tool's JSON schema.
"""

from __future__ import annotations

import ast

import pytest

from dynamo_graphs import demo_answers, demo_chat
from engine_helpers import one_thread  # noqa: F401,F811  (a fixture)


@pytest.fixture(scope="module")
def trained_engine_dir(tmp_path_factory):
    from beam_trtllm.engine.build import build_engine
    from beam_trtllm.engine.plan import BuildOptions
    from beam_trtllm.tiny import init_trained_tiny

    tmp = tmp_path_factory.mktemp("demo")
    ckpt = init_trained_tiny(tmp / "tiny")
    # the demo's build options (Makefile: --max-seq-len 512 --block-size 16)
    return build_engine(ckpt, tmp / "tiny-engine", BuildOptions(max_seq_len=512, block_size=16))


def test_the_demo_answer_to_the_coding_request_is_python_that_parses(trained_engine_dir,
                                                                    one_thread):
    from beam_trtllm.engine.engine import Engine

    engine = Engine.from_dir(trained_engine_dir, device="cpu")
    answer = demo_answers.engine_answer(engine, demo_answers.code_messages())
    code = demo_answers.python_of(answer["content"])
    assert code is not None, answer
    tree = ast.parse(code)
    assert any(isinstance(node, ast.FunctionDef) for node in tree.body), code
    assert answer["reasoning"], answer  # the analysis channel came first
    # what the demo rejects: no fence, an empty block, a block that does not parse
    assert demo_answers.python_of("no code here") is None
    assert demo_answers.python_of("```python\n\n```") is None
    assert demo_answers.python_of("```python\ndef f(:\n```") is None


@pytest.mark.slow
def test_the_served_demo_requests_answer_and_call_get_weather(trained_engine_dir,
                                                              tmp_path_factory, capsys):
    from helpers.serving import launch_graph

    running = launch_graph("agg.yaml", {}, tmp_path_factory, trained_engine_dir)
    try:
        assert demo_chat.ask_code(running.url, demo_answers.CODE_PROMPT, 160) is not None
        assert demo_chat.ask_tool(running.url, 160)
    finally:
        running.stop()
    out = capsys.readouterr().out
    assert "tool call get_weather(" in out and "validate against get_weather's JSON schema" in out
