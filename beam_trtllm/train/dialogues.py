"""Synthetic dialogues in Beam's chat format, seeded: coding requests answered with reasoning
(the analysis channel) and Python that parses, and requests that need a tool answered with
Beam tool calls, then (after the tool result) an answer.

A dialogue becomes one or two `Example`s: the prompt exactly as the checkpoint's chat template
renders the conversation so far (`beam_trtllm.chat.template.render`, escaped), and the turn the
model must write after `<|start|>assistant`, built from `beam_trtllm.chat.format`'s pieces. A
tool dialogue gives two: the turn that ends in `<|call|>`, and after the re-rendered history
with the tool results, the turn that answers (the template drops prior reasoning, as a served
conversation does).
"""

from __future__ import annotations

import ast
import json
import random
from dataclasses import dataclass

from ..chat import format as F
from ..chat.template import escape, normalize_messages, render
from .tasks import REQUEST_FORMS, SYSTEM_PROMPTS, TASKS, Task

CITIES = ("Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Cairo", "Lima",
          "Sydney", "Toronto", "Mumbai", "Seoul", "Nairobi", "Dublin", "Vienna", "Prague",
          "Lisbon", "Chicago", "Denver", "Boston", "Austin", "Zurich", "Athens", "Hanoi")
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear")
TOPICS = ("python asyncio tutorials", "how to sort a dictionary by value", "rust ownership",
          "binary search in python", "git rebase vs merge", "unit testing with pytest",
          "python list comprehensions", "regular expressions for emails", "http status codes",
          "sql joins explained", "docker compose basics", "python dataclasses",
          "type hints in python", "linux file permissions", "json schema validation",
          "big o notation", "recursion examples", "python virtual environments")

TOOLS = {
    "get_weather": {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    "add": {"type": "function", "function": {
        "name": "add", "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}},
    "search": {"type": "function", "function": {
        "name": "search", "description": "Search the web and return the top results.",
        "parameters": {"type": "object", "properties": {
            "limit": {"type": "integer", "description": "How many results"},
            "query": {"type": "string"}}, "required": ["limit", "query"]}}},
}


@dataclass(frozen=True)
class Example:
    """One training example: `prompt` (rendered, escaped, ends with `<|start|>assistant`) and
    `completion` (escaped), whose tokens are the only ones the loss sees."""
    prompt: str
    completion: str
    kind: str  # "code" | "tool_call" | "tool_answer"


# ---------------------------------------------------------------- turn pieces
def reasoning(text: str) -> str:
    return F.THINKING_OPEN + escape(text) + F.THINKING_CLOSE


def final(text: str) -> str:
    return F.CONTENT_OPEN + escape(text) + F.RETURN


def param_value(value) -> str:
    """A parameter as the template writes a prior call's: strings raw, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def calls_text(calls: list[tuple[str, dict]]) -> str:
    """Calls in Beam's output format: parameters in alphabetical order (as the grammar has them),
    `<|end|><|start|>assistant` between calls, `<|call|>` after the last."""
    parts = []
    for name, args in calls:
        params = F.PARAM_SEPARATOR.join(F.param_text(escape(k), escape(param_value(args[k])))
                                        for k in sorted(args))
        parts.append(F.call_head(name) + params)
    return F.THINKING_CLOSE.join(parts) + F.CALL


def prompt_text(messages: list[dict], tools: list[dict] | None) -> str:
    return render(F.chat_template(), normalize_messages(messages), tools, True)


# ---------------------------------------------------------------- coding requests
def task_code(task: Task, rng: random.Random) -> tuple[str, str, list[str]]:
    """(code, function name, parameters) of one variant of `task`; the code parses."""
    name = rng.choice(task.names)
    params = list(rng.choice(task.params))
    typed = rng.random() < 0.4 and len(task.hints) == len(params)
    sig = ", ".join(f"{p}: {h}" if typed else p for p, h in zip(params, task.hints or params))
    ret = f" -> {task.result_hint}" if typed and task.result_hint else ""
    lines = [f"def {name}({sig}){ret}:"]
    if rng.random() < 0.5:
        lines.append(f'    """Return {task.returns}."""')
    lines.append(task.body.format(*params))
    code = "\n".join(lines)
    ast.parse(code)  # a broken task template fails here, not in the model
    return code, name, params


def coding_example(rng: random.Random, tools: list[dict] | None = None) -> Example:
    task = rng.choice(TASKS)
    phrase = rng.choice(task.phrases)
    request = rng.choice(REQUEST_FORMS).format(phrase=phrase)
    code, name, params = task_code(task, rng)
    args = ", ".join(params)
    think = (f"The user wants a function that {phrase}. {task.plan} I will call it {name}, "
             f"take {args} and return {task.returns}.")
    if tools:
        think = "No tool is needed for this; I can write the code directly. " + think
    answer = f"Here is a function that {phrase}:\n\n```python\n{code}\n```\n\n"
    answer += f"`{name}({args})` returns {task.returns}."
    if rng.random() < 0.3 and task.hints and all(h in ("int", "float") for h in task.hints):
        example = ", ".join(str(rng.randint(1, 9)) for _ in params)
        answer += f" For example, `{name}({example})`."
    messages = _system(rng) + [{"role": "user", "content": request}]
    return Example(prompt_text(messages, tools), reasoning(think) + final(answer), "code")


def _system(rng: random.Random) -> list[dict]:
    return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.5 else []


# ---------------------------------------------------------------- tool requests
def _number(rng: random.Random):
    return rng.randint(-50, 500) if rng.random() < 0.6 else round(rng.uniform(-100, 100), 1)


def _fmt(x) -> str:
    return json.dumps(x)


def weather_request(rng: random.Random):
    cities = rng.sample(CITIES, 2 if rng.random() < 0.25 else 1)
    unit = rng.choice(("celsius", "fahrenheit"))
    where = " and ".join(cities)
    request = rng.choice((
        f"What's the weather in {where} in {unit}?", f"How warm is it in {where}? Use {unit}.",
        f"Tell me the current weather for {where} ({unit}).",
        f"Is it cold in {where} right now? Answer in {unit}."))
    calls = [("get_weather", {"city": c, "unit": unit}) for c in cities]
    think = (f"The user wants the weather in {where} in {unit}. I should call get_weather "
             + ("for each city." if len(cities) > 1 else f"with city {cities[0]} and unit {unit}."))
    results, lines = [], []
    for c in cities:
        t = rng.randint(-10, 35) if unit == "celsius" else rng.randint(14, 95)
        cond = rng.choice(CONDITIONS)
        results.append(json.dumps({"city": c, "temperature": t, "unit": unit, "condition": cond}))
        sign = "°C" if unit == "celsius" else "°F"
        lines.append(f"{c}: {t}{sign} and {cond}")
    after = "The tool returned the current conditions, so I can answer."
    answer = ("It is " + lines[0].split(": ", 1)[1] + " in " + cities[0] + " right now."
              if len(cities) == 1 else "Current weather:\n" + "\n".join(f"- {x}" for x in lines))
    return request, calls, think, results, after, answer


def add_request(rng: random.Random):
    a, b = _number(rng), _number(rng)
    request = rng.choice((f"What is {_fmt(a)} plus {_fmt(b)}?", f"Add {_fmt(a)} and {_fmt(b)}.",
                          f"Use the calculator to add {_fmt(a)} to {_fmt(b)}.",
                          f"Compute {_fmt(a)} + {_fmt(b)} with the add tool."))
    total = round(a + b, 1) if isinstance(a, float) or isinstance(b, float) else a + b
    think = (f"The user wants {_fmt(a)} + {_fmt(b)}. I will call add with a={_fmt(a)} and "
             f"b={_fmt(b)}.")
    return (request, [("add", {"a": a, "b": b})], think, [json.dumps(total)],
            f"The tool returned {_fmt(total)}.", f"{_fmt(a)} plus {_fmt(b)} is {_fmt(total)}.")


def search_request(rng: random.Random):
    topic, limit = rng.choice(TOPICS), rng.randint(1, 5)
    request = rng.choice((f"Search for {topic}, give me {limit} results.",
                          f"Find {limit} links about {topic}.",
                          f"Look up {topic} and show the top {limit}."))
    think = f"The user wants {limit} search results about {topic}. I will call search."
    hits = [{"title": f"{topic.capitalize()} - part {i + 1}",
             "url": f"https://example.com/{topic.replace(' ', '-')}/{i + 1}"} for i in range(limit)]
    answer = f"Here are the top {limit} results for \"{topic}\":\n" + "\n".join(
        f"{i + 1}. {h['title']} ({h['url']})" for i, h in enumerate(hits))
    return (request, [("search", {"limit": limit, "query": topic})], think, [json.dumps(hits)],
            f"The search returned {limit} results.", answer)


REQUESTS = {"get_weather": weather_request, "add": add_request, "search": search_request}


def tool_examples(rng: random.Random) -> list[Example]:
    """A request that needs a tool: the call turn, then the answer after the results."""
    needed = rng.choice(sorted(REQUESTS))
    names = sorted({needed, *rng.sample(sorted(TOOLS), rng.randint(0, len(TOOLS) - 1))})
    rng.shuffle(names)
    tools = [TOOLS[n] for n in names]
    request, calls, think, results, after, answer = REQUESTS[needed](rng)
    messages = _system(rng) + [{"role": "user", "content": request}]
    first = Example(prompt_text(messages, tools), reasoning(think) + calls_text(calls),
                    "tool_call")
    ids = [f"call_{rng.randrange(16 ** 8):08x}" for _ in calls]
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in zip(ids, calls)]})
    messages += [{"role": "tool", "tool_call_id": i, "content": r} for i, r in zip(ids, results)]
    second = Example(prompt_text(messages, tools), reasoning(after) + final(answer),
                     "tool_answer")
    return [first, second]


def dialogues(n: int, seed: int, tool_share: float = 0.5) -> list[Example]:
    """`n` dialogues' examples, reproducible from `seed`: about `tool_share` of them need a
    tool; a tenth of the coding requests come with tools declared (and answer without one)."""
    rng = random.Random(seed)
    out: list[Example] = []
    for _ in range(n):
        if rng.random() < tool_share:
            out += tool_examples(rng)
        else:
            declared = [TOOLS[k] for k in sorted(TOOLS)] if rng.random() < 0.1 else None
            out.append(coding_example(rng, declared))
    return out
