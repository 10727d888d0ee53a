"""Test data for the moe_* and linear_* ops: seeded weights at realistic scales, quantized with
the checkpoint encoders of beam_trtllm/quant_formats.py and repacked into the expert layout of
docs/DESIGN.md §2, plus router-like routings."""

from __future__ import annotations

import torch

from beam_trtllm import quant_formats as qf

FORMATS = ("bf16", "fp8", "fp8_block", "nvfp4")
# Beam's routed_scaling_factor: the moe_* ops' `scale`, on the summed output (the routing
# weights themselves sum to 1)
ROUTED_SCALE = 2.5


def dense_experts(e: int, h: int, inner: int, seed: int, dtype=torch.bfloat16):
    """gate, up [E, I, H] and down [E, H, I] ~ N(0, 1/fan_in), as the tiny checkpoint's."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(e, inner, h, generator=g) * h**-0.5
    up = torch.randn(e, inner, h, generator=g) * h**-0.5
    down = torch.randn(e, h, inner, generator=g) * inner**-0.5
    return gate.to(dtype), up.to(dtype), down.to(dtype)


def _rows_of_blocks(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A [ceil(N/128), ceil(K/128)] block-scale grid repeated over each block's rows: [N, Kb]."""
    return scale.repeat_interleave(qf.FP8_BLOCK, 0)[:rows]


def pack_experts(fmt: str, gate, up, down) -> dict:
    """Quantize each expert's matrices as the converter does and repack: the op's weight args."""
    if fmt == "bf16":
        return {"w13": torch.cat([gate, up], 1).contiguous(), "w2": down.contiguous()}
    parts = {"w13": [], "w13_scale": [], "w2": [], "w2_scale": [], "w13_scale_2": [], "w2_scale_2": []}
    for e in range(gate.shape[0]):
        if fmt == "fp8":
            (qg, sg), (qu, su), (qd, sd) = (qf.quantize_fp8(w[e]) for w in (gate, up, down))
            inner, h = gate.shape[1], gate.shape[2]
            s13 = torch.cat([sg.expand(inner), su.expand(inner)])
            s2 = sd.expand(h)
        elif fmt == "fp8_block":
            (qg, sg), (qu, su), (qd, sd) = (qf.quantize_fp8_block(w[e]) for w in (gate, up, down))
            s13 = torch.cat([_rows_of_blocks(sg, qg.shape[0]), _rows_of_blocks(su, qu.shape[0])])
            s2 = _rows_of_blocks(sd, qd.shape[0])
        elif fmt == "nvfp4":
            shared = torch.maximum(qf.nvfp4_scale_2(gate[e]), qf.nvfp4_scale_2(up[e]))
            qg, sg, _ = qf.quantize_nvfp4(gate[e], shared)
            qu, su, _ = qf.quantize_nvfp4(up[e], shared)
            qd, sd, sd2 = qf.quantize_nvfp4(down[e])
            s13, s2 = torch.cat([sg, su]), sd
            parts["w13_scale_2"].append(shared)
            parts["w2_scale_2"].append(sd2)
        else:
            raise ValueError(fmt)
        parts["w13"].append(torch.cat([qg, qu]))
        parts["w13_scale"].append(s13)
        parts["w2"].append(qd)
        parts["w2_scale"].append(s2)
    device = gate.device  # quant_formats returns FP8 per-tensor scales on the CPU
    return {k: torch.stack([t.to(device) for t in v]).contiguous() for k, v in parts.items() if v}


def activation_scales(x: torch.Tensor, h_amax: float) -> dict:
    """Static per-tensor FP8 input scales as calibration gives them (amax / 448)."""
    return {"a13_scale": (x.abs().amax().float() / qf.FP8_MAX).reshape(()),
            "a2_scale": torch.tensor(h_amax / qf.FP8_MAX, dtype=torch.float32)}


def random_routing(t: int, e: int, k: int, seed: int, experts: int | None = None):
    """Distinct ids per token (as the router gives), drawn from the first `experts` experts only
    (the rest get no tokens); positive weights renormalised as the router's, w / (sum + 1e-20)
    (the routed scale is the ops' `scale`, ROUTED_SCALE)."""
    g = torch.Generator().manual_seed(seed)
    pool = e if experts is None else experts
    ids = torch.rand(t, pool, generator=g).topk(k, dim=-1).indices.to(torch.int32)
    w = torch.rand(t, k, generator=g) + 0.05
    return ids, (w / (w.sum(-1, keepdim=True) + 1e-20)).float()


def moe_args(fmt: str, x, ids, weights, packed: dict, scales: dict | None = None) -> tuple:
    """Positional arguments of beam::moe_<fmt> in their schema order."""
    order = {
        "bf16": ("w13", "w2"),
        "fp8": ("w13", "w13_scale", "w2", "w2_scale", "a13_scale", "a2_scale"),
        "fp8_block": ("w13", "w13_scale", "w2", "w2_scale"),
        "nvfp4": ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2"),
    }[fmt]
    table = {**packed, **(scales or {})}
    return (x, ids, weights, *(table[name] for name in order))


def decoded_experts(fmt: str, gate, up, down, dtype):
    """Each matrix quantized in its checkpoint form and decoded with quant_formats' decoders
    (independent of the repacking): what transformers' BeamMoE runs on in the tests."""
    def one(w, shared=None):
        if fmt == "bf16":
            return w.to(dtype)
        if fmt == "fp8":
            return qf.dequantize_fp8(*qf.quantize_fp8(w), dtype)
        if fmt == "fp8_block":
            return qf.dequantize_fp8(*qf.quantize_fp8_block(w), dtype)
        return qf.dequantize_nvfp4(*qf.quantize_nvfp4(w, shared), dtype)

    out = []
    for e in range(gate.shape[0]):
        shared = torch.maximum(qf.nvfp4_scale_2(gate[e]), qf.nvfp4_scale_2(up[e]))
        out.append((one(gate[e], shared), one(up[e], shared), one(down[e])))
    return out


def sync_counters_all_zero() -> bool:
    """Whether every counter set the ops made (the MoE's combine tickets and pair counters, the
    attention's and the router's tickets) is back at zero: their programs must put back what
    they use."""
    from plugins import _common

    return all(int(c.count_nonzero()) == 0 for sets in _common._COUNTERS.values() for c in sets)


def ids_with_counts(counts, k):
    """[T, k] expert ids, k distinct per token, expert e taking counts[e] pairs (each <= T)."""
    labels = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    t = len(labels) // k
    return labels.view(k, t).t().contiguous().to(torch.int32)  # row t: labels t, t+T, ...
