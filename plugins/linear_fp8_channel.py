"""beam::linear_fp8_channel — a Linear layer with per-channel FP8 weights (one scale per output
row) and dynamic per-token FP8 activations (compressed-tensors FP8_DYNAMIC, what published FP8
Beam checkpoints and SGLang's `beam.py` use).

    y[t, n] = (sum_c fp8(x[t, c] / s[t]) * weight[n, c]) * s[t] * weight_scale[n]
    s[t]    = max(amax |x[t, :]|, 1e-10) / 448               (computed on the fly, per call)

Inputs: x [..., K] bf16 / fp16 / fp32; weight [N, K] float8_e4m3fn; weight_scale fp32 [N]
(the checkpoint's [N, 1] BF16 scale, exactly in FP32). Output: a new [..., N] tensor in
x.dtype (no `out=`; inputs are never written).

Numerics: FP8 x FP8 products on the tensor cores, promoted to the FP32 accumulator every 128
(as linear_fp8), the FP32 sum scaled by s[t] * weight_scale[n] and rounded once. On CUDA up to
SMALL_M tokens (decode) run the Triton swap-AB GEMM (weights on the MMA's M side, the tiles of
linear_fp8), more tokens torch._scaled_mm with row-wise scales (scale_a [M, 1], scale_b [1, N])
where its rules hold (K and N multiples of 16, BF16 output). The per-token quantizer is one
launch before the GEMM (`_fp8_token`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from beam_trtllm.quant_formats import fake_quant_fp8_per_token

from ._checks import check_device, check_linear_x, check_tensor
from ._common import sm_count as device_sms
from ._fp8_token import quant_fp8_per_token
from ._gemm import gemm_loop, round_to, tile_of, unswap
from ._tiles import linear_config
from .linear_fp8 import DECODE_TILES, SMALL_M
from .registry import beam_op, dispatch, register

OP = "linear_fp8_channel"
FP8 = (torch.float8_e4m3fn,)


def check_linear_fp8_channel(x, weight, weight_scale) -> None:
    check_tensor(OP, "weight", weight, (None, None), FP8)
    n, k = weight.shape
    check_linear_x(OP, x, k)
    check_tensor(OP, "weight_scale", weight_scale, (n,), (torch.float32,))
    check_device(OP, x, weight=weight, weight_scale=weight_scale)


@register(OP, "reference")
def ref_linear_fp8_channel(x, weight, weight_scale):
    check_linear_fp8_channel(x, weight, weight_scale)
    xq = fake_quant_fp8_per_token(x.float())  # FP32 math on exactly decoded values
    return F.linear(xq, weight.float() * weight_scale[:, None]).to(x.dtype)


@beam_op("linear_fp8_channel", mutates_args=())
def linear_fp8_channel(x: torch.Tensor, weight: torch.Tensor,
                       weight_scale: torch.Tensor) -> torch.Tensor:
    return dispatch(OP, x.device, x, weight, weight_scale)


@linear_fp8_channel.register_fake
def _(x, weight, weight_scale):
    check_linear_fp8_channel(x, weight, weight_scale)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# ---------------------------------------------------------------------------- triton
@triton.jit
def _linear_fp8_channel_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_xm,
                               stride_wn, stride_ym, SWAP: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               GROUP_M: tl.constexpr):
    # linear_fp8's K loop (FP8 codes, promoted to FP32 every BLOCK_K) with a per-row
    # activation scale: the epilogue is acc * xs[m] * ws[n], rounded once.
    pid_m, pid_n = tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    w_scale = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    x_scale = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
    acc, _ = gemm_loop(x_ptrs, m_mask, w_ptrs, n_mask, K, 0, False, SWAP, "fp8", BLOCK_M,
                       BLOCK_N, BLOCK_K)
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    out = round_to(unswap(acc, SWAP) * x_scale[:, None] * w_scale[None, :], dtype)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


def takes_scaled_mm(m: int, n: int, k: int, out_dtype, cuda: bool) -> bool:
    """torch._scaled_mm (row-wise scales: BF16 output only) above SMALL_M tokens on CUDA."""
    return (cuda and hasattr(torch, "_scaled_mm") and m > SMALL_M and k % 16 == 0
            and n % 16 == 0 and out_dtype == torch.bfloat16)


def decode_config(m: int, n: int, device):
    """linear_fp8's few-token tiles: `wide` when the 64-row tiles outnumber the SMs (one wave
    of three programs an SM), else linear_config's 256-deep FP8 tile."""
    wide = DECODE_TILES["wide"]
    if m <= 64 and device.type == "cuda" and triton.cdiv(n, wide.block_n) > device_sms(device):
        return wide
    return linear_config(m, 1)


@register(OP, "triton")
def linear_fp8_channel_triton(x, weight, weight_scale, use_scaled_mm=None, config=None):
    """Launcher: per-token quantization of x, then the Triton GEMM or torch._scaled_mm
    (`use_scaled_mm` / `config` override the choice: tests and bench/)."""
    check_linear_fp8_channel(x, weight, weight_scale)
    n, k = weight.shape
    xq, xs = quant_fp8_per_token(x.reshape(-1, k))
    m = xq.shape[0]
    if use_scaled_mm is None:
        use_scaled_mm = takes_scaled_mm(m, n, k, x.dtype, x.is_cuda)
    if use_scaled_mm and m:
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs.view(m, 1), scale_b=weight_scale.view(1, n),
                             out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], n)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        cfg = config or decode_config(m, n, x.device)
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        _linear_fp8_channel_kernel[grid](
            xq, xs, weight, weight_scale, y, m, n, k, xq.stride(0), weight.stride(0), y.stride(0),
            SWAP=cfg.swap, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return y.reshape(*x.shape[:-1], n)
