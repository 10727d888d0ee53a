"""`python -m beam_trtllm.chat.frontend [dynamo.frontend's flags]`: Dynamo 1.6.1's frontend
with Beam's chat processor (processor.py) in its Python chat-processor hook.

Dynamo's frontend builds its `chat_engine_factory` in `setup_sglang_engine_factory` when
started with `--dyn-chat-processor sglang` (SGLang itself is only imported inside that
function); pointing that function at Beam's factory keeps every other part of the frontend
(HTTP server, KV router, prefill router, metrics) Dynamo's own. /v1/completions stays on
Dynamo's Rust path.
"""

from __future__ import annotations

import sys


def main() -> None:
    import dynamo.frontend.main as frontend

    from .processor import BeamEngineFactory

    if any(a.startswith("--dyn-chat-processor") for a in sys.argv[1:]):
        sys.exit("beam_trtllm.chat.frontend sets --dyn-chat-processor itself; drop the flag")
    frontend.setup_sglang_engine_factory = lambda config, flags=None: BeamEngineFactory()
    sys.argv[1:] = ["--dyn-chat-processor", "sglang", *sys.argv[1:]]
    frontend.main()


if __name__ == "__main__":
    main()
