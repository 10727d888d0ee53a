"""Can torch's CUTLASS grouped FP8 GEMM (torch._scaled_grouped_mm, rowwise scales) carry the
MoE prefill GEMMs faster than the Triton grouped GEMMs? Times both GEMM shapes of a 16K-token
Beam-1.0 prefill (E=256, top-8, realistic routing) and checks one expert against _scaled_mm.

    PYTHONPATH=. python3 bench/moe_grouped_probe.py
"""

from __future__ import annotations

import torch
import triton

import kernels_moe as km
from beam_trtllm.config import preset

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


def main():
    cfg = preset("beam-1.0-501b")
    e, h, inner, t = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, 16384
    x, ids, _ = km.routing(cfg, t, seed=3)
    k = ids.shape[1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(e, 2 * inner, h, device="cuda", generator=gen) * 16).to(FP8)
    w2 = (torch.randn(e, h, inner, device="cuda", generator=gen) * 16).to(FP8)
    s13 = torch.rand(e, 2 * inner, device="cuda") * 1e-3 + 1e-3
    s2 = torch.rand(e, h, device="cuda") * 1e-3 + 1e-3
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    for pad in (1, 16, 128):
        counts = torch.bincount(flat, minlength=e)
        padded = (counts + pad - 1) // pad * pad
        offs = torch.cumsum(padded, 0).to(torch.int32)
        rows = int(offs[-1])
        # row r of group g: the pairs of expert g in order, then padding (token 0)
        starts = torch.cumsum(padded, 0) - padded
        dst = starts.repeat_interleave(counts) + (torch.arange(flat.numel(), device="cuda")
                                                  - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts))
        tok = torch.zeros(rows, dtype=torch.long, device="cuda")
        tok[dst] = order // k
        a = (x[tok] * 8).to(FP8)
        sa = torch.full((rows,), 0.125, device="cuda")
        try:
            run13 = lambda: torch._scaled_grouped_mm(a, w13.transpose(1, 2), sa, s13, offs=offs,  # noqa: E731
                                                     out_dtype=BF16)
            out = run13()
            ms = triton.testing.do_bench(run13, warmup=10, rep=50)
            flops = 2 * rows * h * 2 * inner
            useful = 2 * flat.numel() * h * 2 * inner
            g = int(flat[order[0]])  # first expert with tokens: check against _scaled_mm
            n0 = int(counts[g])
            ref = torch._scaled_mm(a[:n0], w13[g].t(), torch.tensor(0.125, device="cuda"),
                                   torch.tensor(1.0, device="cuda"), out_dtype=torch.float32)
            ref = (ref * s13[g][None, :]).to(BF16)
            err = ((out[:n0].float() - ref.float()).norm() / ref.float().norm()).item()
            print(f"pad {pad:3d} gate/up: rows {rows}, {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s "
                  f"({useful / ms / 1e9:.0f} useful), rel err vs _scaled_mm {err:.1e}", flush=True)
            hq = torch.randn(rows, inner, device="cuda").to(FP8)
            run2 = lambda: torch._scaled_grouped_mm(hq, w2.transpose(1, 2), sa, s2, offs=offs,  # noqa: E731
                                                    out_dtype=BF16)
            run2()
            ms2 = triton.testing.do_bench(run2, warmup=10, rep=50)
            print(f"pad {pad:3d} down: {ms2:.3f} ms, {2 * rows * h * inner / ms2 / 1e9:.0f} TFLOP/s",
                  flush=True)
        except Exception as exc:  # report what the op refuses, go on
            print(f"pad {pad}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
