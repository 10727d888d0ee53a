"""Would TMA weight loads lift beam::moe_fp8's 16K-token prefill (issue 4: >= 60% of the FP8
GEMM rate; 53-55% with pointer loads)? A bench-only copy of the sorted-rows path of
`_moe_fp8_kernel` whose weight tiles come through a host-made TMA descriptor (the activation
rows stay gathered by pointer: Hopper's TMA has no row gather), timed against the shipped op on
the same routing and checked against it.

    PYTHONPATH=. python3 bench/moe_tma_probe.py [--t 16384]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from plugins._common import TL_DTYPES, e4m3_grid
from plugins._fp8_act import quant_fp8_per_tensor
from plugins._gemm import acc_zeros, mma_fp8, round_to, silu_mul, tile_of, unswap
from plugins._moe_common import GemmConfig, block_rows, combine, plan_routing, routing_ptrs
from plugins.moe_fp8 import moe_fp8_triton

FP8 = torch.float8_e4m3fn


@triton.jit
def _moe_fp8_tma_kernel(a_ptr, a_scale_ptr, w_desc, ws_ptr, out_ptr, out_scale_ptr,
                        ids_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, numel, top_k, num_m,
                        N, K, w_rows, stride_am, stride_se, stride_om, ACT: tl.constexpr,
                        GATED: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        STAGES: tl.constexpr):
    pid_m, pid_n = tile_of(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert, slots, valid, rows = block_rows(pid_m, ids_ptr, sorted_ptr, block_expert_ptr, numel,
                                            False, BLOCK_M)
    a_rows = (slots // top_k) if GATED else rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_row = (expert * w_rows + pid_n * BLOCK_N).to(tl.int32)
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    acc_up = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        acc = mma_fp8(acc, a, w_desc.load([w_row, k0]), SWAP, BLOCK_K)
        if GATED:
            acc_up = mma_fp8(acc_up, a, w_desc.load([w_row + N, k0]), SWAP, BLOCK_K)
        a_ptrs += BLOCK_K
    a_scale = tl.load(a_scale_ptr)
    ws_ptrs = ws_ptr + expert * stride_se + offs_n
    gate = unswap(acc, SWAP) * a_scale * tl.load(ws_ptrs, mask=n_mask, other=0.0)[None, :]
    if GATED:
        up = unswap(acc_up, SWAP) * a_scale * tl.load(ws_ptrs + N, mask=n_mask, other=0.0)[None, :]
        out = e4m3_grid(tl.div_rn(silu_mul(gate, up, ACT), tl.load(out_scale_ptr)))
        out_rows = rows
    else:
        out = round_to(gate, ACT)
        out_rows = slots
    out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _gemm(a, a_scale, w, ws, out, out_scale, routing, numel, top_k, n, k, gated, cfg, stages):
    e, rows_e, _ = w.shape
    desc = TensorDescriptor.from_tensor(w.view(e * rows_e, k), [cfg.block_n, cfg.block_k])
    grid = (routing.m_blocks * triton.cdiv(n, cfg.block_n),)
    _moe_fp8_tma_kernel[grid](
        a, a_scale, desc, ws, out, out_scale, *routing_ptrs(routing), numel, top_k,
        routing.m_blocks, n, k, rows_e, a.stride(0), ws.stride(0), out.stride(0),
        ACT=TL_DTYPES[torch.bfloat16], GATED=gated, SWAP=cfg.swap, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, STAGES=stages,
        num_warps=cfg.num_warps)


def moe_fp8_tma(x, ids, weights, w13, w13_scale, w2, w2_scale, a13_scale, a2_scale, c13, c2,
                stages):
    t, h = x.shape
    top_k, inner = ids.shape[1], w2.shape[2]
    numel = t * top_k
    routing = plan_routing(ids, w13.shape[0], c13.block_m, False)
    xq = quant_fp8_per_tensor(x, a13_scale)
    hq = torch.empty((routing.rows, inner), dtype=FP8, device=x.device)
    _gemm(xq, a13_scale, w13, w13_scale, hq, a2_scale, routing, numel, top_k, inner, h, True,
          c13, stages)
    y = torch.empty((numel, h), dtype=torch.bfloat16, device=x.device)
    _gemm(hq, a2_scale, w2, w2_scale, y, a2_scale, routing, numel, top_k, h, inner, False, c2,
          stages)
    return combine(y, weights, t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=16384)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    e, h, inner, k = (256, 5120, 2560, 8) if dev == "cuda" else (8, 256, 128, 2)
    t = args.t if dev == "cuda" else 40
    torch.manual_seed(0)
    w13 = (torch.randn(e, 2 * inner, h, device=dev) * 0.5).to(FP8)
    w2 = (torch.randn(e, h, inner, device=dev) * 0.5).to(FP8)
    w13_scale = torch.rand(e, 2 * inner, device=dev) / h**0.5 + 1e-3
    w2_scale = torch.rand(e, h, device=dev) / inner**0.5 + 1e-3
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, k, device=dev)
    a13 = (x.abs().amax().float() / 448).reshape(())
    a2 = torch.tensor(0.5 / 448, device=dev)
    shipped = lambda: moe_fp8_triton(x, ids, weights, w13, w13_scale, w2, w2_scale, a13, a2)  # noqa: E731
    want = shipped()
    bench = (lambda fn: triton.testing.do_bench(fn, warmup=5, rep=200, return_mode="median") * 1e3
             ) if dev == "cuda" else (lambda fn: (fn(), 0.0)[1])
    flops = 2 * t * k * 3 * h * inner
    base = bench(shipped)
    print(f"T={t}: shipped moe_fp8 {base:.1f} us = {flops / max(base, 1e-9) / 1e6:.0f} TFLOP/s",
          flush=True)
    cands = [(GemmConfig(128, 128, 128, 8, 3, 1, True), GemmConfig(128, 128, 128, 4, 3), 3),
             (GemmConfig(128, 128, 128, 8, 3, 1, True), GemmConfig(128, 128, 128, 8, 3), 3),
             (GemmConfig(128, 128, 128, 8, 3, 1, True), GemmConfig(128, 128, 128, 8, 3), 4),
             (GemmConfig(128, 128, 128, 8, 3, 8, False), GemmConfig(128, 256, 128, 8, 3), 3),
             (GemmConfig(128, 64, 128, 4, 3, 8, False), GemmConfig(128, 128, 128, 4, 3), 4)]
    if dev != "cuda":
        cands = [(GemmConfig(16, 32, 64, 4, 2, 1, True), GemmConfig(16, 32, 64, 4, 2), 2)]
    for c13, c2, stages in cands:
        try:
            got = moe_fp8_tma(x, ids, weights, w13, w13_scale, w2, w2_scale, a13, a2, c13, c2, stages)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            us = bench(lambda: moe_fp8_tma(x, ids, weights, w13, w13_scale, w2, w2_scale, a13, a2,
                                           c13, c2, stages))
        except Exception as exc:  # noqa: BLE001  (a shape that does not fit: report, go on)
            print(f"  TMA {c13} {c2} stages {stages}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        rate = flops / us / 1e6 if us else 0.0
        print(f"  TMA gate/up {c13} down {c2} stages {stages}: {us:.1f} us = {rate:.0f} TFLOP/s, "
              f"rel diff vs shipped {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
