"""Token-level check of the engine on CUDA (Triton kernels, CUDA graphs) against the same engine
dir run eagerly and on the CPU (the ops' plain-torch references).

    PYTHONPATH=. python3 bench/engine_gpu_check.py --ckpt DIR [DIR2 ...]   # e.g. init-tiny's
    PYTHONPATH=. python3 bench/engine_gpu_check.py --smoke                 # CPU, seconds
    python bench/engine_gpu_check.py --make-fixed-route SRC DST   # see fixed_route_copy

Not a speed benchmark: its ceiling is agreement. The tiny Beam's random weights make near-ties
common, so exact greedy equality over long generations is not expected from two different
summation orders: the script prints, per engine dir, the share of prompts whose greedy
continuation is identical, the first position where they part, and the largest difference of
the chosen tokens' logprobs while they agree. CUDA graphs against CUDA eager must be 100%
identical. About 1 minute on an H200 for the tiny Beam; --smoke builds the tiny Beam and
compares the CPU engine with itself (the script's paths, not the GPU).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.types import SamplingParams


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 90, (n,), generator=g).tolist()
    return [torch.randint(0, 508, (t,), generator=g).tolist() for t in lengths]


def run(engine: Engine, batch: list[list[int]], max_tokens: int) -> list[dict]:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return engine.generate(batch, sampling)


def compare(a: list[dict], b: list[dict]) -> tuple[float, list[int], float]:
    same, first_diff, max_lp = 0, [], 0.0
    for x, y in zip(a, b):
        tx, ty = x["token_ids"], y["token_ids"]
        n = next((i for i, (p, q) in enumerate(zip(tx, ty)) if p != q), len(tx))
        same += n == len(tx)
        first_diff.append(n)
        for i in range(n):
            max_lp = max(max_lp, abs(x["logprobs"][i].logprob - y["logprobs"][i].logprob))
    return same / len(a), first_diff, max_lp


def check(ckpt: Path, work: Path, n_prompts: int, max_tokens: int, smoke: bool = False) -> str:
    dirs = {}
    device = "cpu" if smoke else "cuda"
    targets = ("cpu",) if smoke else ("sm90", "cpu")
    for target in targets:  # same checkpoint, same repacking; the target gates loading
        dirs[target] = work / f"engine-{ckpt.name}-{target}"
        shutil.rmtree(dirs[target], ignore_errors=True)
        build_engine(ckpt, dirs[target], BuildOptions(target=target, max_batch=16,
                                                      max_seq_len=256, max_num_tokens=128,
                                                      block_size=16))
    batch = prompts(n_prompts)
    t0 = time.perf_counter()
    first = dirs[targets[0]]
    gpu = run(Engine.from_dir(first, device=device), batch, max_tokens)
    t_gpu = time.perf_counter() - t0
    eager = run(Engine.from_dir(first, device=device, use_cuda_graphs=False), batch, max_tokens)
    cpu = run(Engine.from_dir(dirs["cpu"], device="cpu"), batch, max_tokens)
    rows = []
    for name, other in (("CUDA graphs vs CUDA eager", eager), ("CUDA vs CPU refs", cpu)):
        same, first, max_lp = compare(gpu, other)
        rows.append(f"| {ckpt.name} | {name} | {n_prompts} x {max_tokens} | {same:.0%} identical "
                    f"| {first} | {max_lp:.2e} | {t_gpu:.1f} s |")
    return "\n".join(rows)


def fixed_route_copy(src: Path, dst: Path, seed: int = 7) -> None:
    """Copy a BF16 Beam checkpoint with every e_score_correction_bias replaced by a permutation
    of 0..E-1: biased scores then differ by >= 1 > any sigmoid difference, so the experts a
    token gets no longer depend on its activations and rounding cannot flip them."""
    from safetensors.torch import load_file, save_file

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    by_file: dict[str, list[str]] = {}
    for name, fname in index.items():
        if name.endswith("e_score_correction_bias"):
            by_file.setdefault(fname, []).append(name)
    for fname, names in by_file.items():
        tensors = load_file(str(dst / fname))
        for name in names:
            gen = torch.Generator().manual_seed(seed)
            tensors[name] = torch.randperm(tensors[name].numel(), generator=gen).float()
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, nargs="+")
    ap.add_argument("--make-fixed-route", type=Path, nargs=2, metavar=("SRC", "DST"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/engine_gpu_check"))
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--smoke", action="store_true", help="the tiny Beam on the CPU only")
    args = ap.parse_args()
    if args.make_fixed_route:
        fixed_route_copy(*args.make_fixed_route)
        return
    if args.smoke:
        from beam_trtllm.tiny import init_tiny

        args.work = Path(tempfile.mkdtemp(prefix="engine-gpu-check-"))
        args.ckpt = [init_tiny(args.work / "tiny", seed=0)]
        args.prompts, args.max_tokens = 2, 3
    if not args.ckpt:
        ap.error("--ckpt is required")
    args.work.mkdir(parents=True, exist_ok=True)
    print("| checkpoint | compared | prompts x tokens | greedy continuations | first divergence "
          "per prompt | max abs dlogprob while equal | CUDA wall |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    try:
        for ckpt in args.ckpt:
            print(check(ckpt, args.work, args.prompts, args.max_tokens, args.smoke), flush=True)
    finally:
        if args.smoke:
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
