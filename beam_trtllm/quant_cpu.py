"""Fast CPU encoders for the converter: NVFP4 and the BF16 amax, compiled with numba.

Same math as `quant_formats.quantize_nvfp4` (ModelOpt's `NVFP4QTensor.quantize`) step by step in
IEEE FP32, so the bytes are identical (tests/test_convert_encoders.py checks it against ModelOpt
on awkward shapes and on values placed on every rounding boundary):

    per block of 16:  s  = fp32(amax_block) / fp32(6 * scale_2)     (0 -> 1.0, clamp [2^-9, 448])
                      s8 = e4m3(s), round to nearest even            (bit arithmetic below)
                      d  = float(s8) * scale_2                       (FP32 product)
    per element:      q  = fp32(x) / d ; code = RNE-to-E2M1(|q|) | (q < 0) << 3

One pass over the BF16 input, 16 lanes a block (an AVX-512 vector), rows split across threads
that release the GIL. The torch version makes ~12 full-size temporaries and runs at ~20 MB/s per
core; this runs at ~400 MB/s per core (bench/convert_bench.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency of the `convert` extra
    numba = None

ROWS_PER_TASK = 128  # ~1 MB of BF16 per task for Beam's 5120x2560 experts: fits L2


def available() -> bool:
    return numba is not None


if numba is not None:
    _F32 = np.float32

    @numba.njit(nogil=True, cache=True, inline="always")
    def _e4m3_code(x):
        """Positive x in [2^-9, 448] -> e4m3fn byte, round to nearest even (as c10 does)."""
        if x < _F32(0.015625):  # below 2^-6: subnormal, a multiple of 2^-9
            return np.uint8(np.int32(np.rint(x * _F32(512.0))))
        bits = np.int32(np.array([x], dtype=np.float32).view(np.int32)[0])
        # keep 3 mantissa bits: add half an ulp (minus one when the kept lsb is even)
        rounded = (bits + np.int32(0x7FFFF) + ((bits >> 20) & 1)) >> 20
        return np.uint8(rounded - (120 << 3))  # re-bias the exponent: 127 -> 7

    @numba.njit(nogil=True, cache=True)
    def _nvfp4_rows(w16, r0, r1, scale_2, e4m3_values, packed, scales):
        k = w16.shape[1]
        six_scale_2 = _F32(6.0) * scale_2
        wide = np.empty(k, dtype=np.uint32)
        x = wide.view(np.float32)
        codes = np.empty(16, dtype=np.uint8)
        for r in range(r0, r1):
            for j in range(k):  # BF16 -> FP32 is a 16-bit shift
                wide[j] = np.uint32(np.uint16(w16[r, j])) << 16
            for b in range(k // 16):
                amax = _F32(0.0)
                for t in range(16):
                    amax = max(amax, abs(x[b * 16 + t]))
                s = amax / six_scale_2
                if s == _F32(0.0):
                    s = _F32(1.0)
                s = min(max(s, _F32(0.001953125)), _F32(448.0))
                code8 = _e4m3_code(s)
                scales[r, b] = code8
                d = e4m3_values[code8] * scale_2
                for t in range(16):
                    q = x[b * 16 + t] / d
                    a = abs(q)
                    # searchsorted(left) over the E2M1 bounds, ties at 0.75/1.75/3.5 round up
                    m = (np.uint8(a > _F32(0.25)) + np.uint8(a >= _F32(0.75))
                         + np.uint8(a > _F32(1.25)) + np.uint8(a >= _F32(1.75))
                         + np.uint8(a > _F32(2.5)) + np.uint8(a >= _F32(3.5))
                         + np.uint8(a > _F32(5.0)))
                    codes[t] = m | (np.uint8(q < _F32(0.0)) << 3)
                for t in range(8):  # even element -> low nibble
                    packed[r, b * 8 + t] = codes[2 * t] | (codes[2 * t + 1] << 4)

    @numba.njit(nogil=True, cache=True)
    def _bf16_abs_max_bits(w16, r0, r1):
        """max of (bits & 0x7fff) over rows: BF16 magnitudes order like their bit patterns."""
        best = 0
        for r in range(r0, r1):
            for j in range(w16.shape[1]):
                m = np.int32(w16[r, j]) & 0x7FFF
                if m > best:
                    best = m
        return best


_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0


def _pool(threads: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_SIZE
    if _POOL is None or _POOL_SIZE != threads:
        if _POOL is not None:
            _POOL.shutdown(wait=True)
        _POOL, _POOL_SIZE = ThreadPoolExecutor(threads, thread_name_prefix="beam-quant"), threads
    return _POOL


def _row_tasks(rows: int, threads: int):
    step = ROWS_PER_TASK if rows >= ROWS_PER_TASK * threads else max(1, -(-rows // threads))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _run(fn, rows, threads):
    tasks = _row_tasks(rows, threads)
    if threads <= 1 or len(tasks) == 1:
        return [fn(r0, r1) for r0, r1 in tasks]
    return list(_pool(threads).map(lambda t: fn(*t), tasks))


def _as_rows(weight: torch.Tensor) -> np.ndarray:
    return weight.reshape(-1, weight.shape[-1]).contiguous().view(torch.int16).numpy()


def bf16_abs_max(weight: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """amax |weight| of a BF16 CPU tensor as FP32 [] (NaN/inf come out as such)."""
    w16 = _as_rows(weight)
    best = max(_run(lambda r0, r1: _bf16_abs_max_bits(w16, r0, r1), w16.shape[0], threads))
    bits = torch.tensor([best], dtype=torch.int16).view(torch.bfloat16)
    return bits.float().reshape(())


_E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
_E4M3_VALUES = _E4M3_VALUES.float().numpy()


def quantize_nvfp4(weight: torch.Tensor, weight_scale_2: torch.Tensor, threads: int = 1):
    """BF16 CPU [..., K] (K % 16 == 0) -> (packed uint8 [..., K/2], scale e4m3 [..., K/16])."""
    shape = weight.shape
    w16 = _as_rows(weight)
    rows, k = w16.shape
    packed = np.empty((rows, k // 2), np.uint8)
    scales = np.empty((rows, k // 16), np.uint8)
    s2 = np.float32(weight_scale_2.float().item())
    _run(lambda r0, r1: _nvfp4_rows(w16, r0, r1, s2, _E4M3_VALUES, packed, scales), rows, threads)
    packed_t = torch.from_numpy(packed).reshape(*shape[:-1], k // 2)
    scale_t = torch.from_numpy(scales).view(torch.float8_e4m3fn).reshape(*shape[:-1], k // 16)
    return packed_t, scale_t
