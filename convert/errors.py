"""The converter's error type: one clear message naming the file, tensor, field or flag."""

from __future__ import annotations


class ConvertError(ValueError):
    """A bad input or a failed step of `beam-trt convert` / `verify`; the CLI prints it as is."""
