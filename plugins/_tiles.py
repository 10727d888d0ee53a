"""Weight-tile decoders shared by the NVFP4 kernels (moe_nvfp4, linear_nvfp4)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def nvfp4_tile(w_ptrs, s_ptrs, w_mask, s_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               dtype: tl.constexpr):
    """Decode one NVFP4 tile: packed uint8 [BLOCK_N, BLOCK_K/2] + E4M3 scales [BLOCK_N,
    BLOCK_K/16] -> [BLOCK_N, BLOCK_K] = E2M1 * scale (without the global scale_2), in dtype.

    E2M1 code c (sign << 3 | magnitude index) placed as FP16 bits (c & 7) << 9 | (c & 8) << 12
    is exactly E2M1(c) * 2^-14 (index 1, the subnormal 0.5, lands on an FP16 subnormal, which
    the FP16 -> FP32 conversion keeps), so the 2^14 folds into the block scale. E2M1 * E4M3 has
    at most 5 significant bits: exact in BF16 and FP16, so the tile carries no rounding."""
    packed = tl.load(w_ptrs, mask=w_mask, other=0)
    codes = tl.join(packed & 0xF, packed >> 4).reshape(BLOCK_N, BLOCK_K)  # even element: low nibble
    c = codes.to(tl.int16)
    values = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True).to(tl.float32)
    scale = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32) * 16384.0
    tile = values.reshape(BLOCK_N, BLOCK_K // 16, 16) * scale[:, :, None]
    return tile.reshape(BLOCK_N, BLOCK_K).to(dtype)


def linear_config(m: int, dtype_bytes: float):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the linear_* GEMMs. Few tokens:
    16-row tiles and narrow weight tiles so the weight stream spreads over all SMs."""
    from ._moe_common import GemmConfig

    block_k = 128 if dtype_bytes >= 1 else 128
    if m <= 64:
        return GemmConfig(16, 32, block_k * (2 if dtype_bytes == 1 else 1), 4, 4)
    return GemmConfig(128, 128, block_k, 8, 3)
