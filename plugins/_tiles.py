"""Weight-tile decoders shared by the NVFP4 kernels (moe_nvfp4, linear_nvfp4), and the launch
shape of the linear_* GEMMs.

An NVFP4 tile is read as int32 words, 8 E2M1 codes each (code j of a word = element j of its
8; even elements in low nibbles, as ModelOpt packs them), and decoded to
    E2M1[code] * weight_scale * 2^-8
in the activation dtype. The 2^-8 keeps every intermediate exact and in range; the kernels
multiply their FP32 accumulators by 2^8 * weight_scale_2. E2M1 * E4M3 has at most 8
significant bits (magnitudes {1,2,3,4,6,8,12} x 2^-1 times {8..15} x 2^(e-3)), so each decoded
value is exact in BF16, FP16 (>= 2^-18 here) and FP32: the tile carries no rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl

# BF16 on the GPU: one word + its block's scale (BF16, pre-multiplied by 2^118) -> 8 BF16
# values with integer ops and packed BF16 multiplies (~2.5 instructions per value; the plain
# Triton decode below costs ~9 and made the NVFP4 decode GEMM ALU-bound). Placing magnitude
# index i (3 bits) at bits 6..8 and the sign at bit 15 gives the BF16 number E2M1(i) * 2^-126
# (index 1, the subnormal 0.5, lands on a BF16 subnormal; BF16 multiplies keep subnormals);
# times scale * 2^118 that is E2M1 * scale * 2^-8, exact.
_E2M1X8_TO_BF16 = tl.constexpr("""
{
.reg .b32 z, t0, t1, a, b, s2, r0, r1, r2, r3;
mov.b32 z, 0;
mov.b32 s2, {$9, $9};
prmt.b32 t0, $8, z, 0x4140;
prmt.b32 t1, $8, z, 0x4342;
shl.b32 a, t0, 6;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t0, 12;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 r0, a, s2;
shl.b32 a, t0, 2;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t0, 8;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 r1, a, s2;
shl.b32 a, t1, 6;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t1, 12;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 r2, a, s2;
shl.b32 a, t1, 2;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t1, 8;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 r3, a, s2;
mov.b32 {$0, $2}, r0;
mov.b32 {$1, $3}, r1;
mov.b32 {$4, $6}, r2;
mov.b32 {$5, $7}, r3;
}
""")


@triton.jit
def _e2m1_code(words, j: tl.constexpr, scale, dtype: tl.constexpr):
    """Element j of each word, times scale (FP32, = weight_scale * 2^6), in dtype. The code
    placed as FP16 bits (c & 7) << 9 | (c & 8) << 12 is E2M1(c) * 2^-14 exactly (the FP16
    subnormal of index 1 survives the FP16 -> FP32 conversion)."""
    c = ((words >> (4 * j)) & 0xF).to(tl.int16)
    value = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True).to(tl.float32)
    return (value * scale).to(dtype)


@triton.jit
def nvfp4_tile(words, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr,
               ASM: tl.constexpr):
    """words int32 [BLOCK_N, BLOCK_K/8], scales FP32 [BLOCK_N, BLOCK_K/16] ->
    [BLOCK_N, BLOCK_K] in dtype = E2M1 * scale * 2^-8. ASM: the BF16 PTX decoder (GPU only;
    Triton's interpreter cannot run inline assembly)."""
    per_word = tl.join(scales, scales).reshape(BLOCK_N, BLOCK_K // 8)  # 2 words per 16-block
    if ASM:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            _E2M1X8_TO_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h",
            [words, (per_word * 3.32306998946229e+35).to(tl.bfloat16)],  # * 2^118 (exact)
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        s = per_word * 64.0
        o0 = _e2m1_code(words, 0, s, dtype)
        o1 = _e2m1_code(words, 1, s, dtype)
        o2 = _e2m1_code(words, 2, s, dtype)
        o3 = _e2m1_code(words, 3, s, dtype)
        o4 = _e2m1_code(words, 4, s, dtype)
        o5 = _e2m1_code(words, 5, s, dtype)
        o6 = _e2m1_code(words, 6, s, dtype)
        o7 = _e2m1_code(words, 7, s, dtype)
    # tl.join adds a fastest-varying dim: this nesting flattens to o0, o1, ..., o7 per word.
    even = tl.join(tl.join(o0, o4), tl.join(o2, o6))
    odd = tl.join(tl.join(o1, o5), tl.join(o3, o7))
    return tl.join(even, odd).reshape(BLOCK_N, BLOCK_K)


def linear_config(m: int, dtype_bytes: float):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, swap) of the linear_* GEMMs. Few
    tokens: 16-row token tiles with the weights on the MMA's M side."""
    from ._moe_common import GemmConfig

    if m <= 64:  # FP8 at M = 1: 6 stages of 256-deep K tiles (H200 sweep with the weights
        if dtype_bytes == 1:  # out of L2, bench/decode_sweep.py, 2026-11-29)
            return GemmConfig(16, 64, 256, 4, 6, swap=True)
        return GemmConfig(16, 64, 128, 4, 4, swap=True)
    return GemmConfig(128, 128, 128 if dtype_bytes == 1 else 64, 8, 3)
