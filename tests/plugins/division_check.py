"""Compare plugins._common.div_rn_by (the FP8 quantizers' division) with Triton's div_rn on a
GPU, element by element: used by test_norms' CUDA test (16e9 pairs on the H200, 2026-11-29:
docs/benchmarks-history.md "Norms, the FP8 quantizer and the router"). In the interpreter div_rn_by is div_rn itself, so the comparison means nothing there."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins._common import div_rn_by, to_e4m3

FP32_NORMAL_MIN = 2.0**-126


@triton.jit
def _division_pairs_kernel(x_ptr, s_ptr, exact_ptr, fast_ptr, exact_q_ptr, fast_q_ptr, n,
                           BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=1.0)
    s = tl.load(s_ptr + offs, mask=mask, other=1.0)
    exact, fast = tl.div_rn(x, s), div_rn_by(x, s)
    tl.store(exact_ptr + offs, exact, mask=mask)
    tl.store(fast_ptr + offs, fast, mask=mask)
    tl.store(exact_q_ptr + offs, to_e4m3(exact), mask=mask)
    tl.store(fast_q_ptr + offs, to_e4m3(fast), mask=mask)


def division_mismatches(x: torch.Tensor, s: torch.Tensor) -> dict[str, int]:
    """Counts over the pairs (x[i], s[i]) (FP32, on a GPU): `normal`: quotients that div_rn
    makes a normal FP32 where div_rn_by's bits differ; `other`: the same among subnormal, zero,
    infinite or NaN quotients (NaN compared as NaN); `codes`: differing FP8 codes of the two."""
    exact, fast = torch.empty_like(x), torch.empty_like(x)
    exact_q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    fast_q = torch.empty_like(exact_q)
    n, block = x.numel(), 1024
    _division_pairs_kernel[(triton.cdiv(n, block),)](x, s, exact, fast, exact_q, fast_q, n,
                                                     BLOCK=block)
    differ = exact.view(torch.int32) != fast.view(torch.int32)
    differ &= ~(exact.isnan() & fast.isnan())
    normal = exact.abs().ge(FP32_NORMAL_MIN) & exact.isfinite()
    return {"normal": int((differ & normal).sum()), "other": int((differ & ~normal).sum()),
            "codes": int((exact_q.view(torch.uint8) != fast_q.view(torch.uint8)).sum())}


def random_pairs(n: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """x: random FP32 bit patterns (every exponent, NaN and inf included) for a quarter, the
    rest activation-like values of random magnitude; s: log-uniform scales over 2^-40..2^40,
    a quarter of them with an all-ones significand (the hard divisors for a reciprocal)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bits = torch.randint(-2**31, 2**31, (n,), generator=gen, device=device, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    mag = torch.exp2(torch.rand(n, generator=gen, device=device) * 60 - 30)
    x = torch.where(torch.arange(n, device=device) % 4 == 0, x,
                    torch.randn(n, generator=gen, device=device) * mag)
    s = torch.exp2(torch.rand(n, generator=gen, device=device) * 80 - 40)
    ones = (s.view(torch.int32) | 0x007FFFFF).view(torch.float32)
    s = torch.where(torch.arange(n, device=device) % 4 == 1, ones, s)
    return x, s
