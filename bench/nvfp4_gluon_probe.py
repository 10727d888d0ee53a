"""Can an explicit-layout (Gluon) kernel do the NVFP4 batch-1 expert GEMMs near their read floor?
(issue 4; a probe, not an op)

`moe_nvfp4`'s Triton decode stages every weight word, block scale and activation tile in shared
memory and reads it back in the decoder's layout (bench/nvfp4_probe.py --hot, ncu: bound by that
shared-memory and instruction stream, 76.7 us with the weights L2-resident). Here the words go
straight from global memory into the registers that `mma.sync` wants:

* A weight row's 16 words of a 128-deep K step are read 4 words (16 bytes) a thread: lane
  c = lane % 4 holds words 4c .. 4c + 3 of rows lane // 4 (+ 8) of its warp's 16-row tile.
* The decoded tile's logical K order is chosen so that this is exactly the MMA's A fragment
  (and the code-pair decoder of plugins/_tiles.py applies): word p = 4c + kb, code pair
  (q, q + 4) with q = 2h + m lands at logical k = 32 kb + 16 h + 8 m + 2 c (+1). The
  activations take the same order: thread c reads x[32 c .. 32 c + 32) of the step.
* The words, scales and activations of the step 2 (or 3) ahead are loaded into registers
  while a step decodes (software prefetch); no shared memory, no barriers.

H200 (docs/BENCHMARKS.md, session 9 run J): correct, but 109.6 us against the shipped kernel's
85.6: the register prefetch does not hide the global loads as the pipelined shared-memory
copies do, and the per-step activation permutes cost ALU time.

    PYTHONPATH=.:bench python3 bench/nvfp4_gluon_probe.py [--once]   # H200: time + check
"""

from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from plugins._tiles import (
    _E2M1_PAIR_TO_BF16, PAIR_MASK_EVEN, PAIR_MASK_ODD, PAIR_MUL_EVEN, PAIR_MUL_ODD,
)

BLOCK_K = 128
TOKENS = 8  # the MMA's N: token rows of the activation operand (one is real at T = 1)


def _lin(reg, lane, warp, shape):
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp,
                                      block_bases=[], shape=shape)


def layouts(num_warps: int, rows: int) -> dict:
    """The kernels' layouts for weight tiles of `rows` rows (16 a warp, repeated):
    mma / a_op / b_op: mma.sync's accumulator and operands; decode: [rows, 4 c, 2 kbh, 2 kbl,
    4 q] (word 4 c + 2 kbh + kbl of a row's 16, code pair q); words [rows, 16], scales
    [rows, 8] (the step's block scales) and x [TOKENS, 128]: the loads, one thread holding 4
    words / 2 scales / 32 activations, contiguous."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                    instr_shape=[16, 8])
    warp_bits = num_warps.bit_length() - 1
    rep_bits = (rows // (16 * num_warps)).bit_length() - 1
    row_reg = [[8]] + [[16 * num_warps << i] for i in range(rep_bits)]  # row offsets in registers
    row_lane = [[1], [2], [4]]
    row_warp = [[16 << i] for i in range(warp_bits)]

    def rows_then(rest, bases):  # row part first, then the other dims' offsets
        return [b + [0] * rest for b in bases]

    def others(bases):  # offsets along the non-row dims
        return [[0] + b for b in bases]
    decode = _lin(others([[0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2]])
                  + rows_then(4, row_reg),
                  others([[1, 0, 0, 0], [2, 0, 0, 0]]) + rows_then(4, row_lane),
                  rows_then(4, row_warp), [rows, 4, 2, 2, 4])
    words = _lin(others([[1], [2]]) + rows_then(1, row_reg),
                 others([[4], [8]]) + rows_then(1, row_lane), rows_then(1, row_warp),
                 [rows, 16])
    scales = _lin(others([[1]]) + rows_then(1, row_reg),
                  others([[2], [4]]) + rows_then(1, row_lane), rows_then(1, row_warp),
                  [rows, 8])
    x = _lin([[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]],
             [[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]], [[0, 0]] * warp_bits, [TOKENS, 128])
    return dict(mma=mma, a_op=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                b_op=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
                decode=decode, words=words, scales=scales, x=x)


@gluon.jit
def _load2(ptr, n0: gl.constexpr, n1: gl.constexpr, stride0, L: gl.constexpr,
           FIRST_ROW_ONLY: gl.constexpr):
    """[n0, n1] elements ptr[i * stride0 + j] in layout L (with FIRST_ROW_ONLY the other rows
    are zeros, not loaded)."""
    i = gl.arange(0, n0, layout=gl.SliceLayout(1, L))
    j = gl.arange(0, n1, layout=gl.SliceLayout(0, L))
    offs = gl.expand_dims(i.to(gl.int64) * stride0, 1) + gl.expand_dims(j, 0)
    if FIRST_ROW_ONLY:
        ok = gl.expand_dims(i == 0, 1) & gl.expand_dims(j < n1, 0)
        out = gl.load(ptr + offs, mask=ok, other=0.0)
    else:
        out = gl.load(ptr + offs)
    return out


@gluon.jit
def _decoded_tile(words, scales, ROWS: gl.constexpr, LD: gl.constexpr, A_OP: gl.constexpr):
    """words [ROWS, 16] int32, scales [ROWS, 8] (E4M3 block scales of the step) -> the decoded
    [ROWS, 128] BF16 tile (E2M1 * scale * 2^-8) in the MMA's A layout, logical k =
    32 kb + 16 h + 8 m + 2 c + j holding code q + 4 j (q = 2 h + m) of word 4 c + kb."""
    W4: gl.constexpr = gl.SliceLayout(4, LD)
    S3: gl.constexpr = gl.SliceLayout(3, W4)
    w = gl.convert_layout(gl.reshape(words, [ROWS, 4, 2, 2]), W4, assert_trivial=True)
    s = (scales.to(gl.float32) * 3.32306998946229e+35).to(gl.bfloat16)  # * 2^118 (exact)
    s = gl.convert_layout(gl.reshape(s, [ROWS, 4, 2]), S3, assert_trivial=True)
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(
        2, gl.SliceLayout(3, LD)))))
    q = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(q, 0), 1), 2), 3)
    w = gl.expand_dims(w, 4)
    high = (w.to(gl.uint32, bitcast=True) >> 8).to(gl.int32, bitcast=True)
    src = gl.where(q >= 2, high, w)  # codes 2, 6 and 3, 7 moved to where 0, 4 and 1, 5 sit
    mask = gl.where(q % 2 == 0, PAIR_MASK_EVEN, PAIR_MASK_ODD)
    mul = gl.where(q % 2 == 0, PAIR_MUL_EVEN, PAIR_MUL_ODD)
    scale = gl.expand_dims(gl.expand_dims(s, 3), 4)
    src, mask = gl.broadcast(src, mask)
    src, mul = gl.broadcast(src, mul)
    src, scale = gl.broadcast(src, scale)
    lo, hi = gl.inline_asm_elementwise(_E2M1_PAIR_TO_BF16, "=h,=h,r,r,r,h",
                                       [src, mask, mul, scale],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    tile = gl.reshape(gl.join(lo, hi), [ROWS, 4, 2, 2, 2, 2, 2])  # c, kbh, kbl, h, m, j
    tile = gl.reshape(gl.permute(tile, (0, 2, 3, 4, 5, 1, 6)), [ROWS, 128])
    return gl.convert_layout(tile, A_OP)


@gluon.jit
def _activations(x, B_OP: gl.constexpr):
    """x [TOKENS, 128] (the step's activations in K order) -> [128, TOKENS] in the MMA's B
    layout, in the decoded tiles' logical K order."""
    x = gl.reshape(x, [8, 4, 2, 2, 2, 2, 2])  # token, c, kbh, kbl, j, h, m (k = 32 c + ...)
    x = gl.reshape(gl.permute(x, (0, 2, 3, 5, 6, 1, 4)), [8, 128])
    return gl.convert_layout(gl.permute(x, (1, 0)), B_OP)


@gluon.jit
def _load_step(x_row, w_gate, s_gate, w_up, s_up, k, stride_wn, stride_sn, GATED: gl.constexpr,
               ROWS: gl.constexpr, LW: gl.constexpr, LS: gl.constexpr, LX: gl.constexpr):
    """The operands of the K step at k: (activations, gate words, gate scales, up words, up
    scales); without GATED the up entries repeat the gate ones (not loaded twice)."""
    k = gl.multiple_of(k, 128)
    xs = _load2(x_row + k, 8, 128, 0, LX, True)
    wg = _load2(w_gate + k // 8, ROWS, 16, stride_wn, LW, False)
    sg = _load2(s_gate + k // 16, ROWS, 8, stride_sn, LS, False)
    wu = wg
    su = sg
    if GATED:
        wu = _load2(w_up + k // 8, ROWS, 16, stride_wn, LW, False)
        su = _load2(s_up + k // 16, ROWS, 8, stride_sn, LS, False)
    return xs, wg, sg, wu, su


@gluon.jit
def _gemm_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, s2_ptr, out_ptr, N, K, x_rows_per_pair,
                 stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                 GATED: gl.constexpr, ROWS: gl.constexpr, MMA: gl.constexpr,
                 A_OP: gl.constexpr, B_OP: gl.constexpr, LD: gl.constexpr, LW: gl.constexpr,
                 LS: gl.constexpr, LX: gl.constexpr, AHEAD: gl.constexpr):
    """One (token, expert) pair's rows [pid_n * ROWS, + ROWS) of an NVFP4 expert GEMM at T = 1:
    gate/up (GATED: silu(gate) * up to out[pair]) or down (out[pair] = h[pair] @ w2^T)."""
    pair = gl.program_id(0)
    n0 = gl.program_id(1) * ROWS
    expert = gl.load(ids_ptr + pair).to(gl.int64)
    x_row = x_ptr + (pair // x_rows_per_pair).to(gl.int64) * stride_xm
    w_gate = w_ptr + expert * stride_we + n0 * stride_wn
    s_gate = s_ptr + expert * stride_se + n0 * stride_sn
    w_up = w_gate + N * stride_wn
    s_up = s_gate + N * stride_sn
    acc = gl.zeros([ROWS, 8], gl.float32, MMA)
    acc_up = gl.zeros([ROWS, 8], gl.float32, MMA)
    # steps 0 .. AHEAD - 1, then each step loads step + AHEAD's operands before decoding its
    # own (the compiler places those loads late in the body, so AHEAD >= 2)
    s0 = _load_step(x_row, w_gate, s_gate, w_up, s_up, K - K, stride_wn, stride_sn, GATED, ROWS,
                    LW, LS, LX)
    s1 = _load_step(x_row, w_gate, s_gate, w_up, s_up, gl.minimum(128, K - 128), stride_wn,
                    stride_sn, GATED, ROWS, LW, LS, LX)
    if AHEAD == 3:
        s2 = _load_step(x_row, w_gate, s_gate, w_up, s_up, gl.minimum(256, K - 128), stride_wn,
                        stride_sn, GATED, ROWS, LW, LS, LX)
    for k0 in range(0, K, 128):
        ahead = _load_step(x_row, w_gate, s_gate, w_up, s_up,
                           gl.minimum(k0 + 128 * AHEAD, K - 128), stride_wn, stride_sn, GATED,
                           ROWS, LW, LS, LX)
        xs, wg, sg, wu, su = s0
        b = _activations(xs, B_OP)
        acc = mma_v2(_decoded_tile(wg, sg, ROWS, LD, A_OP), b, acc)
        if GATED:
            acc_up = mma_v2(_decoded_tile(wu, su, ROWS, LD, A_OP), b, acc_up)
        s0 = s1
        if AHEAD == 3:
            s1 = s2
            s2 = ahead
        else:
            s1 = ahead
    scale_2 = gl.load(s2_ptr + expert) * 256.0
    if GATED:  # the reference's roundings: gate, up, silu, product to BF16
        gate = (acc * scale_2).to(gl.bfloat16).to(gl.float32)
        up = (acc_up * scale_2).to(gl.bfloat16).to(gl.float32)
        silu = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
        out = (silu * up).to(gl.bfloat16)
    else:
        out = (acc * scale_2).to(gl.bfloat16)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
    tok = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    ptrs = out_ptr + pair.to(gl.int64) * stride_om + n0 + gl.expand_dims(rows, 1) \
        + gl.expand_dims(tok, 0) * 0
    gl.store(ptrs, out, mask=gl.expand_dims(rows >= 0, 1) & gl.expand_dims(tok == 0, 0))


def launch(x, ids, w, s, s2, out, n, k, gated, num_warps=2, rows=32, x_rows_per_pair=1,
           ahead=2):
    """One expert GEMM for the pairs of ids (one token's top-k experts at T = 1)."""
    assert n % rows == 0 and k % BLOCK_K == 0
    lay = layouts(num_warps, rows)
    words = w.view(torch.int32)
    return _gemm_kernel[(ids.numel(), n // rows)](
        x, ids, words, s, s2, out, n, k, x_rows_per_pair, x.stride(0), words.stride(0),
        words.stride(1), s.stride(0), s.stride(1), out.stride(0), GATED=gated, ROWS=rows,
        MMA=lay["mma"], A_OP=lay["a_op"], B_OP=lay["b_op"], LD=lay["decode"], LW=lay["words"],
        LS=lay["scales"], LX=lay["x"], AHEAD=ahead, num_warps=num_warps)


def moe_t1(x, ids, weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, hbuf, y,
           num_warps=2, rows=32, ahead=2):
    """The batch-1 routed experts: gate/up and down through the Gluon kernels, combined."""
    e_inner, h = w13.shape[1] // 2, x.shape[1]
    top_k = ids.numel()
    launch(x, ids, w13, w13_scale, w13_scale_2, hbuf, e_inner, h, True, num_warps, rows, top_k,
           ahead)
    launch(hbuf, ids, w2, w2_scale, w2_scale_2, y, h, e_inner, False, num_warps, rows, 1, ahead)
    return (weights.reshape(-1, 1) * y.float()).sum(0, keepdim=True).to(x.dtype)


def main():
    import kernels_moe as km
    from beam_trtllm.config import preset
    from kernels import time_graph_us
    from plugins import moe_nvfp4

    cfg = preset("beam-1.0-501b")
    packed = km.experts("nvfp4", cfg, seed=1)
    x, ids, w = km.routing(cfg, 1, seed=1)
    args = km.moe_args("nvfp4", x, ids, w, packed)
    want = moe_nvfp4.ref_moe_nvfp4(*args).float()
    floor = km.expert_bytes(packed, ids) / 4274e9 * 1e6
    top_k, inner, h = ids.numel(), cfg.moe_intermediate_size, cfg.hidden_size
    ids32 = ids.reshape(-1).to(torch.int32).contiguous()
    hbuf = torch.empty(top_k, inner, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(top_k, h, device="cuda", dtype=torch.bfloat16)
    if "--once" in sys.argv:  # three plain calls of the 2-warp shape, for a profiler
        for _ in range(3):
            moe_t1(x, ids32, w.reshape(-1), *args[3:], hbuf, y)
        torch.cuda.synchronize()
        return
    ours = moe_nvfp4.moe_nvfp4_triton(*args)
    shipped = time_graph_us(lambda: moe_nvfp4.moe_nvfp4_triton(*args))
    print(f"moe_nvfp4 T=1: floor {floor:.1f} us; shipped {shipped:.1f} us "
          f"(rel {((ours.float() - want).norm() / want.norm()).item():.1e})", flush=True)
    for num_warps, rows, ahead in ((2, 32, 2), (2, 32, 3), (1, 16, 3), (4, 64, 3)):
        def run():
            return moe_t1(x, ids32, w.reshape(-1), *args[3:], hbuf, y, num_warps, rows, ahead)
        try:
            got = run().float()
            rel = ((got - want).norm() / want.norm()).item()
            us = time_graph_us(run)
        except Exception as exc:  # a shape that does not compile: report, go on
            print(f"gluon {num_warps} warps x {rows} rows, {ahead} ahead: {type(exc).__name__}: "
                  f"{str(exc)[:300]}")
            continue
        print(f"gluon {num_warps} warps x {rows} rows, {ahead} ahead: {us:7.1f} us  "
              f"{us / floor:.2f}x floor  "
              f"rel {rel:.1e}", flush=True)


if __name__ == "__main__":
    main()
