"""Would a persistent schedule speed up the FP8 MoE prefill GEMMs? Each of moe_fp8's two
grouped GEMMs (16K tokens, Beam-1.0 shapes, 128-row blocks) as shipped (one program per
tile) against the same tiles walked by one program per SM, with and without Triton's loop
flattening (which lets the next tile's loads start during a tile's epilogue). Outputs must
be bit-equal to the shipped kernel's.

    PYTHONPATH=. python3 bench/moe_persistent_probe.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels as kb
import kernels_moe as km
from beam_trtllm.config import preset
from plugins import moe_fp8
from plugins._common import TL_DTYPES
from plugins._fp8_act import quant_fp8_per_tensor
from plugins._gemm import tile_of
from plugins._moe_common import GemmConfig, block_tile, plan_routing, routing_ptrs


@triton.jit
def _persistent_kernel(a_ptr, a_scale_ptr, w_ptr, ws_ptr, out_ptr, out_scale_ptr, ids_ptr,
                       sorted_ptr, block_expert_ptr, num_rows_ptr, numel, top_k, N, K,
                       stride_am, stride_we, stride_wn, stride_se, stride_om,
                       ACT: tl.constexpr, GATED: tl.constexpr, SWAP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr):
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.load(num_rows_ptr) // BLOCK_M  # only the row blocks in use: no idle tiles
    for t in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = tile_of(t, num_m, num_n, GROUP_M)
        tile = block_tile(pid_m, pid_n, ids_ptr, sorted_ptr, block_expert_ptr, numel, top_k, N,
                          GATED, False, BLOCK_M, BLOCK_N)
        moe_fp8._fp8_tile(tile, a_ptr, None, 0, a_scale_ptr, w_ptr, None, ws_ptr, out_ptr,
                          out_scale_ptr, N, K, stride_am, stride_we, stride_wn, stride_se,
                          stride_om, ACT, GATED, SWAP, False, BLOCK_M, BLOCK_N, BLOCK_K)


def persistent(a, a_scale, w, ws, out, out_scale, routing, numel, top_k, n, k, gated, cfg,
               programs, flatten):
    _persistent_kernel[(programs,)](
        a, a_scale, w, ws, out, out_scale, *routing_ptrs(routing), numel, top_k, n, k,
        a.stride(0), w.stride(0), w.stride(1), ws.stride(0), out.stride(0),
        ACT=TL_DTYPES[torch.bfloat16], GATED=gated, SWAP=cfg.swap, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PROGRAMS=programs,
        FLATTEN=flatten, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def main() -> None:
    cfg = preset("beam-1.0-501b")
    h, inner, t = cfg.hidden_size, cfg.moe_intermediate_size, 16384
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceil = kb.measure_ceilings()
    print(f"ceilings: FP8 {ceil['fp8_TFLOPs']:.0f} TFLOP/s; {sms} SMs")
    packed = km.experts("fp8", cfg, seed=1)
    x, ids, _ = km.routing(cfg, t, seed=t)
    a13 = (x.abs().amax().float() / 448).reshape(())
    a2 = torch.tensor(km.H_AMAX / 448, device="cuda")
    numel = ids.numel()
    routing = plan_routing(ids, cfg.num_experts, 128, direct=False)
    xq = quant_fp8_per_tensor(x, a13)
    h_ref = torch.empty((routing.rows, inner), dtype=torch.float8_e4m3fn, device="cuda")
    y_ref = torch.empty((numel, h), dtype=torch.bfloat16, device="cuda")
    c13 = GemmConfig(128, 128, 128, 8, 3, swap=True)
    c2 = GemmConfig(128, 128, 128, 4, 3)
    gemms = {
        "gate/up": (c13, (xq, a13, packed["w13"], packed["w13_scale"], h_ref, a2), inner, h, True),
        "down": (c2, (h_ref, a2, packed["w2"], packed["w2_scale"], y_ref, a2), h, inner, False),
    }
    for name, (c, (a, a_s, w, ws, out, out_s), n, k, gated) in gemms.items():
        def shipped():
            moe_fp8._gemm(a, a_s, w, ws, out, out_s, routing, numel, 8, n, k, gated,
                          torch.bfloat16, c)
        out.zero_()  # rows past the sorted ones are never written
        shipped()
        want = out.clone()
        flops = 2 * numel * n * k * (2 if gated else 1)
        us = kb.time_us(shipped)
        print(f"{name:8s} shipped            {us / 1e3:7.3f} ms  {flops / us / 1e6:6.0f} TFLOP/s")
        for programs in (sms, 2 * sms):
            for flatten in (False, True):
                def run():
                    persistent(a, a_s, w, ws, out, out_s, routing, numel, 8, n, k, gated, c,
                               programs, flatten)
                try:
                    out.zero_()
                    run()
                    same = torch.equal(out.view(torch.uint8), want.view(torch.uint8))
                    us = kb.time_us(run)
                    print(f"{name:8s} {programs:3d} programs {'flat' if flatten else 'nest'}  "
                          f"{us / 1e3:7.3f} ms  {flops / us / 1e6:6.0f} TFLOP/s  "
                          f"{'bit-equal' if same else 'DIFFERENT'}", flush=True)
                except Exception as exc:  # a variant that does not compile: say so, go on
                    print(f"{name:8s} {programs} {flatten}: {type(exc).__name__}: "
                          f"{str(exc)[:200]}", flush=True)
        out.copy_(want)  # the down GEMM reads the shipped h


if __name__ == "__main__":
    main()
