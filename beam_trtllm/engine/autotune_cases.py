"""What the kernel search (autotune.py) times for each op family: random inputs of the engine's
layout and dtypes at realistic magnitudes, the launcher call with a candidate configuration, and
the candidate lists (the launcher's default first, then a handful of alternatives).

Inputs follow the ops' contracts (docs/DESIGN.md §2): FP8 weights are e4m3 codes of N(0, 32²)
with per-row scales 1/(32·√K) and static activation scales; NVFP4 weights are random packed
E2M1 nibbles with e4m3 block scales in [0.25, 2] and a global scale 1/(2.93·√K); MoE routing
picks k distinct experts per token uniformly (what a balanced router does); decode attention
reads a paged cache through a shuffled block table (full layers; each of the B sequences
holds min(capacity - 1, 2^20 / B) keys) or full ring rows (sliding layers).
A candidate is a config the launcher takes as an override (`config=`, `config13=/config2=`);
None is the launcher's own choice.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_SPREAD = 32.0
E2M1_RMS = 2.93  # RMS of uniformly random E2M1 codes
KEY_BUDGET = 1 << 20  # cached keys per decode-attention problem (4 GiB of BF16 K+V at Beam's)
QUICK_ALTERNATIVES = 3


@dataclass
class Case:
    """One op family: `make(params, max_size, device, gen)` -> data shared by the sizes of a
    shape group; `runner(data, params, size)` -> run(config) -> output; `stages(params, mode)`
    -> candidate generators, each mapping the best config so far to the candidates to try."""

    family: str
    rule: str  # agreement rule (autotune.AGREEMENT)
    make: Callable
    runner: Callable
    stages: Callable
    shared: bool = True  # one data set for all sizes of a shape (else one per size)


def _fp8_codes(shape, device, gen) -> torch.Tensor:
    """e4m3 codes of N(0, 32²), made one leading slice at a time (no FP32 copy of it all)."""
    out = torch.empty(shape, dtype=FP8, device=device)
    flat = out.view(-1, *shape[-2:])
    for i in range(flat.shape[0]):
        flat[i] = (torch.randn(shape[-2:], device=device, generator=gen) * FP8_SPREAD).to(FP8)
    return out


def _nvfp4(shape, device, gen):
    """(packed uint8 [..., N, K/2], e4m3 block scales [..., N, K/16])."""
    *lead, n, k = shape
    words = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=device,
                          generator=gen)
    scales = torch.empty(*lead, n, k // 16, device=device).uniform_(0.25, 2.0, generator=gen)
    return words, scales.to(FP8)


def _scalar(value, device) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def _variants(default, changes: list[dict], mode: str) -> list:
    """default, then default with each change (duplicates and no-ops dropped)."""
    out, seen = [None], {default}
    for change in changes:
        cand = dataclasses.replace(default, **change)
        if cand not in seen:
            seen.add(cand)
            out.append(cand)
    return out[:1 + QUICK_ALTERNATIVES] if mode == "quick" else out


# ---------------------------------------------------------------------------- linear_*
def _linear_make(fp8: bool):
    def make(p, max_size, device, gen):
        n, k = p["n"], p["k"]
        x = torch.randn(max_size, k, device=device, generator=gen).to(torch.bfloat16)
        if fp8:
            return {"x": x, "w": _fp8_codes((n, k), device, gen),
                    "ws": torch.full((n,), 1 / (FP8_SPREAD * math.sqrt(k)), device=device),
                    "xs": _scalar(4.5 / 448, device)}
        w, s = _nvfp4((n, k), device, gen)
        return {"x": x, "w": w, "ws": s, "ws2": _scalar(1 / (E2M1_RMS * math.sqrt(k)), device)}
    return make


def _linear_runner(fp8: bool):
    def runner(d, p, m):
        from plugins.linear_fp8 import linear_fp8_triton
        from plugins.linear_nvfp4 import linear_nvfp4_triton

        x = d["x"][:m]
        if fp8:
            return lambda c: linear_fp8_triton(x, d["w"], d["ws"], d["xs"], use_scaled_mm=False,
                                               config=c)
        return lambda c: linear_nvfp4_triton(x, d["w"], d["ws"], d["ws2"], config=c)
    return runner


def linear_default(m: int, fp8: bool):
    from plugins._tiles import linear_config

    return linear_config(m, 1 if fp8 else 0.5)


def _linear_stages(fp8: bool):
    def stages(p, mode):
        m, d = p["size"], linear_default(p["size"], fp8)
        half_k = dict(block_k=max(32, d.block_k // 2))
        if d.swap:  # weights on the MMA's M side; the token tile is 16 rows
            changes = [dict(block_n=32), dict(block_n=128), dict(num_stages=d.num_stages - 1),
                       dict(num_stages=d.num_stages + 1), half_k,
                       dict(block_k=min(512, 2 * d.block_k)),
                       dict(num_warps=8 if d.num_warps == 4 else 4)]
            if m > 16:
                changes.insert(0, dict(block_m=min(64, 1 << (m - 1).bit_length())))
        else:
            changes = [dict(block_n=256), dict(block_m=64, num_warps=4, num_stages=4),
                       dict(num_stages=d.num_stages + 1), dict(group_m=16),
                       dict(block_n=64, num_warps=4), half_k]
        return [lambda best: _variants(d, changes, mode)]
    return stages


# ---------------------------------------------------------------------------- moe_*
def _moe_make(fp8: bool):
    def make(p, max_size, device, gen):
        e, i, h, top_k = p["experts"], p["inner"], p["hidden"], p["top_k"]
        t = max(1, max_size // top_k)
        data = {"x": torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16),
                "ids": torch.rand(t, e, device=device, generator=gen).topk(top_k).indices.int(),
                "weights": torch.randn(t, top_k, device=device, generator=gen).softmax(-1)}
        if fp8:
            data["w"] = (_fp8_codes((e, 2 * i, h), device, gen),
                         torch.full((e, 2 * i), 1 / (FP8_SPREAD * math.sqrt(h)), device=device),
                         _fp8_codes((e, h, i), device, gen),
                         torch.full((e, h), 1 / (FP8_SPREAD * math.sqrt(i)), device=device),
                         _scalar(4.5 / 448, device), _scalar(8.0 / 448, device))
        else:
            w13, s13 = _nvfp4((e, 2 * i, h), device, gen)
            w2, s2 = _nvfp4((e, h, i), device, gen)
            data["w"] = (w13, s13, torch.full((e,), 1 / (E2M1_RMS * math.sqrt(h)), device=device),
                         w2, s2, torch.full((e,), 1 / (E2M1_RMS * math.sqrt(i)), device=device))
        return data
    return make


def _moe_runner(fp8: bool):
    def runner(d, p, pairs):
        from plugins.moe_fp8 import moe_fp8_triton
        from plugins.moe_nvfp4 import moe_nvfp4_triton

        t = max(1, pairs // p["top_k"])
        launcher = moe_fp8_triton if fp8 else moe_nvfp4_triton
        args = (d["x"][:t], d["ids"][:t], d["weights"][:t], *d["w"])

        def run(c):
            pair = c or {"w13": None, "w2": None}
            return launcher(*args, config13=pair["w13"], config2=pair["w2"])
        return run
    return runner


def moe_defaults(pairs: int, experts: int, fp8: bool = True, hidden: int = 0, inner: int = 0):
    """The (gate/up, down) shapes `_moe_common.configs_for` gives, or for NVFP4 those of
    moe_nvfp4's launcher for these GEMM depths on this machine's GPU (moe_fp8's launcher swaps
    in its own prefill gate/up shape; the search times the launcher's real choice as the
    default and derives alternatives from these)."""
    from plugins._moe_common import DIRECT_MAX_PAIRS, configs_for, has_tma
    from plugins.moe_nvfp4 import launch_configs

    numel = 1 if pairs <= DIRECT_MAX_PAIRS else pairs
    if fp8:
        return configs_for(numel, experts, None, None)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return launch_configs(numel, experts, k13=hidden, k2=inner, tma=has_tma(device))


def _moe_changes(d, fp8: bool) -> list[dict]:
    if d.swap and d.block_m < 64:  # decode: one (token, expert) pair or a few per small block
        return [dict(block_n=32), dict(block_n=128), dict(num_stages=d.num_stages - 1),
                dict(num_stages=d.num_stages + 1), dict(block_k=2 * d.block_k if fp8 else d.block_k // 2),
                dict(num_warps=2)]
    other_m = 128 if d.block_m == 64 else 64
    return [dict(block_n=128), dict(block_m=other_m, num_warps=8 if other_m == 128 else 4),
            dict(num_stages=d.num_stages + 1), dict(num_warps=8 if d.num_warps == 4 else 4),
            dict(group_m=16), dict(block_n=256 if d.block_n == 128 else 32)]


def _moe_stages(fp8: bool):
    def stages(p, mode):
        d13, d2 = moe_defaults(p["size"], p["experts"], fp8, p["hidden"], p["inner"])

        def gate_up(best):  # a block_m change re-sorts the tokens: w2 follows it
            out = [None]
            for c in _variants(d13, _moe_changes(d13, fp8), mode)[1:]:
                w2 = None if c.block_m == d2.block_m else dataclasses.replace(d2, block_m=c.block_m)
                out.append({"w13": c, "w2": w2})
            return out

        def down(best):
            w13 = best["w13"] if best else None
            base = d2 if w13 is None or w13.block_m == d2.block_m else \
                dataclasses.replace(d2, block_m=w13.block_m)
            out = [best]
            for c in _variants(base, _moe_changes(base, fp8), mode)[1:]:
                if c.block_m == base.block_m:  # both GEMMs share one token sort
                    out.append({"w13": w13, "w2": c})
            return out
        return [gate_up, down]
    return stages


# ---------------------------------------------------------------------------- decode attention
def _decode_make(p, max_size, device, gen):
    hq, hkv, d, bs, cap = p["hq"], p["hkv"], p["d"], p["block_size"], p["capacity"]
    b = max_size
    kv = FP8 if p["kv_dtype"] == "float8_e4m3fn" else torch.bfloat16
    spread = 16.0 if kv == FP8 else 1.0  # FP8 caches hold value / scale
    if p["window"]:  # ring rows (one per sequence), positions past the window: the ring is full
        rows, width = b + 1, 1
        index = torch.arange(b, dtype=torch.int32, device=device).view(b, 1)
        q_start = 3 * cap + torch.arange(b, dtype=torch.int32, device=device) % cap
    else:  # paged: each sequence's blocks scattered through the cache
        ctx = max(1, min(cap - 1, KEY_BUDGET // b))
        per_seq, width = -(-(ctx + 1) // bs), cap // bs
        rows = b * per_seq + 1
        perm = torch.randperm(rows - 1, device=device, generator=gen).int() + 1
        index = torch.zeros(b, width, dtype=torch.int32, device=device)
        index[:, :per_seq] = perm.view(b, per_seq)
        q_start = torch.full((b,), ctx, dtype=torch.int32, device=device)
    caches = [(torch.randn(rows, bs, hkv, d, device=device, generator=gen) * spread).to(kv)
              for _ in range(2)]
    bf16 = dict(device=device, dtype=torch.bfloat16)
    return {"q": torch.randn(b, hq, d, device=device, generator=gen).to(**bf16),
            "k_new": torch.randn(b, hkv, d, device=device, generator=gen).to(**bf16),
            "v_new": torch.randn(b, hkv, d, device=device, generator=gen).to(**bf16),
            "gate": torch.rand(b, hq, d, device=device, generator=gen).to(**bf16),
            "k_cache": caches[0], "v_cache": caches[1], "q_start": q_start,
            "hist_start": torch.zeros(b, dtype=torch.int32, device=device), "cache_index": index,
            "scale": _scalar(1 / spread, device)}


def _decode_runner(data, p, b):
    from plugins._attention_decode import launch_decode

    v = {k: t[:b] for k, t in data.items() if k not in ("k_cache", "v_cache", "scale")}
    return lambda c: launch_decode(v["q"], v["k_new"], v["v_new"], v["gate"], data["k_cache"],
                                   data["v_cache"], v["q_start"], v["hist_start"],
                                   v["cache_index"], p["window"], data["scale"], data["scale"],
                                   config=c)


def decode_setting(name: str, capacity: int) -> str:
    """The DECODE_CONFIG entry the launcher reads for `name` at this capacity (short caches
    have their own BLOCK_N_SHORT, num_stages_short, ... where the table defines them)."""
    from plugins._attention_decode import DECODE_CONFIG as D

    if capacity <= D["short_capacity"]:
        for short in (f"{name}_SHORT", f"{name}_short"):
            if short in D:
                return short
    return name


def decode_changes(capacity: int, fp8_cache: bool) -> list[dict]:
    """Single-setting changes of DECODE_CONFIG that apply at this capacity."""
    from plugins._attention_decode import DECODE_CONFIG as D

    def key(name):
        return decode_setting(name, capacity)

    per_sm = key("programs_per_sm_fp8" if fp8_cache else "programs_per_sm")
    stages, split, block_n = key("num_stages"), key("min_split"), key("BLOCK_N")
    changes = [{block_n: 64 if D[block_n] == 128 else 128}, {stages: D[stages] - 1},
               {stages: D[stages] + 1}, {per_sm: D[per_sm] + 1}, {per_sm: D[per_sm] - 1},
               {split: 2 * D[split]}, {split: D[split] // 2},
               {key("num_warps"): 8 if D[key("num_warps")] == 4 else 4}]
    return [c for c in changes if all(v >= 1 for v in c.values())]


def _decode_stages(p, mode):
    changes = decode_changes(p["capacity"], p["kv_dtype"] == "float8_e4m3fn")
    cands = [None] + changes
    return [lambda best: cands[:1 + QUICK_ALTERNATIVES] if mode == "quick" else cands]


CASES = {
    "linear_fp8": Case("linear_fp8", "gemm-fp8", _linear_make(True), _linear_runner(True),
                       _linear_stages(True)),
    "linear_nvfp4": Case("linear_nvfp4", "gemm", _linear_make(False), _linear_runner(False),
                         _linear_stages(False)),
    "moe_fp8": Case("moe_fp8", "moe-fp8", _moe_make(True), _moe_runner(True), _moe_stages(True)),
    "moe_nvfp4": Case("moe_nvfp4", "gemm", _moe_make(False), _moe_runner(False),
                      _moe_stages(False)),
    "attention_decode": Case("attention_decode", "attention", _decode_make, _decode_runner,
                             _decode_stages, shared=False),
}


ACT_DTYPE = torch.bfloat16  # the engine's activations (model.ACT_DTYPE)


@dataclass(frozen=True)
class Problem:
    family: str
    key: tuple  # the plugins.tuning table key
    label: str
    params: dict = field(hash=False)  # shape parameters of the case; "size" is what is timed
    uses: int = 1  # layers that run it (the search goes most used first)

    @property
    def group(self) -> tuple:
        """Problems of one group share their random inputs (made for the largest size)."""
        shared = CASES[self.family].shared
        return (self.family,) + tuple(sorted((k, v) for k, v in self.params.items()
                                             if k != "size" or not shared))
