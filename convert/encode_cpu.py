"""The converter's compiled CPU paths (numba) for FP8 128x128 blocks: encode, and the error
statistics `verify --against` computes for every quantized Linear.

`quantize_fp8_block` gives the bytes of ModelOpt 0.47's `fp8_pb_wo` export (FP8QTensor.quantize
with the weight quantizer's exported amax), step by step in IEEE FP32:

    per 128x128 block:  a = amax |W| over the block (BF16, exact)
                        a = 448 if a == 0;  a = max(a, FLT_MIN)     (TensorQuantizer.export_amax:
                                                                      zero -> maxbound, clamp)
                        s = fp32(a) / fp32(448)
    per element:        code = e4m3fn(fp32(x) / s)                  (c10's round-to-nearest-even,
                                                                      |q| >= 480 -> NaN 0x7f)

One band of 128 rows at a time (1.3 MB of BF16 for K = 5120, so both passes run from L2), no
full-size FP32 temporary; `torch.float8_e4m3fn` casts give the same codes
(tests/test_convert_encoders.py checks it against ModelOpt on awkward shapes and zero blocks).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .st_io import byte_buffer

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency of the `convert` extra
    numba = None

BLOCK = 128
FP8_MAX = np.float32(448.0)
FLT_MIN = np.float32(np.finfo(np.float32).tiny)


def available() -> bool:
    return numba is not None


if numba is not None:
    _F32 = np.float32

    @numba.njit(nogil=True, cache=True)
    def _e4m3fn_row(q, qbits, out):
        """fp32 q (and its bit patterns) -> float8_e4m3fn bytes, as c10::Float8_e4m3fn(q):
        |q| >= 480 (or NaN) -> NaN 0x7f; below 2^-6 a multiple of 2^-9, round to nearest even;
        else keep 3 mantissa bits, nearest even. Branch-free (selects), so that it vectorises."""
        for j in range(q.shape[0]):
            bits = np.int32(qbits[j])
            mag = bits & 0x7FFFFFFF
            normal = (mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
            sub = np.int32(np.rint(abs(q[j]) * _F32(512.0)))
            code = sub if mag < 121 << 23 else normal
            code = 0x7F if mag >= 1087 << 20 else code
            out[j] = np.uint8(code | ((bits >> 24) & 0x80))

    @numba.njit(nogil=True, cache=True)
    def _band_amax_bits(w16, r0, r1, kb):
        """Per 128-column block of rows [r0, r1): max of |BF16| as its bit pattern (BF16
        magnitudes order like their bits; a NaN sorts above inf)."""
        k = w16.shape[1]
        best = np.zeros(kb, np.int32)
        for r in range(r0, r1):
            for b in range(kb):
                m = best[b]
                for j in range(b * 128, min(k, b * 128 + 128)):
                    v = np.int32(w16[r, j]) & 0x7FFF
                    if v > m:
                        m = v
                best[b] = m
        return best

    @numba.njit(nogil=True, cache=True)
    def _fp8_block_bands(w16, b0, b1, scales, given, out):
        """Bands b0..b1-1 of 128 rows: block scales (unless `given`), then the FP8 codes.
        Returns the largest |BF16| bit pattern seen (>= 0x7f80: inf or NaN) when not `given`."""
        n, k = w16.shape
        worst = 0
        kb = scales.shape[1]
        wide = np.empty(k, np.uint32)
        x = wide.view(np.float32)
        q = np.empty(k, np.float32)
        qbits = q.view(np.uint32)
        for band in range(b0, b1):
            r0, r1 = band * 128, min(n, band * 128 + 128)
            if not given:
                bits = _band_amax_bits(w16, r0, r1, kb)
                worst = max(worst, bits.max())
                if worst >= 0x7F80:
                    return worst
                for b in range(kb):
                    a = np.array([np.uint32(bits[b]) << 16], np.uint32).view(np.float32)[0]
                    if a == _F32(0.0):
                        a = _F32(448.0)
                    a = max(a, _F32(1.1754944e-38))
                    scales[band, b] = a / _F32(448.0)
            for r in range(r0, r1):
                for j in range(k):
                    wide[j] = np.uint32(np.uint16(w16[r, j])) << 16
                for b in range(kb):
                    s = scales[band, b]
                    for j in range(b * 128, min(k, b * 128 + 128)):
                        q[j] = x[j] / s
                _e4m3fn_row(q, qbits, out[r])
        return worst


def _rows(weight: torch.Tensor) -> np.ndarray:
    return weight.contiguous().view(torch.int16).numpy()


class NonFinite(ValueError):
    """The weight holds inf or NaN values."""


def _bands(fn, nb: int, threads: int) -> list:
    if threads <= 1 or nb < 2:
        return [fn(0, nb)]
    step = -(-nb // threads)
    with ThreadPoolExecutor(threads, thread_name_prefix="beam-fp8-block") as pool:
        return list(pool.map(lambda b0: fn(b0, min(nb, b0 + step)), range(0, nb, step)))


def quantize_fp8_block(weight: torch.Tensor, block_amax: torch.Tensor | None = None,
                       threads: int = 1):
    """BF16 CPU [N, K] -> (fp8 [N, K], fp32 scale [ceil(N/128), ceil(K/128)]), the bytes of
    ModelOpt's fp8_pb_wo export. `block_amax` (fused one-block groups: the shared max) replaces
    the per-block amax; it is sanitised the same way (zero -> 448, at least FLT_MIN). Raises
    NonFinite for a weight holding inf or NaN (checked on the block amax, no extra pass)."""
    n, k = weight.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    scales = np.empty((nb, kb), np.float32)
    given = block_amax is not None
    if given:
        a = block_amax.float().reshape(nb, kb).clone()
        a[a == 0] = float(FP8_MAX)
        scales[:] = (a.clamp_min(float(FLT_MIN)) / float(FP8_MAX)).numpy()
    out = byte_buffer(n * k).numpy().reshape(n, k)
    w16 = _rows(weight)
    worst = max(_bands(lambda b0, b1: _fp8_block_bands(w16, b0, b1, scales, given, out), nb,
                       threads))
    if worst >= 0x7F80:
        raise NonFinite("inf or NaN")
    q = torch.from_numpy(out).view(torch.float8_e4m3fn)
    return q, torch.from_numpy(scales)
