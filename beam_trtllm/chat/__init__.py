"""Beam's chat format served through the OpenAI API: the chat template and safe prompt
tokenization (template.py), the streaming response parser (parser.py), JSON-schema typing of
tool arguments (tools.py), the output grammars (grammar.py) and Dynamo's frontend processor
(processor.py). docs/CHAT.md."""
