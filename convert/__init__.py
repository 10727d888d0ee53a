"""beam-trt's converter: unquantized Beam checkpoint -> ModelOpt-format FP8 / NVFP4 (or TRT-LLM rank
files), streamed, calibrated layer by layer, resumable and verified. See docs/CONVERT.md."""

from .errors import ConvertError

__all__ = ["ConvertError", "convert", "ConvertOptions", "dequant", "verify"]


def __getattr__(name):  # keep `import convert` light: torch-heavy parts load on first use
    if name in ("convert", "ConvertOptions"):
        from . import pipeline

        return getattr(pipeline, name)
    if name == "dequant":
        from .dequantize import dequant

        return dequant
    if name == "verify":
        from .verification import verify

        return verify
    raise AttributeError(name)
