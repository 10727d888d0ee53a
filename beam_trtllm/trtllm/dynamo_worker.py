"""`python -m beam_trtllm.trtllm.dynamo_worker <dynamo.trtllm arguments>`: Dynamo's TRT-LLM
worker with Beam registered.

Dynamo's `python -m dynamo.trtllm` has no `--custom_module_dirs`; this wrapper imports the Beam
model module (which registers BeamForCausalLM and its weight mapper in this
process) and then runs `dynamo.trtllm` exactly as `python -m` would, with the same arguments.
"""

from __future__ import annotations

import runpy
import sys

from .errors import TRTLLM_HINT, MissingPackageError, require

WORKER = "python -m beam_trtllm.trtllm.dynamo_worker"
DYNAMO_HINT = ("Install Dynamo's TensorRT-LLM backend (ai-dynamo with its 'trtllm' extra) or use "
               "Dynamo's tensorrtllm-runtime image; see docs/TRTLLM.md.")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        require("tensorrt_llm", WORKER, TRTLLM_HINT)
        require("dynamo.trtllm", WORKER, DYNAMO_HINT)
    except MissingPackageError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    import beam_trtllm.trtllm.modeling_beam  # noqa: F401  (registers Beam with TRT-LLM)

    sys.argv = ["dynamo.trtllm", *args]  # what Dynamo's argument parser reads
    runpy.run_module("dynamo.trtllm", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
