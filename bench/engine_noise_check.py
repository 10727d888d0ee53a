"""How sensitive is a (random) Beam checkpoint to rounding? Runs the engine on the CPU twice
over the same prompts: once plain, once with every `beam::` op output multiplied by
(1 + s * 2^-8), s in {-1, 0, 1} at random (about one BF16 rounding step), and prints the same
statistics as `engine_gpu_check.py` (identical greedy continuations, first divergence, largest
logprob difference while the tokens agree). If these match the CUDA-vs-CPU statistics, a GPU
difference of that size is what rounding alone produces on this checkpoint.

    .venv/bin/python bench/engine_noise_check.py --ckpt DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import plugins  # noqa: E402,F401  (registers the ops)
import plugins.registry as registry  # noqa: E402
from beam_trtllm.engine.build import build_engine  # noqa: E402
from beam_trtllm.engine.engine import Engine  # noqa: E402
from beam_trtllm.engine.plan import BuildOptions  # noqa: E402
from bench.engine_gpu_check import compare, prompts, run  # noqa: E402

# Ops whose outputs are data movement or integer choices: left exact.
EXACT_OPS = ("group_router", "cache_write")


class Perturber:
    def __init__(self, seed: int, rel: float):
        self.gen = torch.Generator().manual_seed(seed)
        self.rel, self.on = rel, False
        self.inner = registry.dispatch

    def perturb(self, x):
        if isinstance(x, tuple):
            return tuple(self.perturb(t) for t in x)
        if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float32) and x.numel():
            sign = torch.randint(-1, 2, x.shape, generator=self.gen).float()
            return (x.float() * (1 + sign * self.rel)).to(x.dtype)
        return x

    def dispatch(self, op, device, *args, **kwargs):
        out = self.inner(op, device, *args, **kwargs)
        return self.perturb(out) if self.on and op not in EXACT_OPS else out

    def install(self) -> None:
        # every op module imported `dispatch` by name: rebind it there too
        for name, mod in list(sys.modules.items()):
            if name.startswith("plugins.") and getattr(mod, "dispatch", None) is self.inner:
                mod.dispatch = self.dispatch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, nargs="+", required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/engine_noise_check"))
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rel", type=float, default=2.0 ** -8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    noise = Perturber(seed=123, rel=args.rel)
    noise.install()
    print("| checkpoint | compared | prompts x tokens | greedy continuations | first divergence "
          "per prompt | max abs dlogprob while equal |")
    print("| --- | --- | --- | --- | --- | --- |")
    for ckpt in args.ckpt:
        out = args.work / ckpt.name
        shutil.rmtree(out, ignore_errors=True)
        build_engine(ckpt, out, BuildOptions(target="cpu", max_batch=16, max_seq_len=256,
                                             max_num_tokens=128, block_size=16))
        batch = prompts(args.prompts)
        noise.on = False
        clean = run(Engine.from_dir(out, device="cpu"), batch, args.max_tokens)
        noise.on = True
        noisy = run(Engine.from_dir(out, device="cpu"), batch, args.max_tokens)
        same, first, max_lp = compare(noisy, clean)
        print(f"| {ckpt.name} | noise {args.rel:.1e} vs clean (CPU) | {args.prompts} x "
              f"{args.max_tokens} | {same:.0%} identical | {first} | {max_lp:.2e} |", flush=True)


if __name__ == "__main__":
    main()
