"""Launch-shape sweeps for the small kernels of a batch-1 decode step (H200), and a chunked
add_rmsnorm for the 16K-token prefill boundary (kept as the alternative the shipped kernel
was measured against).

    PYTHONPATH=. python3 bench/decode_sweep.py
        [--only attn,linear,linear_nvfp4,linear_split[3|4],norm1,norm16k] [--out DIR]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/decode_sweep.py --smoke   # CPU, two configs a grid

Every rate is printed as a share of its ceiling, the copy bandwidth measured in the same run
(the kernels here are bound by their reads). About 1-2 minutes a sweep on an H200; the defaults they chose
are in plugins/_tiles.py, plugins/linear_fp8.py, plugins/rmsnorm.py, plugins/_attention_decode.py.

- attn: decode attention at batch 1 on a sliding layer's 512-slot ring and on a full layer's
  paged cache at 2K context (the engine bench's layers), over key tile, split length and
  pipeline depth (DECODE_CONFIG's BLOCK_N_SHORT / min_split / num_stages), and one split
  (one program per KV head writes the output itself: no combine launch) over tile, depth
  and warps;
- linear / linear_nvfp4: linear_fp8's (FP8 codes in) / linear_nvfp4's swap-AB Triton GEMM at
  M = 1 on q/k/v [8192 x 5120] and o_proj [5120 x 6144] over tile shapes, warps (16/32-row
  tiles on one or two warps run mma.sync) and depths (the default is `_tiles.linear_config`);
  linear_split (linear_split3, linear_split4): linear_fp8 split in two (three, four) over K
  (split_k: FP32 partial sums, which the engine's qk_prep / add_rmsnorm add);
- norm1: add_rmsnorm and add_rmsnorm_fp8 at one token (graph replays), over warps;
- norm16k: add_rmsnorm [16384, 5120] (bytes: read h, y; write h', x) with the shipped kernel
  and a chunked variant that walks each row in 1024-channel chunks (no idle lanes for
  H = 5120, re-reading y and h' from L1/L2 instead of holding the row in registers).
Every configuration's output is checked against the default's before it is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plugins"))

import _common as bc  # noqa: E402
import kernels_bench as kb  # noqa: E402
from _linear_testdata import linear_args  # noqa: E402
import kernels_sweep  # noqa: E402
from beam_trtllm.config import preset  # noqa: E402
from kernels_sweep import patched  # noqa: E402
from plugins import _attention_decode, rmsnorm  # noqa: E402
from plugins._common import cast_rne, sm_count  # noqa: E402
from plugins._moe_common import GemmConfig  # noqa: E402
from plugins.linear_fp8 import linear_fp8_triton  # noqa: E402
from plugins.linear_nvfp4 import linear_nvfp4_triton  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
SKIPPED = (AssertionError, triton.runtime.errors.OutOfResources,
           triton.compiler.errors.CompilationError)


def run_grid(name, grid, timed, work, unit, ceiling):
    """kernels_sweep.run_grid, also skipping a configuration that does not compile or whose
    output is wrong (`checked`)."""
    return kernels_sweep.run_grid(name, grid, timed, work, unit, ceiling, SKIPPED)


def checked(fn, want, exact=True):
    got = fn()
    got = got if isinstance(got, torch.Tensor) else got[0]
    ok = torch.equal(got, want) if exact else torch.allclose(got.float(), want.float(), 1e-2, 1e-2)
    if not ok:
        raise AssertionError("output differs from the default configuration's")


def sweep_attn(cfg, ceil):
    hkv, d, out = cfg.num_key_value_heads, cfg.head_dim, {}
    cases = {"sliding ring 512, ctx 2048": kb.paged_decode_case(cfg, 1, 2048, 64, BF16,
                                                                cfg.sliding_window),
             "full paged, ctx 2048": kb.paged_decode_case(cfg, 1, 2048, 64, BF16)}
    for name, case in cases.items():
        args = {k: v for k, v in case.items() if k != "cu_seqlens_q"}
        want = _attention_decode.launch_decode(**args)
        seen = min(2048, cfg.sliding_window - 1) if case["window"] else 2048
        grid = [dict(BLOCK_N_SHORT=n, min_split_short=s, num_stages_short=st)
                for n in (32, 64) for s in (32, 64, 128, 256) for st in (2, 3)]
        grid += [dict(BLOCK_N_SHORT=n, splits=1, num_stages_short=st, num_warps=w)
                 for n in (32, 64, 128) for st in (2, 3, 4) for w in (4, 8)]  # no combine

        def timed(conf, args=args, want=want):
            fn = lambda: _attention_decode.launch_decode(**args, config=conf)  # noqa: E731
            checked(fn, want, exact=False)  # another split sums in another order
            return bc.time_graph_us(fn)
        out |= run_grid(f"decode B=1 {name}", grid, timed, seen * hkv * d * 2 * 2, "GB/s",
                        ceil["copy_GBps"])
    return out


LINEAR_TILES = [(16, 1), (32, 2), (32, 4), (64, 4), (128, 4)]  # (block_n, warps): 16/32-row
# weight tiles run on mma.sync (one or two warps), 64+ on one warpgroup's wgmma


def sweep_linear(cfg, ceil, fmt="fp8", split=1):
    """split > 1: each projection split over K (linear_fp8's split_k; FP8 only): the partial
    sums' launch, whose reduction the consumer does as it reads them."""
    h, out = cfg.hidden_size, {}
    q_out = cfg.num_attention_heads * cfg.head_dim
    shapes = {"qkvg": (cfg.qkv_gate_size, h), "o_proj": (h, q_out)}
    tiles = LINEAR_TILES if split == 1 else [(64, 4), (32, 2)]
    kw = {"split_k": split} if split > 1 else {}
    for name, (n, k) in shapes.items():
        name += f" split-K {split}" if split > 1 else ""
        x, w, *scales = _linear_inputs(fmt, n, k)
        op = linear_fp8_triton if fmt == "fp8" else linear_nvfp4_triton
        tail = (BF16,) if fmt == "fp8" else ()
        # enough weight copies that one graph of calls on all of them does not fit in L2
        # (60 MB), as in the engine, where the other layers' weights pass through L2 between
        nbytes = w.numel() * w.element_size()
        copies = 1 if bc.smoke() else max(2, -(-160_000_000 // nbytes))
        ws_all = [w] + [w.clone() for _ in range(copies - 1)]
        want = op(x, w, *scales, *tail, **kw)
        grid = [dict(block_n=bn, block_k=bk, num_stages=st, num_warps=nw, block_m=16)
                for bn, nw in tiles for bk in (128, 256) for st in (3, 4, 6)]
        if fmt == "nvfp4":  # 8-token tiles: half the MMAs and activation fragments at M = 1
            grid += [dict(block_n=bn, block_k=128, num_stages=st, num_warps=nw, block_m=8)
                     for bn, nw in tiles for st in (3, 4, 6)]

        def timed(conf, x=x, scales=scales, want=want, ws_all=ws_all, op=op, tail=tail, kw=kw):
            gc = GemmConfig(conf["block_m"], conf["block_n"], conf["block_k"], conf["num_warps"],
                            conf["num_stages"], swap=True)
            checked(lambda: op(x, ws_all[0], *scales, *tail, config=gc, **kw), want, exact=False)

            def calls():
                for wc in ws_all:
                    op(x, wc, *scales, *tail, config=gc, **kw)
            return bc.time_graph_us(calls, len(ws_all))
        out |= run_grid(f"linear_{fmt} M=1 {name} [{n}x{k}]", grid, timed, nbytes, "GB/s",
                        ceil["copy_GBps"])
    return out


def _linear_inputs(fmt, n, k):
    """(x, weight, *scales) of linear_<fmt> at M = 1 on the GPU: FP8 codes in and per-row
    weight scales (the engine's q/k/v and o_proj), or NVFP4 weights with BF16 x."""
    if fmt == "fp8":
        return (torch.randn(1, k, device=bc.dev()).to(FP8), torch.randn(n, k, device=bc.dev()).to(FP8),
                torch.rand(n, device=bc.dev()) / 64, torch.tensor(0.01, device=bc.dev()))
    x = torch.randn(1, k).to(BF16)
    return tuple(a.to(bc.dev()) for a in linear_args("nvfp4", x, n=n, seed=0))


def sweep_norm1(cfg, ceil):
    h, eps, out = cfg.hidden_size, cfg.rms_norm_eps, {}
    hh, y = torch.randn(1, h, device=bc.dev(), dtype=BF16), torch.randn(1, h, device=bc.dev(), dtype=BF16)
    w = 1 + 0.1 * torch.randn(h, device=bc.dev(), dtype=BF16)
    scale = torch.tensor(0.02, device=bc.dev())
    fns = {"add_rmsnorm T=1": lambda: torch.ops.beam.add_rmsnorm(hh, y, w, w, 0.9, 0.4, eps),
           "add_rmsnorm_fp8 T=1": lambda: torch.ops.beam.add_rmsnorm_fp8(hh, y, w, w, scale,
                                                                        0.9, 0.4, eps)}
    grid = [dict(ROWS=1, elems_per_thread=e, programs_per_sm=4, STAGES=1) for e in (4, 8, 16, 32)]
    for name, fn in fns.items():
        want = fn()[0]
        key = "few_fp8" if "fp8" in name else "few"

        def timed(conf, fn=fn, want=want, key=key):
            with patched(rmsnorm.ROW_CONFIG[key], **conf):
                checked(fn, want)
                return bc.time_graph_us(fn)
        out |= run_grid(name, grid, timed, 4 * h * 2, "GB/s", ceil["copy_GBps"])
    return out


@triton.jit
def _add_rmsnorm_chunked(h_ptr, y_ptr, wpost_ptr, wpre_ptr, hout_ptr, x_ptr, T, H, a, b, eps,
                         CHUNK: tl.constexpr, NCHUNK: tl.constexpr):
    cols = tl.arange(0, CHUNK)
    dtype = hout_ptr.dtype.element_ty
    for row in tl.range(tl.program_id(0), T, tl.num_programs(0)):
        base = row * H  # int32 is enough for the sweep's 16K x 5120
        ss = tl.zeros([CHUNK], tl.float32)
        for c in tl.static_range(NCHUNK):
            yv = tl.load(y_ptr + base + c * CHUNK + cols).to(tl.float32)
            ss += yv * yv
        inv_y = 1.0 / tl.sqrt_rn(tl.sum(ss, axis=0) / H + eps)
        ss = tl.zeros([CHUNK], tl.float32)
        for c in tl.static_range(NCHUNK):
            off = base + c * CHUNK + cols
            yv = tl.load(y_ptr + off).to(tl.float32)
            wpost = tl.load(wpost_ptr + c * CHUNK + cols).to(tl.float32)
            y_n = cast_rne(yv * inv_y * wpost, dtype).to(tl.float32)
            h_new = cast_rne(a * tl.load(h_ptr + off).to(tl.float32) + b * y_n, dtype)
            tl.store(hout_ptr + off, h_new)
            h_new = h_new.to(tl.float32)
            ss += h_new * h_new
        inv_h = 1.0 / tl.sqrt_rn(tl.sum(ss, axis=0) / H + eps)
        for c in tl.static_range(NCHUNK):  # recompute h' from h and y (L1/L2 hits): reading
            off = base + c * CHUNK + cols  # back the h' just stored raced on the H200
            yv = tl.load(y_ptr + off).to(tl.float32)
            wpost = tl.load(wpost_ptr + c * CHUNK + cols).to(tl.float32)
            y_n = cast_rne(yv * inv_y * wpost, dtype).to(tl.float32)
            h_new = cast_rne(a * tl.load(h_ptr + off).to(tl.float32) + b * y_n, dtype)
            h_new = h_new.to(tl.float32)
            wpre = tl.load(wpre_ptr + c * CHUNK + cols).to(tl.float32)
            tl.store(x_ptr + off, cast_rne(h_new * inv_h * wpre, dtype))


def sweep_norm16k(cfg, ceil):
    t, h, eps = bc.SIZES["tokens"], cfg.hidden_size, cfg.rms_norm_eps
    hh, y = torch.randn(t, h, device=bc.dev(), dtype=BF16), torch.randn(t, h, device=bc.dev(), dtype=BF16)
    w = 1 + 0.1 * torch.randn(h, device=bc.dev(), dtype=BF16)
    want = torch.ops.beam.add_rmsnorm(hh, y, w, w, 0.9, 0.4, eps)
    out = run_grid("add_rmsnorm 16K shipped", [{}], lambda conf: bc.time_us(
        lambda: torch.ops.beam.add_rmsnorm(hh, y, w, w, 0.9, 0.4, eps)), 4 * t * h * 2, "GB/s",
        ceil["copy_GBps"])
    grid = [dict(CHUNK=c, warps=nw, per_sm=p) for c in (512, 1024) if h % c == 0
            for nw in (2, 4, 8) for p in (4, 8, 16)]

    def timed(conf):
        ho, xo = torch.empty_like(hh), torch.empty_like(hh)
        grid_n = min(t, conf["per_sm"] * sm_count(torch.device(bc.dev())))

        def fn():
            _add_rmsnorm_chunked[(grid_n,)](hh, y, w, w, ho, xo, t, h, 0.9, 0.4, eps,
                                           CHUNK=conf["CHUNK"], NCHUNK=h // conf["CHUNK"],
                                           num_warps=conf["warps"])
        fn()  # the sums of squares run in another order: a 1-ULP move of inv_rms flips y_n by
        # one BF16 ULP (~8e-3 of |y_n| <~ 4), which b carries into h' (and h' into x)
        if not all(torch.allclose(g.float(), r.float(), rtol=1.6e-2, atol=3e-2)
                   for g, r in ((ho, want[0]), (xo, want[1]))):
            raise AssertionError(f"chunked add_rmsnorm {conf} differs from beam::add_rmsnorm")
        return bc.time_us(fn)
    return out | run_grid("add_rmsnorm 16K chunked", grid, timed, 4 * t * h * 2, "GB/s",
                          ceil["copy_GBps"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="beam-1.0-501b")
    ap.add_argument("--only", default="attn,linear,norm1,norm16k")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny preset, two configurations per grid, CPU + TRITON_INTERPRET=1")
    args = ap.parse_args()
    bc.configure(args.smoke)
    if args.smoke:
        kernels_sweep.GRID["limit"], args.preset = 2, "tiny"
    elif not torch.cuda.is_available():
        sys.exit("bench/decode_sweep.py needs a CUDA GPU (or --smoke)")
    cfg = preset(args.preset)
    ceil = bc.measure_ceilings()
    print(f"ceilings: {json.dumps({k: round(v, 1) for k, v in ceil.items()})}", flush=True)
    sweeps = {"attn": sweep_attn, "linear": sweep_linear, "norm1": sweep_norm1,
              "norm16k": sweep_norm16k,
              "linear_nvfp4": lambda cfg, ceil: sweep_linear(cfg, ceil, "nvfp4"),
              "linear_split": lambda cfg, ceil: sweep_linear(cfg, ceil, "fp8", split=2),
              "linear_split3": lambda cfg, ceil: sweep_linear(cfg, ceil, "fp8", split=3),
              "linear_split4": lambda cfg, ceil: sweep_linear(cfg, ceil, "fp8", split=4)}
    results = {}
    for name in args.only.split(","):
        results |= sweeps[name](cfg, ceil)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_sweep.json").write_text(json.dumps(dict(ceilings=ceil, **results),
                                                               indent=1))


if __name__ == "__main__":
    main()
