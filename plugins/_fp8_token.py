"""Dynamic per-token FP8 activation quantizer of the per-channel FP8 ops (linear_fp8_channel,
moe_fp8_channel): one scale per row over all its channels,

    s[t] = max(amax |x[t, :]|, 1e-10) / 448,   q[t, c] = fp8_e4m3(clamp(x[t, c] / s[t], +-448))

(`beam_trtllm.quant_formats.quantize_fp8_per_token`; the same division and rounding as
`_fp8_act`, so the codes equal the reference's on the GPU and in Triton's interpreter). One
program a row: a pass for the amax, a pass for the codes (the row is in L2 by then).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import div_rn_by, to_e4m3
from ._fp8_act import ACT_EPS

FP8 = torch.float8_e4m3fn


@triton.jit
def _quant_per_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, eps,
                            BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), eps), 448.0)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + cols < K
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=mask, other=0.0)
        tl.store(q_ptr + row * stride_q + k0 + cols, to_e4m3(div_rn_by(x.to(tl.float32), scale)),
                 mask=mask)
    tl.store(s_ptr + row, scale)


def quant_fp8_per_token(x: torch.Tensor):
    """x [T, K] (rows contiguous) -> (codes fp8 [T, K], scales fp32 [T])."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, k = x.shape
    q = torch.empty((t, k), dtype=FP8, device=x.device)
    s = torch.empty((t,), dtype=torch.float32, device=x.device)
    if t and k:
        block_k = min(2048, triton.next_power_of_2(k))
        _quant_per_token_kernel[(t,)](x, q, s, k, x.stride(0), q.stride(0), ACT_EPS,
                                      BLOCK_K=block_k, num_warps=4)
    return q, s
