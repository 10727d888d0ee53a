"""Can an explicit-layout (Gluon) kernel do the NVFP4 batch-1 expert GEMMs near their read floor?
(issue 4; a probe, not an op)

`moe_nvfp4`'s Triton decode stages every weight word, block scale and activation tile in shared
memory and reads it back in the decoder's layout (bench/nvfp4_probe.py --hot, ncu: bound by that
shared-memory and instruction stream, 76.7 us with the weights L2-resident). Here every layout
is explicit, chosen so that each thread holds exactly what `mma.sync` wants of it:

* A weight row's 16 words of a 128-deep K step are read 4 words (16 bytes) a thread: lane
  c = lane % 4 holds words 4c .. 4c + 3 of rows lane // 4 (+ 8) of its warp's 16-row tile.
* The decoded tile's logical K order is chosen so that this is exactly the MMA's A fragment
  (and the code-pair decoder of plugins/_tiles.py applies): word p = 4c + kb, code pair
  (q, q + 4) with q = 2h + m lands at logical k = 32 kb + 16 h + 8 m + 2 c (+1). The
  activations take the same order: thread c reads x[32 c .. 32 c + 32) of the step.
* Words and block-scale words go through a ring of shared-memory stages by asynchronous
  copies, each thread copying exactly the bytes it later reads in the layout above; the
  activations (L1-resident) are loaded into registers one step ahead, pre-permuted (x by `permuted_activations`, h by the gate/up
  kernel's store) so that the B operand needs no byte shuffles.

H200 (docs/BENCHMARKS.md, session 9 runs J, K): correct (rel 8.6e-4), but slower than the
shipped Triton kernel (85 us): a first version that prefetched into registers instead of shared
memory took 110 us (global-load latency; commit 09c5ee0); with everything in shared memory
143-161 us (reads queued on the MIO pipe; one compiler-inserted barrier a step); this one 134
us. Kept as the starting point of an explicit-layout decode: the layouts and the decode are
right, the staging is not yet.

    PYTHONPATH=.:bench python3 bench/nvfp4_gluon_probe.py [--once]   # H200: time + check
    PYTHONPATH=.:bench:tests/plugins python3 bench/nvfp4_gluon_probe.py --sass   # CPU: compile
"""

from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.ampere.async_copy import (
    async_copy_global_to_shared, commit_group, wait_group,
)

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
    [rows, 4] (element (r, c): the step's block-scale word c // 2 of row r, the one holding
    thread c's two scales) and x [TOKENS, 128]: what each thread copies and reads back, 4
    words / 1 scale word / 32 activations, contiguous."""
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
    scales = _lin(rows_then(1, row_reg), others([[1], [2]]) + rows_then(1, row_lane),
                  rows_then(1, row_warp), [rows, 4])
    x = _lin([[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]],
             [[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]], [[0, 0]] * warp_bits, [TOKENS, 128])
    return dict(mma=mma, a_op=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                b_op=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
                decode=decode, words=words, scales=scales, x=x)


SMEM = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=1, order=[1, 0])  # plain rows


@gluon.jit
def _ptrs2(ptr, n0: gl.constexpr, n1: gl.constexpr, stride0, L: gl.constexpr):
    """ptr[i * stride0 + j] for the [n0, n1] tile in layout L, and its row index."""
    i = gl.arange(0, n0, layout=gl.SliceLayout(1, L))
    j = gl.arange(0, n1, layout=gl.SliceLayout(0, L))
    return ptr + gl.expand_dims(i.to(gl.int64) * stride0, 1) + gl.expand_dims(j, 0), i


@gluon.jit
def _scale_ptrs(ptr, n0: gl.constexpr, stride0, L: gl.constexpr):
    """[n0, 4] pointers: element (r, c) -> ptr[r * stride0 + c // 2] (int32 scale words)."""
    i = gl.arange(0, n0, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, L))
    return ptr + gl.expand_dims(i.to(gl.int64) * stride0, 1) + gl.expand_dims(c // 2, 0)


@gluon.jit
def _block_scales(words, ROWS: gl.constexpr, LS: gl.constexpr, S3: gl.constexpr):
    """words [ROWS, 4] int32 (thread c's scale word) -> [ROWS, 4 c, 2 kbh] BF16 scales *
    2^118 in layout S3: bytes 2 (c % 2) and 2 (c % 2) + 1 of the word, E4M3."""
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, LS))
    shifted = words.to(gl.uint32, bitcast=True) >> gl.expand_dims((c % 2) * 16, 0).to(gl.uint32)
    both = gl.join(shifted & 0xFF, (shifted >> 8) & 0xFF)
    e4m3 = both.to(gl.uint8).to(gl.float8e4nv, bitcast=True)
    scale = (e4m3.to(gl.float32) * 3.32306998946229e+35).to(gl.bfloat16)  # * 2^118 (exact)
    return gl.convert_layout(scale, S3, assert_trivial=True)


@gluon.jit
def _decoded_tile(words, scales, ROWS: gl.constexpr, LD: gl.constexpr, A_OP: gl.constexpr):
    """words [ROWS, 16] int32, scales [ROWS, 4 c, 2 kbh] (`_block_scales`) -> the decoded
    [ROWS, 128] BF16 tile (E2M1 * scale * 2^-8) in the MMA's A layout, logical k =
    32 kb + 16 h + 8 m + 2 c + j holding code q + 4 j (q = 2 h + m) of word 4 c + kb."""
    W4: gl.constexpr = gl.SliceLayout(4, LD)
    w = gl.convert_layout(gl.reshape(words, [ROWS, 4, 2, 2]), W4, assert_trivial=True)
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(
        2, gl.SliceLayout(3, LD)))))
    q = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(q, 0), 1), 2), 3)
    w = gl.expand_dims(w, 4)
    high = (w.to(gl.uint32, bitcast=True) >> 8).to(gl.int32, bitcast=True)
    src = gl.where(q >= 2, high, w)  # codes 2, 6 and 3, 7 moved to where 0, 4 and 1, 5 sit
    mask = gl.where(q % 2 == 0, PAIR_MASK_EVEN, PAIR_MASK_ODD)
    mul = gl.where(q % 2 == 0, PAIR_MUL_EVEN, PAIR_MUL_ODD)
    scale = gl.expand_dims(gl.expand_dims(scales, 3), 4)
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
    """x [TOKENS, 128]: the step's activations stored in `permuted_activations` order (thread
    c's 32: c, kbh, kbl, h, m, j) -> [128, TOKENS] in the MMA's B layout, logical K order."""
    x = gl.reshape(x, [8, 4, 2, 2, 2, 2, 2])
    x = gl.reshape(gl.permute(x, (0, 2, 3, 4, 5, 1, 6)), [8, 128])
    return gl.convert_layout(gl.permute(x, (1, 0)), B_OP)


@gluon.jit
def _copy_step(slot, k, wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, bufs, GATED: gl.constexpr):
    """Start the asynchronous copies of the K step at k into stage `slot` (each thread copies
    exactly what it reads back later: no barrier)."""
    swg, ssg, swu, ssu = bufs
    k = gl.multiple_of(k, 128)
    async_copy_global_to_shared(swg.index(slot), wg_ptrs + k // 8)
    async_copy_global_to_shared(ssg.index(slot), sg_ptrs + k // 64)
    if GATED:
        async_copy_global_to_shared(swu.index(slot), wu_ptrs + k // 8)
        async_copy_global_to_shared(ssu.index(slot), su_ptrs + k // 64)
    commit_group()


@gluon.jit
def _gemm_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, s2_ptr, out_ptr, N, K, x_rows_per_pair,
                 stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                 GATED: gl.constexpr, PERMUTE_OUT: gl.constexpr, ROWS: gl.constexpr,
                 STAGES: gl.constexpr, MMA: gl.constexpr, A_OP: gl.constexpr,
                 B_OP: gl.constexpr, LD: gl.constexpr, LW: gl.constexpr, LS: gl.constexpr,
                 LX: gl.constexpr):
    """One (token, expert) pair's rows [pid_n * ROWS, + ROWS) of an NVFP4 expert GEMM at T = 1:
    gate/up (GATED: silu(gate) * up to out[pair], with PERMUTE_OUT in the order the down
    GEMM's activations take) or down (out[pair] = h[pair] @ w2^T). x rows in
    `permuted_activations` order; scales read as int32 words (s_ptr, strides in words)."""
    pair = gl.program_id(0)
    n0 = gl.program_id(1) * ROWS
    expert = gl.load(ids_ptr + pair).to(gl.int64)
    x_row = x_ptr + (pair // x_rows_per_pair).to(gl.int64) * stride_xm
    w_gate = w_ptr + expert * stride_we + n0 * stride_wn
    s_gate = s_ptr + expert * stride_se + n0 * stride_sn
    x_ptrs, tok = _ptrs2(x_row, 8, 128, 0, LX)
    x_ok = gl.expand_dims(tok == 0, 1)
    wg_ptrs, _ = _ptrs2(w_gate, ROWS, 16, stride_wn, LW)
    sg_ptrs = _scale_ptrs(s_gate, ROWS, stride_sn, LS)
    wu_ptrs = wg_ptrs + N * stride_wn
    su_ptrs = sg_ptrs + N * stride_sn
    swg = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, 16], SMEM)
    ssg = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, 4], SMEM)
    swu = swg
    ssu = ssg
    if GATED:
        swu = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, 16], SMEM)
        ssu = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, 4], SMEM)
    bufs = (swg, ssg, swu, ssu)
    S3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, LD))
    for i in gl.static_range(STAGES - 1):
        _copy_step(i, gl.minimum(i * 128, K - 128), wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, bufs,
                   GATED)
    acc = gl.zeros([ROWS, 8], gl.float32, MMA)
    acc_up = gl.zeros([ROWS, 8], gl.float32, MMA)
    steps = K // 128
    # the activations (the same few KB for every program: L1-resident) straight from global
    # memory into registers, one step ahead
    xs = gl.load(x_ptrs, mask=x_ok, other=0.0, cache_modifier=".ca")
    for i in range(steps):
        ahead = i + STAGES - 1  # (past the last step: the last one again, an L2 hit)
        _copy_step(ahead % STAGES, gl.minimum(ahead * 128, K - 128), wg_ptrs, sg_ptrs, wu_ptrs,
                   su_ptrs, bufs, GATED)
        xs_next = gl.load(x_ptrs + gl.multiple_of(gl.minimum(i * 128 + 128, K - 128), 128),
                          mask=x_ok, other=0.0, cache_modifier=".ca")
        wait_group(STAGES - 1)
        slot = i % STAGES
        b = _activations(xs, B_OP)
        xs = xs_next
        sg = _block_scales(ssg.index(slot).load(LS), ROWS, LS, S3)
        acc = mma_v2(_decoded_tile(swg.index(slot).load(LW), sg, ROWS, LD, A_OP), b, acc)
        if GATED:
            su = _block_scales(ssu.index(slot).load(LS), ROWS, LS, S3)
            acc_up = mma_v2(_decoded_tile(swu.index(slot).load(LW), su, ROWS, LD, A_OP), b,
                            acc_up)
    wait_group(0)
    scale_2 = gl.load(s2_ptr + expert) * 256.0
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
    tok = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    if GATED:  # the reference's roundings: gate, up, silu, product to BF16
        gate = (acc * scale_2).to(gl.bfloat16).to(gl.float32)
        up = (acc_up * scale_2).to(gl.bfloat16).to(gl.float32)
        silu = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
        out = (silu * up).to(gl.bfloat16)
    else:
        out = (acc * scale_2).to(gl.bfloat16)
    cols = n0 + rows
    if PERMUTE_OUT:  # channel 8 t + (4 j + 2 h + m) stored at 8 t + (4 h + 2 m + j)
        low = cols % 8
        cols = cols - low + ((low >> 1) & 1) * 4 + (low & 1) * 2 + (low >> 2)
    ptrs = out_ptr + pair.to(gl.int64) * stride_om + gl.expand_dims(cols, 1) \
        + gl.expand_dims(tok, 0) * 0
    gl.store(ptrs, out, mask=gl.expand_dims(rows >= 0, 1) & gl.expand_dims(tok == 0, 0))


def permuted_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> the order the kernels read: in each group of 8, element 4 j + 2 h + m
    moves to 4 h + 2 m + j (so that a thread's 32 contiguous activations of a step are the
    MMA's B fragment in register order)."""
    lead = tuple(range(x.dim() - 1))
    return x.unflatten(-1, (-1, 2, 2, 2)).permute(*lead, -4, -2, -1, -3).flatten(-4)


def launch(x, ids, w, s, s2, out, n, k, gated, num_warps=2, rows=32, x_rows_per_pair=1,
           stages=4):
    """One expert GEMM for the pairs of ids (one token's top-k experts at T = 1); x in
    `permuted_activations` order, the gate/up output in it too."""
    assert n % rows == 0 and k % BLOCK_K == 0 and s.shape[-1] % 4 == 0
    lay = layouts(num_warps, rows)
    words, scale_words = w.view(torch.int32), s.view(torch.int32)
    return _gemm_kernel[(ids.numel(), n // rows)](
        x, ids, words, scale_words, s2, out, n, k, x_rows_per_pair, x.stride(0),
        words.stride(0), words.stride(1), scale_words.stride(0), scale_words.stride(1),
        out.stride(0), GATED=gated, PERMUTE_OUT=gated, ROWS=rows, STAGES=stages,
        MMA=lay["mma"], A_OP=lay["a_op"], B_OP=lay["b_op"], LD=lay["decode"],
        LW=lay["words"], LS=lay["scales"], LX=lay["x"], num_warps=num_warps)


def moe_t1(x, ids, weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, hbuf, y,
           num_warps=2, rows=32, stages=4):
    """The batch-1 routed experts: gate/up and down through the Gluon kernels, combined."""
    e_inner, h = w13.shape[1] // 2, x.shape[1]
    top_k = ids.numel()
    xp = permuted_activations(x).contiguous()
    launch(xp, ids, w13, w13_scale, w13_scale_2, hbuf, e_inner, h, True, num_warps, rows,
           top_k, stages)
    launch(hbuf, ids, w2, w2_scale, w2_scale_2, y, h, e_inner, False, num_warps, rows, 1,
           stages)
    return (weights.reshape(-1, 1) * y.float()).sum(0, keepdim=True).to(x.dtype)


def compile_report(num_warps=2, rows=32, stages=4):
    """Compile both kernels for sm_90 on this machine (no GPU needed) and print registers,
    shared memory and the K loop's SASS instruction mix (tests/plugins/sm90.py's tools)."""
    import collections

    import sm90

    h, inner, e = 5120, 2560, 8
    fp8 = torch.float8_e4m3fn
    ids = torch.arange(e, dtype=torch.int32)
    with sm90.compile_instead_of_launch() as compiled:
        launch(torch.zeros(1, h, dtype=torch.bfloat16), ids,
               torch.zeros(e, 2 * inner, h // 2, dtype=torch.uint8),
               torch.ones(e, 2 * inner, h // 16).to(fp8), torch.ones(e),
               torch.empty(e, inner, dtype=torch.bfloat16), inner, h, True, num_warps, rows, e,
               stages)
        launch(torch.zeros(e, inner, dtype=torch.bfloat16), ids,
               torch.zeros(e, h, inner // 2, dtype=torch.uint8),
               torch.ones(e, h, inner // 16).to(fp8), torch.ones(e),
               torch.empty(e, h, dtype=torch.bfloat16), h, inner, False, num_warps, rows, 1,
               stages)
    for gemm, (_, kernel) in zip(("gate/up", "down"), compiled):
        ops = collections.Counter(code.split()[1 if code.startswith("@") else 0]
                                  for code in sm90.loop_instructions(kernel))
        print(f"{gemm}: {sm90.resource_usage(kernel)}, loop {sum(ops.values())} instructions: "
              f"{dict(ops.most_common(12))}")


def main():
    if "--sass" in sys.argv:
        return compile_report()
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
    if "--once" in sys.argv:  # three plain calls of the default shape, for a profiler
        for _ in range(3):
            moe_t1(x, ids32, w.reshape(-1), *args[3:], hbuf, y)
        torch.cuda.synchronize()
        return
    ours = moe_nvfp4.moe_nvfp4_triton(*args)
    shipped = time_graph_us(lambda: moe_nvfp4.moe_nvfp4_triton(*args))
    print(f"moe_nvfp4 T=1: floor {floor:.1f} us; shipped {shipped:.1f} us "
          f"(rel {((ours.float() - want).norm() / want.norm()).item():.1e})", flush=True)
    for num_warps, rows, stages in ((2, 32, 4), (2, 32, 6), (2, 32, 8), (1, 16, 6),
                                    (4, 64, 4), (2, 64, 4)):
        def run():
            return moe_t1(x, ids32, w.reshape(-1), *args[3:], hbuf, y, num_warps, rows, stages)
        name = f"gluon {num_warps} warps x {rows} rows, {stages} stages"
        try:
            got = run().float()
            rel = ((got - want).norm() / want.norm()).item()
            us = time_graph_us(run)
        except Exception as exc:  # a shape that does not compile: report, go on
            print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        print(f"{name}: {us:7.1f} us  {us / floor:.2f}x floor  rel {rel:.1e}", flush=True)


if __name__ == "__main__":
    main()
