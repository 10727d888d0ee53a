"""Beam's chat format in one place: its special tokens, the prompt-side chat template (Jinja,
as tokenizer_config.json carries it) and the `response_template` metadata vLLM's and SGLang's
`beam` parsers read (shared/research/beam-response-format.md §2-3, docs/CHAT.md).

A turn the model writes, after a prompt that ends with `<|start|>assistant`:

    [<|channel|>analysis<|message|>REASONING<|end|><|start|>assistant]
    <|channel|>final<|message|>ANSWER<|return|>
    | CALL (<|end|><|start|>assistant CALL)* <|call|>
    CALL  = ' to=NAME<|channel|>analysis <|constrain|>xml<|message|>' PARAM ('\\n' PARAM)*
    PARAM = '<rfl:parameter name="KEY">\\nVALUE\\n</rfl:parameter>'
"""

from __future__ import annotations

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
BEAM_SPECIAL_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)

ASSISTANT_START = START + "assistant"
THINKING_OPEN = CHANNEL + "analysis" + MESSAGE
THINKING_CLOSE = END + ASSISTANT_START
CONTENT_OPEN = CHANNEL + "final" + MESSAGE
CONTENT_CLOSE = (RETURN, END, CALL)
CALL_CLOSE = (THINKING_CLOSE, CALL)
CALL_HEAD_TAIL = CHANNEL + "analysis " + CONSTRAIN + "xml" + MESSAGE  # after ' to=NAME'
PARAM_OPEN = '<rfl:parameter name="{key}">\n'
PARAM_CLOSE = "\n</rfl:parameter>"
PARAM_SEPARATOR = "\n"


def call_head(name: str) -> str:
    return " to=" + name + CALL_HEAD_TAIL


def param_text(key: str, value: str) -> str:
    return PARAM_OPEN.format(key=key) + value + PARAM_CLOSE


def response_template() -> dict:
    """The `response_template` metadata (schema version 1) of tokenizer_config.json."""
    return {
        "version": 1,
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": r"<\|start\|>assistant",
        "fields": {
            "thinking": {"open": THINKING_OPEN, "close": THINKING_CLOSE, "content": "text"},
            "content": {"open": CONTENT_OPEN, "close": list(CONTENT_CLOSE), "content": "text"},
            "tool_calls": {
                "open_pattern": r" to=(?P<name>[^\s<]+)<\|channel\|>analysis "
                                r"<\|constrain\|>xml<\|message\|>",
                "close": list(CALL_CLOSE),
                "repeats": True,
                "content": "xml-inline",
                "content_args": {
                    "tag_pattern": r'<rfl:parameter name="(?P<key>[^"]+)">\n(?P<value>.*?)\n'
                                   r'(?:</rfl:parameter>|(?=<rfl:parameter name="))',
                    "value": {"content": "text", "strip": False},
                },
                "transform": {"type": "function",
                              "function": {"name": "{name}", "arguments": "{content}"}},
            },
        },
    }


# Pinned by BEAM_SPEC.md: `<|start|>{role}<|message|>{content}<|end|>` per message; tools
# declared as JSON in a developer message after the leading system message; a tool result as
# `<|start|>functions.{name} to=assistant<|message|>{result}<|end|>`; prior calls in the output
# format; prior reasoning dropped. enable_thinking is applied by the output grammar (the prompt
# always ends at `<|start|>assistant`, the parsers' start anchor).
_TEMPLATE = r"""
{#- Every literal goes through an expression, so the result is the same with or without
    trim_blocks / lstrip_blocks. -#}
{%- macro plain(role, content) -%}
{{- '<|start|>' + role + '<|message|>' + content + '<|end|>' -}}
{%- endmacro -%}
{%- set first = 1 if messages and messages[0].role == 'system' else 0 -%}
{%- if first -%}{{- plain('system', messages[0].content) -}}{%- endif -%}
{%- if tools -%}
{{- '<|start|>developer<|message|># Tools' -}}
{%- for tool in tools -%}{{- '\n' + tool | tojson -}}{%- endfor -%}
{{- '<|end|>' -}}
{%- endif -%}
{%- for message in messages[first:] -%}
{%- if message.role == 'assistant' -%}
{%- if message.content -%}
{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' -}}
{%- endif -%}
{%- for call in message.tool_calls or [] -%}
{{- '<|start|>assistant' if loop.first else '<|end|><|start|>assistant' -}}
{{- ' to=' + call.function.name + '<|channel|>analysis <|constrain|>xml<|message|>' -}}
{%- for key, value in call.function.arguments.items() -%}
{{- ('\n' if not loop.first else '') + '<rfl:parameter name="' + key + '">\n' -}}
{{- (value if value is string else value | tojson) + '\n</rfl:parameter>' -}}
{%- endfor -%}
{{- '<|call|>' if loop.last else '' -}}
{%- endfor -%}
{%- elif message.role == 'tool' -%}
{%- set ns = namespace(name=message.name or '') -%}
{%- for m in messages -%}{%- for call in m.tool_calls or [] -%}
{%- if call.id and call.id == message.tool_call_id -%}{%- set ns.name = call.function.name -%}{%- endif -%}
{%- endfor -%}{%- endfor -%}
{{- '<|start|>functions.' + ns.name + ' to=assistant<|message|>' + message.content + '<|end|>' -}}
{%- else -%}
{{- plain(message.role, message.content) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
"""


def chat_template() -> str:
    return _TEMPLATE.strip("\n")
