"""`verify --against`'s per-tensor statistics, compiled (numba): one pass over the stored codes
and the input weight, no full-size temporaries.

For a quantized Linear with input weight W (BF16, or FP32 / FP16 as stored) and decoded weight
D (the decode of `beam_trtllm.quant_formats`, ModelOpt's order of products in FP32):

    NVFP4:      D = E2M1[code] * (fp32(e4m3 block scale) * weight_scale_2)
    FP8:        D = fp32(e4m3 code) * weight_scale          (0-d: per tensor)
    FP8 block:  D = fp32(e4m3 code) * weight_scale[n // 128, k // 128]

`error_stats` returns sum (D - W)^2, sum W^2 (FP64 sums), max |D - W|, the number of
non-finite decoded values (a NaN / inf code or scale) and of non-finite input values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from beam_trtllm import quant_formats as qf

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency of the `convert` extra
    numba = None

_E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
E4M3_VALUES = _E4M3.float().numpy()
E2M1_VALUES = np.array(qf.E2M1_VALUES, np.float32)


@dataclass
class ErrorStats:
    sq_err: float
    sq_ref: float
    max_abs: float
    bad_decoded: int  # non-finite decoded values
    bad_input: int  # non-finite input values

    @property
    def rel(self) -> float:
        return (self.sq_err ** 0.5) / max(self.sq_ref ** 0.5, 1e-30)


if numba is not None:
    _F32 = np.float32

    @numba.njit(nogil=True, cache=True, inline="always")
    def _load_row(ref, r, bf16, x, wide):
        for j in range(ref.shape[1]):
            if bf16:
                wide[j] = np.uint32(np.uint16(ref[r, j])) << 16
            else:
                x[j] = np.float32(ref[r, j])

    @numba.njit(nogil=True, cache=True)
    def _row_buffers(k):
        """A row's buffers: the reference row (`wide` as bits, `x` its FP32 view), the decoded
        row `d`, and the accumulator of `_accumulate`."""
        wide = np.empty(k, np.uint32)
        return wide, wide.view(np.float32), np.empty(k, np.float32), np.zeros(5, np.float64)

    @numba.njit(nogil=True, cache=True, fastmath={"reassoc", "nsz"})
    def _row_sums(d, x):
        """FP32 sums of one row, reassociated so they vectorise; non-finite when anything is."""
        se, sr, mx = _F32(0.0), _F32(0.0), _F32(0.0)
        for j in range(x.shape[0]):
            e = d[j] - x[j]
            se += e * e
            sr += x[j] * x[j]
            a = abs(e)
            mx = a if a > mx else mx
        return se, sr, mx

    @numba.njit(nogil=True, cache=True)
    def _accumulate(d, x, acc):
        """acc = [sq_err, sq_ref, max_abs, bad_decoded, bad_input] (float64)."""
        se, sr, mx = _row_sums(d, x)
        if np.isfinite(se) and np.isfinite(sr):
            acc[0] += se
            acc[1] += sr
            acc[2] = max(acc[2], np.float64(mx))
            return
        for j in range(x.shape[0]):  # a NaN / inf (or an FP32 overflow) in this row: per element
            w = x[j]
            if not np.isfinite(w):
                acc[4] += 1.0
                continue
            v = d[j]
            if not np.isfinite(v):
                acc[3] += 1.0
                continue
            e = np.float64(v) - np.float64(w)
            acc[0] += e * e
            acc[1] += np.float64(w) * np.float64(w)
            acc[2] = max(acc[2], abs(e))

    @numba.njit(nogil=True, cache=True)
    def _nvfp4_stats(packed, scales, scale_2, ref, bf16, e4m3, e2m1):
        n, k = ref.shape
        wide, x, d, acc = _row_buffers(k)
        for r in range(n):
            _load_row(ref, r, bf16, x, wide)
            for b in range(k // 16):
                s = e4m3[scales[r, b]] * scale_2
                for t in range(8):
                    byte = packed[r, b * 8 + t]
                    d[b * 16 + 2 * t] = e2m1[byte & 0xF] * s
                    d[b * 16 + 2 * t + 1] = e2m1[byte >> 4] * s
            _accumulate(d, x, acc)
        return acc

    @numba.njit(nogil=True, cache=True)
    def _fp8_stats(codes, scale, ref, bf16, e4m3):
        """scale: [nb, kb] FP32 (one entry [1, 1] for per-tensor: every row and column maps to
        it through the integer division below when nb = kb = 1 and the block is the tensor)."""
        n, k = ref.shape
        per_tensor = scale.shape[0] == 1 and scale.shape[1] == 1
        wide, x, d, acc = _row_buffers(k)
        for r in range(n):
            _load_row(ref, r, bf16, x, wide)
            if per_tensor:
                s = scale[0, 0]
                for j in range(k):
                    d[j] = e4m3[codes[r, j]] * s
            else:
                for j in range(k):
                    d[j] = e4m3[codes[r, j]] * scale[r // 128, j // 128]
            _accumulate(d, x, acc)
        return acc


def _ref_array(ref: torch.Tensor) -> tuple[np.ndarray, bool]:
    if ref.dtype == torch.bfloat16:
        return ref.contiguous().view(torch.int16).numpy(), True
    return ref.float().contiguous().numpy(), False


def error_stats(stored: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | None,
                ref: torch.Tensor) -> ErrorStats:
    """Statistics of the decode of (stored, scale[, scale_2]) against the input weight `ref`."""
    if numba is None or (stored.dtype != torch.uint8 and scale.dim() == 1):
        return _torch_stats(stored, scale, scale_2, ref)
    r, bf16 = _ref_array(ref)
    if stored.dtype == torch.uint8:  # NVFP4
        codes = scale.contiguous().view(torch.uint8).numpy()
        acc = _nvfp4_stats(stored.contiguous().numpy(), codes, np.float32(scale_2.float().item()),
                           r, bf16, E4M3_VALUES, E2M1_VALUES)
    else:
        s = qf.fp8_block_scale_2d(scale).float()
        if s.dim() == 0:
            s = s.reshape(1, 1)
        acc = _fp8_stats(stored.contiguous().view(torch.uint8).numpy(), s.contiguous().numpy(), r,
                         bf16, E4M3_VALUES)
    return ErrorStats(float(acc[0]), float(acc[1]), float(acc[2]), int(acc[3]), int(acc[4]))


def _torch_stats(stored, scale, scale_2, ref) -> ErrorStats:
    """The same statistics with torch ops (no numba, or a per-row FP8 scale)."""
    if stored.dtype == torch.uint8:
        deq = qf.dequantize_nvfp4(stored, scale, scale_2, torch.float64)
    else:
        deq = qf.dequantize_fp8(stored, scale, torch.float32).double()
    w = ref.double()
    bad_in = ~torch.isfinite(w)
    bad_deq = ~torch.isfinite(deq) & ~bad_in
    ok = ~(bad_in | bad_deq)
    err = torch.where(ok, deq - w, 0.0)
    ref_ok = torch.where(ok, w, 0.0)
    return ErrorStats(float((err * err).sum()), float((ref_ok * ref_ok).sum()),
                      float(err.abs().max()) if err.numel() else 0.0, int(bad_deq.sum()),
                      int(bad_in.sum()))
