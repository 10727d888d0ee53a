"""Weight-tile decoders and the K loop shared by the NVFP4 kernels (moe_nvfp4, linear_nvfp4),
and the launch shape of the linear_* GEMMs.

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

from ._gemm import acc_zeros, mma

# BF16 on the GPU: one word + its block's scale (BF16, pre-multiplied by 2^118) -> 8 BF16
# values with integer ops and packed BF16 multiplies (~2.75 instructions per value against ~9
# for the plain Triton decode below), for tiles that go to shared memory anyway (the MMA's B
# side: prefill); the A side (decode) uses the per-byte or code-pair variants further down.
# Placing magnitude index i (3 bits) at bits 6..8 and the sign at bit 15 gives the BF16 number
# E2M1(i) * 2^-126 (index 1, the subnormal 0.5, lands on a BF16 subnormal; BF16 multiplies keep
# subnormals); times scale * 2^118 that is E2M1 * scale * 2^-8, exact.
def _decode_pair_ptx(src: str, mag_shift: int, sign_shift: int, dst: str) -> str:
    """PTX: the two codes whose magnitude bits sit `mag_shift` below bits 6..8 (and sign bit
    `sign_shift` below bit 15) of each half of `src` -> BF16x2 `dst`, times the scales `s2`."""
    return (f"shl.b32 a, {src}, {mag_shift};\nand.b32 a, a, 0x01C001C0;\n"
            f"shl.b32 b, {src}, {sign_shift};\nand.b32 b, b, 0x80008000;\n"
            f"or.b32 a, a, b;\nmul.rn.bf16x2 {dst}, a, s2;\n")


_E2M1X8_TO_BF16 = tl.constexpr(
    "{\n.reg .b32 z, t0, t1, a, b, s2, r0, r1, r2, r3;\nmov.b32 z, 0;\nmov.b32 s2, {$9, $9};\n"
    "prmt.b32 t0, $8, z, 0x4140;\nprmt.b32 t1, $8, z, 0x4342;\n"
    + _decode_pair_ptx("t0", 6, 12, "r0") + _decode_pair_ptx("t0", 2, 8, "r1")
    + _decode_pair_ptx("t1", 6, 12, "r2") + _decode_pair_ptx("t1", 2, 8, "r3")
    + "mov.b32 {$0, $2}, r0;\nmov.b32 {$1, $3}, r1;\nmov.b32 {$4, $6}, r2;\n"
    "mov.b32 {$5, $7}, r3;\n}\n")


# One byte (two codes) of a word -> BF16x2, for tiles that feed the MMA's A side from
# registers (decode). Written per byte over a [rows, 4 bytes, words] view, the decoded tile
# lets Triton pick the dot-operand layout with kWidth 8 for both MMA operands (K permuted the
# same way on both sides, so each thread's A fragment holds whole words: 8 consecutive k), and
# the conversion to it is a register renaming. The word-at-once decoder's join/reshape chain
# led to kWidth 2 and a shared-memory round trip of the decoded BF16 tile every K step (2 bytes
# a weight: the main shared-memory traffic and stall of the decode GEMM; H200: moe_nvfp4 T=1
# 126 -> 100 us with the launch shape of moe_nvfp4.DECODE). One PRMT gathers, with w4 = the
# word rotated right by 4: byte 0 = byte c (low code's magnitude in bits 0..2), byte 1 = w4's
# byte c-1 (its top bit is the low code's sign), byte 2 = w4's byte c (high code's magnitude),
# byte 3 = byte c (its top bit is the high code's sign); the signs sit at bits 15 and 31
# already and one shift places both magnitudes at bits 6..8 of each half.
# $2 word, $3 PRMT selector of byte c, $4 BF16 scale * 2^118 -> $0, $1 the two codes.
_E2M1X2_TO_BF16 = tl.constexpr(
    "{\n.reg .b32 w4, t, a, s2, r;\nmov.b32 s2, {$4, $4};\nshf.r.wrap.b32 w4, $2, $2, 4;\n"
    "prmt.b32 t, $2, w4, $3;\nshl.b32 a, t, 6;\nand.b32 a, a, 0x01C001C0;\n"
    "and.b32 t, t, 0x80008000;\nor.b32 a, a, t;\nmul.rn.bf16x2 r, a, s2;\n"
    "mov.b32 {$0, $1}, r;\n}\n")


# Two codes 16 bits apart in a word (c and c + 4) -> BF16x2, for the A side like the per-byte
# decoder above (same [rows, 4, words] view, so the same register-only kWidth-8 layout), but
# with codes c and c + 4 in one register the activations take the same K order
# (`nvfp4_activations`: a register permutation). With t = the word (shifted right by 8 for
# c = 2, 3) masked to the two codes, t * (2^a + 2^b) adds a copy shifted by a (magnitudes to
# bits 6..8 and 22..24) and one by b (signs to bits 15 and 31) whose bits do not overlap (no
# carries), and PAIR_KEEP keeps those: AND, IMAD, AND, HMUL2 a code pair, against PRMT, shift,
# two LOP3, HMUL2 (+1 rotate a word) per byte (gate/up loop 502 -> 419 SASS instructions a K
# step). $2 the (shifted) word, $3 its pair mask, $4 the multiplier, $5 BF16 scale * 2^118 ->
# $0, $1 the codes c and c + 4.
PAIR_MASK_EVEN, PAIR_MASK_ODD = tl.constexpr(0x000F000F), tl.constexpr(0x00F000F0)
PAIR_MUL_EVEN, PAIR_MUL_ODD = tl.constexpr((1 << 6) + (1 << 12)), tl.constexpr((1 << 2) + (1 << 8))
PAIR_KEEP = 0x81C081C0
_E2M1_PAIR_TO_BF16 = tl.constexpr(
    "{\n.reg .b32 t, r, s2;\nmov.b32 s2, {$5, $5};\nand.b32 t, $2, $3;\n"
    f"mul.lo.u32 t, t, $4;\nand.b32 t, t, 0x{PAIR_KEEP:08X};\nmul.rn.bf16x2 r, t, s2;\n"
    "mov.b32 {$0, $1}, r;\n}\n")


@triton.jit
def _tile_code_pairs(words, scales_bf16, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """BF16 decode for the A side: [BN, 4, W] code pairs (c, c + 4) -> [BN, BK], the element
    at 8w + 2c + j holding code c + 4j of word w (see `nvfp4_activations`)."""
    W: tl.constexpr = BLOCK_K // 8
    shape: tl.constexpr = (BLOCK_N, 4, W)
    c = tl.arange(0, 4)[None, :, None]
    words = tl.broadcast_to(words[:, None, :], shape)
    high = (words.to(tl.uint32, bitcast=True) >> 8).to(tl.int32, bitcast=True)
    src = tl.where(c >= 2, high, words)  # codes 2, 6 and 3, 7 moved to where 0, 4 and 1, 5 sit
    mask = tl.broadcast_to(tl.where(c % 2 == 0, PAIR_MASK_EVEN, PAIR_MASK_ODD), shape)
    multiplier = tl.broadcast_to(tl.where(c % 2 == 0, PAIR_MUL_EVEN, PAIR_MUL_ODD), shape)
    lo, hi = tl.inline_asm_elementwise(
        _E2M1_PAIR_TO_BF16, "=h,=h,r,r,r,h",
        [src, mask, multiplier, tl.broadcast_to(scales_bf16[:, None, :], shape)],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    return tl.permute(tl.join(lo, hi), (0, 2, 1, 3)).reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _tile_per_byte(words, scales_bf16, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """BF16 decode of each word byte by byte: [BN, 4, W] code pairs -> [BN, BK]."""
    W: tl.constexpr = BLOCK_K // 8
    byte = tl.arange(0, 4)[None, :, None]
    # PRMT source bytes (word, then w4) for result bytes 0..3: c, 4 + (c - 1) % 4, 4 + c, c
    selector = tl.broadcast_to(byte + ((4 + (byte + 3) % 4) << 4) + ((4 + byte) << 8)
                               + (byte << 12), (BLOCK_N, 4, W))
    lo, hi = tl.inline_asm_elementwise(
        _E2M1X2_TO_BF16, "=h,=h,r,r,h",
        [tl.broadcast_to(words[:, None, :], (BLOCK_N, 4, W)), selector,
         tl.broadcast_to(scales_bf16[:, None, :], (BLOCK_N, 4, W))],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    # element (n, c, w, j) is k = 8w + 2c + j
    return tl.permute(tl.join(lo, hi), (0, 2, 1, 3)).reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _in_pairs_order(t, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """[ROWS, BK] in K order -> the code-pair decode's K order (position 8w + 2c + j holds
    k = 8w + c + 4j)."""
    t = tl.permute(t.reshape(ROWS, BLOCK_K // 8, 2, 4), (0, 1, 3, 2))
    return t.reshape(ROWS, BLOCK_K)


@triton.jit
def nvfp4_activations(a, ASM: tl.constexpr, SIDE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """The activations [BM, BK] in the K order of `nvfp4_tile`'s tiles: for the code-pair PTX
    decode, position 8w + 2c + j holds k = 8w + c + 4j; otherwise K in order. With
    A_SIDE_PAIRS_ORDERED the activations were stored at `pairs_position` (their producer's
    doing) and this is a register renaming (see there)."""
    if ASM and SIDE == A_SIDE_PAIRS:
        a = _in_pairs_order(a, BLOCK_M, BLOCK_K)
    if SIDE == A_SIDE_PAIRS_ORDERED:
        a = tl.permute(a.reshape(BLOCK_M, BLOCK_K // 64, 2, 4, 2, 2, 2), (0, 1, 5, 3, 2, 4, 6))
        a = a.reshape(BLOCK_M, BLOCK_K)
    return a


# Where a producer stores element k of an A_SIDE_PAIRS_ORDERED GEMM's activations (moe_nvfp4's
# gate/up for its down GEMM): at d = the code-pair order's position of k (8w + 2c + j for
# k = 8w + c + 4j), moved within its 64-element chunk so that the 4-byte pairs each mma.sync
# takes as its B registers (Triton's kWidth-8 operand: thread t's pair r of the chunk's first
# and second 32 elements, 8t + 2r and 32 + 8t + 2r) sit next to each other in one 16-byte
# shared-memory load (chunk bits of d: pair-in-half h, thread t, pair r = 2 r1 + r0 -> stored
# at r1, t, r0, h). nvfp4_activations undoes the move by a reshape/permute, a register
# renaming, where unordered activations took a PRMT a register pair and ordered-but-unmoved
# ones a register move (sm_90 SASS of moe_nvfp4's down GEMM at Beam shapes: 446 / 501 / 416
# instructions a K step).
@triton.jit
def pairs_position(k):
    d = (k & ~7) | ((k & 3) << 1) | ((k >> 2) & 1)
    return (d & ~63) | (((d >> 2) & 1) << 5) | (d & 24) | (((d >> 1) & 1) << 2) \
        | (((d >> 5) & 1) << 1) | (d & 1)


# Which decoder a tile takes (the kernels' NVFP4_SIDE): the MMA's B side (prefill: the tile
# goes to shared memory anyway), the A side byte by byte, or the A side in code pairs (cheaper
# decode, activations permuted alike: a register permutation with 8-token tiles; with 16-token
# tiles it cost more than it saved, H200 linear_nvfp4 M=64 [5120 -> 8240] 45.4 -> 55.9 us).
# A_SIDE_PAIRS_ORDERED: code pairs, with the activations stored at `pairs_position` by their
# producer (no pair-building from the activation tile).
B_SIDE, A_SIDE_BYTES, A_SIDE_PAIRS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
A_SIDE_PAIRS_ORDERED = tl.constexpr(3)


def nvfp4_side(swap: bool, block_m: int, ordered: bool = False) -> int:
    """The decoder of a launch shape: weights on the MMA's M side (swap) are its A operand.
    ordered: the activations come in the code pairs' K order (`pairs_position`)."""
    if not swap:
        return B_SIDE.value
    if block_m > 8:
        return A_SIDE_BYTES.value
    return (A_SIDE_PAIRS_ORDERED if ordered else A_SIDE_PAIRS).value


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
               ASM: tl.constexpr, SIDE: tl.constexpr = 0):
    """words int32 [BLOCK_N, BLOCK_K/8], scales FP32 [BLOCK_N, BLOCK_K/16] ->
    [BLOCK_N, BLOCK_K] in dtype = E2M1 * scale * 2^-8. ASM: the BF16 PTX decoders (GPU only;
    Triton's interpreter cannot run inline assembly). SIDE (`nvfp4_side`): the tile is the
    MMA's B operand, its A operand (weights on the M side) decoded byte by byte, or its A
    operand decoded in code pairs whose K order the activations must take too
    (`nvfp4_activations`; see _E2M1_PAIR_TO_BF16)."""
    per_word = tl.join(scales, scales).reshape(BLOCK_N, BLOCK_K // 8)  # 2 words per 16-block
    if ASM:
        scale_bf16 = (per_word * 3.32306998946229e+35).to(tl.bfloat16)  # * 2^118 (exact)
        if SIDE == A_SIDE_PAIRS or SIDE == A_SIDE_PAIRS_ORDERED:
            return _tile_code_pairs(words, scale_bf16, BLOCK_N, BLOCK_K)
        if SIDE == A_SIDE_BYTES:
            return _tile_per_byte(words, scale_bf16, BLOCK_N, BLOCK_K)
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            _E2M1X8_TO_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, scale_bf16],
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
    tile = tl.join(even, odd).reshape(BLOCK_N, BLOCK_K)
    if SIDE == A_SIDE_PAIRS_ORDERED:  # the activations come in the pairs' order: so must this
        tile = _in_pairs_order(tile, BLOCK_N, BLOCK_K)
    return tile


@triton.jit
def load_nvfp4_tile(w_ptrs, s_ptrs, row_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    dtype: tl.constexpr, ASM: tl.constexpr, SIDE: tl.constexpr, w_desc=None,
                    s_desc=None, row=0, k0=0, TMA_W: tl.constexpr = False,
                    TMA_S: tl.constexpr = False):
    """One whole K tile of weight rows `row_mask`: its words and E4M3 block scales (unmasked
    along K, so both are wide enough for the pipelined async copies), decoded. TMA_W / TMA_S:
    the words / scales of rows [row, + BLOCK_N), K step k0, by the TMA from w_desc / s_desc."""
    if TMA_W:
        words = w_desc.load([row, k0 // 8])
    else:
        words = tl.load(w_ptrs, mask=row_mask, other=0)
    if TMA_S:
        scales = s_desc.load([row, k0 // 16])
    else:
        scales = tl.load(s_ptrs, mask=row_mask, other=0.0)
    return nvfp4_tile(words, scales.to(tl.float32), BLOCK_N, BLOCK_K, dtype, ASM, SIDE)


@triton.jit
def nvfp4_k_loop(a_ptrs, w_ptrs, s_ptrs, valid, n_mask, row_step_w, row_step_s, K,
                 GATED: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr,
                 SIDE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, w_desc=None, s_desc=None,
                 w_row0=0, up_rows=0, TMA_W: tl.constexpr = False, TMA_S: tl.constexpr = False,
                 ONE_ROW: tl.constexpr = False):
    """The K loop of the NVFP4 GEMMs (moe_nvfp4, linear_nvfp4): activations [BLOCK_M, BLOCK_K]
    (rows `valid`) times decoded weight tiles (rows `n_mask`; words at w_ptrs, E4M3 block
    scales at s_ptrs) and with GATED also the weight rows row_step_w / row_step_s further (an
    expert's up_proj) into a second accumulator. TMA_W: whole K tiles whose words (TMA_S:
    and block scales) the TMA loads from the 2-D descriptors w_desc / s_desc over all weight
    rows, rows w_row0.. and up_rows further; with ONE_ROW, a_ptrs is one activation row
    [1, BLOCK_K] that every token column of the MMA takes (direct pairs, whose other columns
    are never stored: 1/8 of the activation tile's shared memory and copies).
    -> (acc, acc_up) as `_gemm.gemm_loop`."""
    if EVEN_K:  # (TMA_W is only given whole K tiles)
        acc, acc_up = _even_k_loop(a_ptrs, w_ptrs, s_ptrs, valid, n_mask, row_step_w, row_step_s,
                                   K, GATED, SWAP, ASM, SIDE, PRECISION, BLOCK_M, BLOCK_N,
                                   BLOCK_K, w_desc, s_desc, w_row0, up_rows, TMA_W, TMA_S,
                                   ONE_ROW)
    else:
        acc, acc_up = _masked_k_loop(a_ptrs, w_ptrs, s_ptrs, valid, n_mask, row_step_w,
                                     row_step_s, K, GATED, SWAP, ASM, SIDE, PRECISION, BLOCK_M,
                                     BLOCK_N, BLOCK_K)
    return acc, acc_up


@triton.jit
def _even_k_loop(a_ptrs, w_ptrs, s_ptrs, valid, n_mask, row_step_w, row_step_s, K,
                 GATED: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr, SIDE: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, w_desc, s_desc, w_row0, up_rows, TMA_W: tl.constexpr,
                 TMA_S: tl.constexpr, ONE_ROW: tl.constexpr):
    """K % BLOCK_K == 0: no K masks, so every tile (the scales too) is a copy wide enough for
    the pipeliner's asynchronous copies (H200, T=1: 157.9 -> 125.5 us with the same decode),
    or with TMA_W / TMA_S a TMA copy (no per-thread copies or their address registers, and the
    words land in swizzled shared memory: the per-thread copies' 64-byte rows read back with
    4-way bank conflicts)."""
    dtype: tl.constexpr = a_ptrs.dtype.element_ty
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    acc_up = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, K, BLOCK_K):
        if ONE_ROW:  # a_ptrs [1, BLOCK_K]: one activation row for all token columns
            a = nvfp4_activations(tl.load(a_ptrs), ASM, SIDE, 1, BLOCK_K)
            a = tl.broadcast_to(a, (BLOCK_M, BLOCK_K))
        else:
            a = nvfp4_activations(tl.load(a_ptrs, mask=valid[:, None], other=0.0), ASM, SIDE,
                                  BLOCK_M, BLOCK_K)
        w = load_nvfp4_tile(w_ptrs, s_ptrs, n_mask[:, None], BLOCK_N, BLOCK_K, dtype, ASM, SIDE,
                            w_desc, s_desc, w_row0, k0, TMA_W, TMA_S)
        acc = mma(acc, a, w, SWAP, PRECISION)
        if GATED:
            w_up = load_nvfp4_tile(w_ptrs + row_step_w, s_ptrs + row_step_s, n_mask[:, None],
                                   BLOCK_N, BLOCK_K, dtype, ASM, SIDE, w_desc, s_desc,
                                   w_row0 + up_rows, k0, TMA_W, TMA_S)
            acc_up = mma(acc_up, a, w_up, SWAP, PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8
        s_ptrs += BLOCK_K // 16
    return acc, acc_up


@triton.jit
def _masked_k_loop(a_ptrs, w_ptrs, s_ptrs, valid, n_mask, row_step_w, row_step_s, K,
                   GATED: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr, SIDE: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Any K: the masked E4M3 block scales are too narrow for the asynchronous copies that
    pipeline the other tiles, so they are loaded one step ahead by hand (else every step waits
    on a global load: measured NVFP4 decode at 4x its read floor)."""
    dtype: tl.constexpr = a_ptrs.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // 8)
    offs_ks = tl.arange(0, BLOCK_K // 16)
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    acc_up = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    s_mask = n_mask[:, None] & (offs_ks < K // 16)[None, :]
    scales = tl.load(s_ptrs, mask=s_mask, other=0.0)
    scales_up = tl.load(s_ptrs + row_step_s, mask=s_mask & GATED, other=0.0)
    for k0 in range(0, K, BLOCK_K):
        left = K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < left)[None, :], other=0.0)
        a = nvfp4_activations(a, ASM, SIDE, BLOCK_M, BLOCK_K)
        w_mask = n_mask[:, None] & (offs_kw < left // 8)[None, :]
        s_next_mask = n_mask[:, None] & (offs_ks < (left - BLOCK_K) // 16)[None, :]
        s_ptrs += BLOCK_K // 16
        scales_next = tl.load(s_ptrs, mask=s_next_mask, other=0.0)
        scales_up_next = tl.load(s_ptrs + row_step_s, mask=s_next_mask & GATED, other=0.0)
        words = tl.load(w_ptrs, mask=w_mask, other=0)
        w = nvfp4_tile(words, scales.to(tl.float32), BLOCK_N, BLOCK_K, dtype, ASM, SIDE)
        acc = mma(acc, a, w, SWAP, PRECISION)
        if GATED:
            words = tl.load(w_ptrs + row_step_w, mask=w_mask, other=0)
            w_up = nvfp4_tile(words, scales_up.to(tl.float32), BLOCK_N, BLOCK_K, dtype, ASM, SIDE)
            acc_up = mma(acc_up, a, w_up, SWAP, PRECISION)
        scales = scales_next
        scales_up = scales_up_next
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8
    return acc, acc_up


def linear_config(m: int, dtype_bytes: float):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, swap) of the linear_* GEMMs. Few
    tokens: 16-row token tiles with the weights on the MMA's M side."""
    from ._moe_common import GemmConfig

    if m <= 64:  # FP8 at M = 1: 6 stages of 256-deep K tiles (H200 sweep with the weights
        if dtype_bytes == 1:  # out of L2, bench/decode_sweep.py, 2026-11-29)
            return GemmConfig(16, 64, 256, 4, 6, swap=True)
        if dtype_bytes == 0.5 and m <= 8:  # NVFP4: 8-token tiles halve the MMAs and the
            # activation fragments (moved into each mma.sync's register pair) a K step; 32
            # weight rows on 2 warps (H200, weights out of L2, M = 1, bench/decode_sweep.py:
            # q/k/v [8192 x 5120] 17.74 -> 16.95 us, o_proj 20.27 -> 20.23 against 16 x 16)
            return GemmConfig(8, 32, 128, 2, 4, swap=True)
        if dtype_bytes == 0.5 and m <= 16:  # NVFP4: 16-row one-warp tiles (mma.sync), 4x the
            # programs of a 64-row warpgroup tile (H200, weights out of L2, M = 1,
            # bench/decode_sweep.py: q/k/v [8192 x 5120] 20.1 -> 18.5 us, o_proj 23.3 -> 21.1)
            return GemmConfig(16, 16, 128, 1, 4, swap=True)
        if dtype_bytes == 0.5:  # M = 64, [5120 -> 8240] (H200, 2026-11-29, commit ea69c21):
            # 32 rows / 2 warps 45.2 us, 16 / 1 warp 55.9, 64 / 4 warps 51.9
            return GemmConfig(16, 32, 128, 2, 3, swap=True)
        return GemmConfig(16, 64, 128, 4, 4, swap=True)
    return GemmConfig(128, 128, 128 if dtype_bytes == 1 else 64, 8, 3)
