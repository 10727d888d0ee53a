"""Errors of the TensorRT-LLM adapter. Each message names the tensor, field, flag or package."""

from __future__ import annotations

import importlib.util


class TrtllmAdapterError(ValueError):
    """Bad input to the adapter (a checkpoint tensor, a serving option, an engine-args field)."""


class WeightMappingError(TrtllmAdapterError):
    """A checkpoint tensor that cannot be mapped onto the TRT-LLM model; names the tensor."""


class LlmArgsError(TrtllmAdapterError):
    """Serving options or engine args that TRT-LLM would mis-serve Beam with; names the field."""


class MissingPackageError(ImportError):
    """An optional package (TensorRT-LLM, Dynamo's TRT-LLM backend) is not installed."""


def require(package: str, needed_by: str, hint: str) -> None:
    """Raise one MissingPackageError naming `package` when it cannot be imported.

    `importlib.util.find_spec` looks the package up without importing it, so the check is cheap
    and never half-imports a broken install."""
    top = package.split(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None and (
            top == package or importlib.util.find_spec(package) is not None)
    except (ImportError, ValueError):  # a parent package that fails to import, or no __spec__
        found = False
    if not found:
        raise MissingPackageError(
            f"{needed_by} needs the Python package '{package}', which is not installed. {hint}")


TRTLLM_HINT = ("Run it inside a TensorRT-LLM environment (e.g. the NGC TensorRT-LLM release "
               "container or Dynamo's tensorrtllm-runtime image); see docs/TRTLLM.md.")
