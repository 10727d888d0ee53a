"""Input checks shared by the moe_* and linear_* ops: one clear PluginError naming the op and
the tensor."""

from __future__ import annotations

import torch

from .registry import PluginError

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_CODES = (torch.float8_e4m3fn,)


def _expect(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise PluginError(f"beam::{op}: {msg}")


def check_tensor(op: str, name: str, t: torch.Tensor, shape: tuple, dtypes: tuple) -> None:
    """`shape` entries of None match any size. Messages are formatted only on failure."""
    _expect(isinstance(t, torch.Tensor), op, f"{name} must be a tensor")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        _expect(False, op, f"{name} has shape {list(t.shape)}, expected {want}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        _expect(False, op, f"{name} has dtype {t.dtype}, expected one of {names}")


def check_linear_x(op: str, x: torch.Tensor, k: int, dtypes: tuple = ACT_DTYPES) -> None:
    check_tensor(op, "x", x, (None,) * max(x.dim(), 1), dtypes)
    _expect(x.dim() >= 1 and x.shape[-1] == k, op, f"x has shape {list(x.shape)}, expected [..., {k}]")


def check_device(op: str, x: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        _expect(t.device == x.device, op, f"{name} is on {t.device}, x on {x.device}")


def check_out_dtype(op: str, x: torch.Tensor, out_dtype) -> torch.dtype:
    """-> the output dtype of an FP8 W8A8 op: x's for a floating x (out_dtype None or equal),
    out_dtype (required, an activation dtype) when x holds FP8 codes already."""
    if x.dtype in FP8_CODES:
        _expect(out_dtype in ACT_DTYPES, op, f"x holds FP8 codes: out_dtype must be one of "
                f"bfloat16, float16, float32, got {out_dtype}")
        return out_dtype
    _expect(out_dtype in (None, x.dtype), op,
            f"out_dtype {out_dtype} differs from x's dtype {x.dtype}")
    return x.dtype
