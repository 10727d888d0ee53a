"""How far the FP8 W8A8 GEMMs land from the exact product on a GPU, and why.

    PYTHONPATH=. python3 bench/fp8_mma_precision.py [--out DIR]

For the shapes of tests/plugins/test_linear_kernels.py and two Beam-1.0 projections, the exact
result is the FP64 product of the decoded FP8 codes (activation codes * input_scale, weight
codes * weight_scale). Against it: beam::linear_fp8's Triton GEMM at several BLOCK_K (its FP8
MMA partial sums are promoted to FP32 every BLOCK_K products) with and without swap-AB, and
cuBLAS FP8 (`torch._scaled_mm`). Printed per variant: max |error|, max |error| / |exact| over
outputs with |exact| > 0.1, and max |error| / (|x| @ |W|^T) (the error as a share of the sum of
absolute products, the quantity a reduced-precision accumulator's error scales with).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from beam_trtllm import quant_formats as qf  # noqa: E402
from plugins._moe_common import GemmConfig  # noqa: E402
from plugins.linear_fp8 import linear_fp8_triton  # noqa: E402
from plugins.linear_fp8_block import linear_fp8_block_triton, ref_linear_fp8_block  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def problem(m: int, k: int, n: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    pairs = [qf.quantize_fp8(row) for row in w]
    wq, ws = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    xs = (x.abs().amax().float() / qf.FP8_MAX).reshape(())
    xq = qf.quantize_fp8_activation(x, xs)
    return xq, wq, ws, xs


def errors(got: torch.Tensor, xq, wq, ws, xs) -> dict:
    xd = xq.double() * xs.double()
    wd = wq.double() * ws.double()[:, None]
    exact = xd @ wd.t()
    abs_sum = xd.abs() @ wd.abs().t()
    err = (got.double().cpu() - exact).abs()
    big = exact.abs() > 0.1
    return dict(max_abs=err.max().item(), max_rel=(err[big] / exact.abs()[big]).max().item(),
                max_share_of_abs_sum=(err / abs_sum.clamp_min(1e-30)).max().item(),
                exact_rms=exact.pow(2).mean().sqrt().item())


def variants(m: int):
    for swap in (True, False):
        for bk in (64, 128, 256, 512):
            bm = 16 if swap else 64
            yield f"triton swap={swap} BLOCK_K={bk}", GemmConfig(bm, 64, bk, 4, 3, swap=swap)


def block_rows(name, m, k, n, seed):
    """linear_fp8_block (per-token-per-128 activations, 128x128 weight blocks): the kernel and
    the op's reference (run on the same device) against the FP64 product of the same codes."""
    rows = []
    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
        wq, ws = qf.quantize_fp8_block(w)
        xq, xs = qf.quantize_fp8_per_token_block(x.float())
        xd = xq.double() * xs.double().repeat_interleave(128, dim=-1)[:, :k]
        wd = qf.dequantize_fp8(wq, ws).double()
        exact, abs_sum = xd @ wd.t(), xd.abs() @ wd.abs().t()
        dev = [t.to(DEV) for t in (x, wq, ws)]
        outs = {"triton linear_fp8_block": linear_fp8_block_triton(*dev),
                "ref_linear_fp8_block (same device)": ref_linear_fp8_block(*dev)}
        for label, got in outs.items():
            err = (got.double().cpu() - exact).abs()
            big = exact.abs() > 0.1
            e = dict(max_abs=err.max().item(), max_rel=(err[big] / exact.abs()[big]).max().item(),
                     max_share_of_abs_sum=(err / abs_sum.clamp_min(1e-30)).max().item(),
                     exact_rms=exact.pow(2).mean().sqrt().item())
            rows.append(dict(shape=name, dtype=str(dtype)[6:], variant=label, **e))
            print(f"{name:12s} {str(dtype)[6:]:8s} {label:36s} max|err| {e['max_abs']:.2e}  "
                  f"max rel {e['max_rel']:.2e}  max err/sum|p| {e['max_share_of_abs_sum']:.2e}"
                  f"  (rms {e['exact_rms']:.2f})", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    shapes = [("test t=19", 19, 208, 72, 19), ("test t=131", 131, 208, 72, 131),
              ("qkv t=1", 1, 5120, 8192, 1), ("o_proj t=16", 16, 6144, 5120, 2)]
    rows = []
    for name, m, k, n, seed in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            xq, wq, ws, xs = problem(m, k, n, seed, dtype)
            dev = [t.to(DEV) for t in (xq, wq, ws, xs)]
            outs = {label: linear_fp8_triton(*dev, out_dtype=torch.float32, config=cfg)
                    for label, cfg in variants(m)}
            if DEV == "cuda" and n % 16 == 0 and k % 16 == 0:  # _scaled_mm's shape rule
                outs["cuBLAS _scaled_mm (bf16 out)"] = torch._scaled_mm(
                    dev[0], dev[1].t(), scale_a=dev[3].expand(m, 1).contiguous(),
                    scale_b=dev[2].view(1, n), out_dtype=torch.bfloat16)
            for label, got in outs.items():
                e = errors(got, xq, wq, ws, xs)
                rows.append(dict(shape=name, dtype=str(dtype)[6:], variant=label, **e))
                print(f"{name:12s} {str(dtype)[6:]:8s} {label:32s} max|err| {e['max_abs']:.2e}  "
                      f"max rel {e['max_rel']:.2e}  max err/sum|p| {e['max_share_of_abs_sum']:.2e}"
                      f"  (rms {e['exact_rms']:.2f})", flush=True)
    for name, m, k, n, seed in (("block t=3", 3, 208, 72, 3), ("block t=131", 131, 208, 72, 131),
                                ("block qkv t=1", 1, 5120, 8192, 1)):
        rows += block_rows(name, m, k, n, seed)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_mma_precision.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
