"""beam::linear_fp8 — a Linear layer with FP8 per-tensor (or per-row) weights and a static FP8
per-tensor activation scale (W8A8), in the checkpoint layout of docs/DESIGN.md §1.

    y = q(x) @ W^T,   q(x) = fp8_e4m3(clamp(x / input_scale, +-448)) * input_scale,
    W = weight * weight_scale (a scalar, or one scale per output row)

Inputs: x [..., K] bf16 / fp16 / fp32, or float8_e4m3fn holding the codes
fp8_e4m3(clamp(x / input_scale, +-448)) already (what beam::add_rmsnorm_fp8, rmsnorm_fp8 and
attention(out_scale=input_scale) write: the quantizer's launch is saved); weight [N, K]
float8_e4m3fn; weight_scale fp32 [] or [N]; input_scale fp32 []; out_dtype: None for a
floating x (the output takes x's dtype), required for FP8 codes (bf16 / fp16 / fp32).
Output: a new [..., N] tensor (no `out=`; inputs are never written). With split_k = S > 1
(Triton path only): FP32 partial sums [S, ..., N] instead, split s over the input channels
[s·c, (s+1)·c), c = ceil(K / S / 128)·128, each times input_scale · weight_scale, unrounded:
their sum in order, rounded to out_dtype, is the output (beam::add_rmsnorm adds them as it
reads y, so a batch-1 o_proj spreads over twice the SMs without a reduction launch;
`decode_split_k` says when).
On CUDA, up to SMALL_M tokens (decode) run the Triton GEMM with the weights on the MMA's M side
(the swap-AB loop shared with beam::moe_fp8, `_gemm.gemm_loop`): cuBLAS picks a
128-row tile for M = 1 and read the weights at 2.6-3.3x their floor in the engine bench. More
tokens run torch._scaled_mm (FP8 tensor cores, FP32 accumulation) where its shape rules hold
(K and N multiples of 16), the Triton GEMM otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from beam_trtllm.quant_formats import dequantize_fp8, quantize_fp8_activation

from ._checks import (ACT_DTYPES, _expect, check_device, check_linear_x, check_out_dtype,
                      check_tensor)
from ._common import sm_count as device_sms
from ._fp8_act import quant_fp8_per_tensor
from ._gemm import gemm_loop, round_to, tile_of, unswap
from ._moe_common import GemmConfig
from ._pdl import chain_mode, launch_early, let_next_launch, wait_for_inputs
from ._tiles import linear_config
from .registry import beam_op, dispatch, register
from .tuning import tuned_linear

OP = "linear_fp8"
FP8 = (torch.float8_e4m3fn,)
SMALL_M = 16  # up to this many tokens the Triton swap-AB GEMM runs on CUDA too


def split_channels(k: int, split_k: int) -> int:
    """Input channels per split of a split-K call (a multiple of 128, so every split starts
    16-byte aligned)."""
    return -(-k // split_k // 128) * 128 if split_k > 1 else k


def check_linear_fp8(x, weight, weight_scale, input_scale, out_dtype=None,
                     split_k: int = 1) -> torch.dtype:
    """-> the output dtype."""
    _expect(split_k >= 1, OP, f"split_k must be >= 1, got {split_k}")
    check_tensor(OP, "weight", weight, (None, None), FP8)
    n, k = weight.shape
    check_linear_x(OP, x, k, ACT_DTYPES + FP8)
    out_dtype = check_out_dtype(OP, x, out_dtype)
    _expect(weight_scale.dim() == 0 or tuple(weight_scale.shape) == (n,), OP,
            f"weight_scale has shape {list(weight_scale.shape)}, expected [] or [{n}]")
    check_tensor(OP, "weight_scale", weight_scale, tuple(weight_scale.shape), (torch.float32,))
    check_tensor(OP, "input_scale", input_scale, (), (torch.float32,))
    check_device(OP, x, weight=weight, weight_scale=weight_scale, input_scale=input_scale)
    return out_dtype


@register(OP, "reference")
def ref_linear_fp8(x, weight, weight_scale, input_scale, out_dtype=None, split_k: int = 1):
    out_dtype = check_linear_fp8(x, weight, weight_scale, input_scale, out_dtype, split_k)
    codes = x if x.dtype in FP8 else quantize_fp8_activation(x, input_scale)
    xq = codes.float() * input_scale  # FP32 math on exact decoded values
    w = dequantize_fp8(weight, weight_scale)
    if split_k == 1:
        return F.linear(xq, w).to(out_dtype)
    c = split_channels(weight.shape[1], split_k)
    return torch.stack([F.linear(xq[..., s * c:(s + 1) * c], w[:, s * c:(s + 1) * c])
                        for s in range(split_k)])


@beam_op("linear_fp8", mutates_args=())
def linear_fp8(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
    out_dtype: Optional[torch.dtype] = None, split_k: int = 1,
) -> torch.Tensor:
    return dispatch(OP, x.device, x, weight, weight_scale, input_scale, out_dtype, split_k)


@linear_fp8.register_fake
def _(x, weight, weight_scale, input_scale, out_dtype=None, split_k=1):
    out_dtype = check_linear_fp8(x, weight, weight_scale, input_scale, out_dtype, split_k)
    if split_k > 1:
        return x.new_empty((split_k, *x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


# ---------------------------------------------------------------------------- triton
@triton.jit
def _linear_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, k_split, stride_xm,
                       stride_wn, stride_ws, stride_ym, stride_ys, SWAP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    # FP8 x FP8 products, promoted to FP32 every BLOCK_K (Hopper's FP8 MMA accumulates with
    # reduced precision), then * input_scale * weight_scale[n] (stride_ws = 0 broadcasts a
    # per-tensor weight scale). SPLIT > 1: program axis 1 is the split of K (channels
    # [s·k_split, (s+1)·k_split)), whose FP32 partial goes unrounded to y + s·stride_ys.
    # PDL (the decode chain, _pdl.py): launched while the kernels before it run, the program
    # lets the next kernel launch and waits for x; the weight-scale load goes before the wait.
    let_next_launch(PDL)
    pid_m, pid_n = tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    k_lo = tl.program_id(1) * k_split
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    w_scale = tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)
    wait_for_inputs(PDL)  # no read of x and no write before this
    acc, _ = gemm_loop(x_ptrs, m_mask, w_ptrs, n_mask, tl.minimum(K - k_lo, k_split), 0, False,
                       SWAP, "fp8", BLOCK_M, BLOCK_N, BLOCK_K)
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    out = unswap(acc, SWAP) * tl.load(xs_ptr) * w_scale[None, :]
    if SPLIT == 1:
        out = round_to(out, dtype)
    y_ptrs = (y_ptr + tl.program_id(1).to(tl.int64) * stride_ys
              + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :])
    tl.store(y_ptrs, out.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


def takes_scaled_mm(m: int, n: int, k: int, weight_scale, out_dtype, cuda: bool) -> bool:
    """The launcher's choice (a function of shapes only, so the launch-count test can ask what
    a GPU would run): torch._scaled_mm for more than SMALL_M tokens where its rules hold (CUDA,
    K and N multiples of 16; a per-row weight scale needs row-wise scaling, BF16 output only)."""
    if not (cuda and hasattr(torch, "_scaled_mm") and m > SMALL_M and k % 16 == 0
            and n % 16 == 0):
        return False
    return weight_scale.dim() == 0 or out_dtype == torch.bfloat16


def _scaled_mm(xq, weight, weight_scale, input_scale, out_dtype):
    m, n = xq.shape[0], weight.shape[0]
    if weight_scale.dim() == 0:
        return torch._scaled_mm(xq, weight.t(), scale_a=input_scale, scale_b=weight_scale,
                                out_dtype=out_dtype)
    # row-wise: scale_a [M, 1], scale_b [1, N]
    return torch._scaled_mm(xq, weight.t(), scale_a=input_scale.expand(m, 1).contiguous(),
                            scale_b=weight_scale.view(1, n), out_dtype=out_dtype)


# Few-token (M <= 64) FP8 tiles, weights on the MMA's M side (H200 sweeps, bench/decode_sweep.py
# --only linear,linear_split with the weights out of L2):
# - "split": a split call's tile, 256-deep K steps, 4 stages (80 KB of shared memory: two
#   programs an SM, the 240 programs of o_proj split three ways in one wave): in the engine
#   bench's decode chain 0.7-1.6 us off each MoE layer against 128-deep, 6 stages
#   (2026-12-01, H200, --chain-ab 'default;default|split=16,64,256,4,4');
# - "wide": an unsplit call with more 64-row tiles than SMs, the same 60 KB tile so that three
#   fit an SM in one wave: the canonical q/k/v/gate [14336 x 5120] (224 tiles) 19.3 us, 89.6%
#   of copy, where linear_config's 256-deep tile (one an SM: two waves) took over 20.6
#   (2026-12-01); fewer tiles than SMs keep linear_config's deeper tile.
SPLIT_CONFIG = GemmConfig(16, 64, 256, 4, 4, swap=True)
WIDE_CONFIG = GemmConfig(16, 64, 128, 4, 6, swap=True)
DECODE_TILES = dict(split=SPLIT_CONFIG, wide=WIDE_CONFIG)  # (bench/ A/Bs swap entries)


def _config(m: int, n: int, k: int, device, config=None, split_k: int = 1):
    if config is not None:
        return config
    if split_k > 1:
        return DECODE_TILES["split"]
    tuned = tuned_linear(OP, m, n, k)
    if tuned is not None:
        return tuned
    wide = DECODE_TILES["wide"]
    if m <= 64 and device.type == "cuda" and triton.cdiv(n, wide.block_n) > device_sms(device):
        return wide
    return linear_config(m, 1)


MAX_DECODE_SPLITS = 3


def decode_split_k(m: int, n: int, k: int, sm_count: int) -> int:
    """Splits of K for a few-token call whose consumer adds partial sums (see the module
    docstring): the most, up to MAX_DECODE_SPLITS, whose programs (the split tile's tiles times
    the splits) number at most two an SM, so that they run in one wave, with each split keeping
    >= 2048 channels; else 1. At M = 1 on the H200: o_proj [5120 x 6144] (80 tiles) takes 3,
    8.9 us launched early against 9.5 with 2 (H200, 2026-11-30, commit 7dffcef) and 12.6-13.4
    unsplit (bench/decode_sweep.py --only linear_split); q/k/v [8192 x 5120]
    (128 tiles) takes 2, 12.2 us against 13.4 unsplit."""
    if m > SMALL_M:
        return 1
    split = DECODE_TILES["split"]
    tiles = triton.cdiv(m, split.block_m) * triton.cdiv(n, split.block_n)
    for splits in range(MAX_DECODE_SPLITS, 1, -1):
        if splits * tiles <= 2 * sm_count and k // splits >= 2048:
            return splits
    return 1


@register(OP, "triton")
def linear_fp8_triton(x, weight, weight_scale, input_scale, out_dtype=None, split_k: int = 1,
                      use_scaled_mm=None, config=None):
    """Launcher: quantize x with the static scale (unless it holds FP8 codes already), then the
    Triton GEMM or torch._scaled_mm (see `takes_scaled_mm`; the `use_scaled_mm` / `config`
    arguments override the choice: tests and bench/). split_k > 1 runs the Triton GEMM, in the
    decode chain launched early (PDL)."""
    out_dtype = check_linear_fp8(x, weight, weight_scale, input_scale, out_dtype, split_k)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    xq = x2.contiguous() if x.dtype in FP8 else quant_fp8_per_tensor(x2, input_scale)
    if use_scaled_mm is None:
        use_scaled_mm = split_k == 1 and takes_scaled_mm(m, n, k, weight_scale, out_dtype,
                                                         x.is_cuda)
    if use_scaled_mm and m:
        y = _scaled_mm(xq, weight, weight_scale, input_scale, out_dtype)
        return y.reshape(*x.shape[:-1], n)
    y = torch.empty((split_k, m, n), dtype=out_dtype if split_k == 1 else torch.float32,
                    device=x.device)
    if m:
        pdl = chain_mode(x.device, "linear") if split_k > 1 else 0
        cfg = _config(m, n, k, x.device, config, split_k)
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split_k)
        stride_ws = 0 if weight_scale.dim() == 0 else 1
        _linear_fp8_kernel[grid](
            xq, input_scale, weight, weight_scale, y, m, n, k, split_channels(k, split_k),
            xq.stride(0), weight.stride(0), stride_ws, y.stride(1), y.stride(0), SWAP=cfg.swap,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            SPLIT=split_k, PDL=pdl, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **(launch_early(x.device, "linear") if pdl else {}),
        )
    if split_k > 1:
        return y.reshape(split_k, *x.shape[:-1], n)
    return y.reshape(*x.shape[:-1], n)

