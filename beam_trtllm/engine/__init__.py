"""The Beam runtime: KV cache manager, scheduler, sampler, model execution through the
`beam::` ops, and the `Engine` API (docs/DESIGN.md §3-§4, docs/ENGINE.md)."""

from .types import (  # noqa: F401
    EngineError, KVCapacityError, KVHandle, KVUsage, LayerKV, RequestOutput, SamplingParams,
    StoredBlock, TokenLogprobs,
)


def __getattr__(name):
    # Engine pulls in torch ops; keep `import beam_trtllm.engine` light for the CLI.
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "build_engine":
        from .build import build_engine

        return build_engine
    raise AttributeError(name)
