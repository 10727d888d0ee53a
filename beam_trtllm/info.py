"""`beam-trt info`: sizes, layer map, KV and weight memory derived from a BeamConfig."""

from __future__ import annotations

from .config import BeamConfig

GIB = 1 << 30

# Bytes per parameter of each weight class under the three checkpoint precisions that
# `beam-trt convert` writes (recipes fp8 and nvfp4): NVFP4 = 4-bit values + one FP8 scale
# per 16 (recipe nvfp4 keeps the attention projections, gate_proj included, in FP8); the
# router stays FP32 and embeddings, lm_head, norms and gate_bias stay BF16.
_BYTES = {
    "bf16": {"experts": 2, "dense_mlp": 2, "attn_proj": 2},
    "fp8": {"experts": 1, "dense_mlp": 1, "attn_proj": 1},
    "nvfp4": {"experts": 0.5625, "dense_mlp": 0.5625, "attn_proj": 1},
}


def param_classes(cfg: BeamConfig) -> dict[str, int]:
    """Parameter count per weight class (they add up to cfg.total_params)."""
    h, n_layers = cfg.hidden_size, cfg.num_hidden_layers
    n_moe = len(cfg.moe_layers)
    projections = 3 * h * cfg.q_size + 2 * h * cfg.kv_size  # q, gate, o; k, v
    counts = {
        "embed_lm_head": 2 * cfg.vocab_size * h,
        "attn_proj": n_layers * projections,
        "norms_gate_bias": n_layers * (4 * h + 2 * cfg.head_dim + cfg.num_attention_heads) + h,
        "dense_mlp": len(cfg.dense_layers) * cfg.dense_mlp_params,
        "experts": n_moe * cfg.num_experts * cfg.expert_params,
        "router": n_moe * cfg.router_params,
    }
    assert sum(counts.values()) == cfg.total_params
    return counts


def weight_bytes(cfg: BeamConfig, precision: str) -> int:
    per = _BYTES[precision]
    total = 0.0
    for cls, n in param_classes(cfg).items():
        total += n * (4 if cls == "router" else per.get(cls, 2))
    return int(total)


# bytes per element of the MoE ops' intermediate h (FP8 codes, or BF16) by weight precision
_MOE_H_BYTES = {"bf16": 2, "fp8": 1, "nvfp4": 2}
MOE_BLOCK_M = 64  # the experts' token-sort padding per expert (plugins/_moe_common.py)


def activation_bytes(cfg: BeamConfig, num_tokens: int, precision: str) -> dict:
    """The live activation bytes of one forward over a `num_tokens` chunk (the engine's
    --max-num-tokens), by sublayer, from what engine/model.py and the beam:: launchers
    allocate: the residual stream, its norm and FP8 codes of the layer's input and of its
    output (2 x), plus the largest sublayer's own tensors. `peak` is the largest."""
    t, h, a = num_tokens, cfg.hidden_size, 2  # BF16 activations
    q8 = 1 if precision in ("fp8", "nvfp4") else 0  # FP8 codes beside x (attention input)
    stream = 2 * t * h * (2 * a + q8)
    attn = 2 * t * cfg.qkv_gate_size * a + t * cfg.q_size * (1 if q8 else a) + t * h * a
    out = {"stream": stream, "attention": attn}
    if cfg.dense_layers:
        from .engine.model import SWIGLU_ROWS

        i = cfg.intermediate_size
        gate_up, hidden = t * 2 * i * a, t * i * a
        out["dense_mlp"] = gate_up + hidden + max(min(t, SWIGLU_ROWS) * i * 4,
                                                  t * i * q8 + t * h * a)
    if cfg.moe_layers:
        k, i = cfg.num_experts_per_tok, cfg.moe_intermediate_size
        rows = t * k + cfg.num_experts * (MOE_BLOCK_M - 1)
        out["moe"] = (rows * i * _MOE_H_BYTES[precision] + t * k * h * a + t * h * a
                      + t * cfg.num_experts * 4)
    out["peak"] = stream + max(v for n, v in out.items() if n != "stream")
    return out


def layer_map(cfg: BeamConfig) -> list[dict]:
    return [
        {"layer": i, "attention": "full" if cfg.is_full(i) else "sliding",
         "ffn": "moe" if cfg.is_moe(i) else "dense"}
        for i in range(cfg.num_hidden_layers)
    ]


def report(cfg: BeamConfig, context: int, kv_dtype: str, num_tokens: int = 8192,
           precision: str | None = None) -> dict:
    """`precision` (the engine's or checkpoint's, when known) picks the plan's weights."""
    weights = {p: weight_bytes(cfg, p) for p in _BYTES}
    acts = {p: activation_bytes(cfg, num_tokens, p) for p in _BYTES}
    plan = None
    if precision is not None:
        plan = {"precision": precision, "weights": weights[precision],
                "kv": cfg.kv_bytes(context, kv_dtype), "activations": acts[precision]["peak"]}
        plan["total"] = plan["weights"] + plan["kv"] + plan["activations"]
    return {
        "total_params": cfg.total_params,
        "active_params": cfg.active_params,
        "layers": cfg.num_hidden_layers,
        "dense_layers": list(cfg.dense_layers),
        "moe_layers": list(cfg.moe_layers),
        "full_layers": list(cfg.full_layers),
        "sliding_layers": list(cfg.sliding_layers),
        "layer_map": layer_map(cfg),
        "kv_bytes_per_token": {d: cfg.kv_bytes_per_token(d) for d in ("bf16", "fp8")},
        "sliding_kv_bytes_per_sequence": cfg.sliding_kv_bytes_per_sequence(kv_dtype),
        "context": context,
        "kv_dtype": kv_dtype,
        "kv_bytes_full_layers": context * cfg.kv_bytes_per_token(kv_dtype),
        "kv_bytes_sequence": cfg.kv_bytes(context, kv_dtype),
        "weight_bytes": weights,
        "num_tokens": num_tokens,
        "activation_bytes": {p: v["peak"] for p, v in acts.items()},
        "activation_parts": acts,
        "plan": plan,
    }


def _size(n: float) -> str:
    for unit, div in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8" (any pattern: Beam's mlp_layer_types need not be a
    prefix of dense layers)."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) if runs else "-"


def format_report(r: dict) -> str:
    lines = [
        f"parameters      total {_count(r['total_params'])}   active {_count(r['active_params'])}"
        f"   ({r['total_params']:,} / {r['active_params']:,})",
        f"layers          {r['layers']}: dense {_ranges(r['dense_layers'])}; "
        f"moe {_ranges(r['moe_layers'])}",
        f"full attention  {_ranges(r['full_layers'])}",
        f"sliding window  {len(r['sliding_layers'])} layers",
        "layer map       " + " ".join(
            ("F" if m["attention"] == "full" else "s") + ("M" if m["ffn"] == "moe" else "D")
            for m in r["layer_map"]
        ) + "   (F/s = full/sliding attention, M/D = MoE/dense)",
        f"KV per token    {_size(r['kv_bytes_per_token']['bf16'])} BF16, "
        f"{_size(r['kv_bytes_per_token']['fp8'])} FP8 (full layers only)",
        f"KV at {r['context']:,} tokens ({r['kv_dtype']}): {_size(r['kv_bytes_full_layers'])} full layers"
        f" + {_size(r['kv_bytes_sequence'] - r['kv_bytes_full_layers'])} sliding windows"
        f" = {_size(r['kv_bytes_sequence'])} per sequence",
        "weights         " + ", ".join(f"{p.upper()} {_size(b)}" for p, b in r["weight_bytes"].items()),
        f"activations     a {r['num_tokens']:,}-token chunk: " + ", ".join(
            f"{p.upper()} {_size(b)}" for p, b in r["activation_bytes"].items()),
    ]
    if r.get("plan"):
        p = r["plan"]
        lines.append(f"plan ({p['precision']})     weights {_size(p['weights'])} + KV "
                     f"{_size(p['kv'])} + activations {_size(p['activations'])} = "
                     f"{_size(p['total'])} per GPU")
    return "\n".join(line for line in lines if line)


def engine_plan_inputs(path) -> tuple[str | None, int | None]:
    """(weight precision, --max-num-tokens) of an engine dir; (None, None) for anything else."""
    import json
    from pathlib import Path

    spec = Path(path) / "engine.json"
    if not spec.is_file():
        return None, None
    try:
        d = json.loads(spec.read_text())
        scheme, chunk = d["quantization"]["scheme"], int(d["options"]["max_num_tokens"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{spec}: cannot read quantization.scheme / options.max_num_tokens "
                         f"({exc})") from None
    return scheme_precision(scheme), chunk


def scheme_precision(scheme: str) -> str:
    """The weight precision (a key of weight_bytes) of an engine's quantization scheme."""
    scheme = scheme.upper()
    return "nvfp4" if "NVFP4" in scheme else "fp8" if "FP8" in scheme else "bf16"


# ---------------------------------------------------------------------------- a checkpoint
def checkpoint_quantization(ckpt_dir) -> dict:
    """What a checkpoint stores (from its headers and declared scheme): the scheme, and per
    Linear format the number of Linears and their bytes (weights and scales)."""
    from .checkpoint import SafetensorsCheckpoint
    from .engine.weights import linear_format
    from .quant_schemes import read_scheme

    scheme = read_scheme(ckpt_dir)
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    sizes = {n: _numel(shape) * _itemsize(dtype) for n, (shape, dtype) in ckpt.infos.items()}
    formats: dict[str, dict] = {}
    for name in ckpt.infos:
        if not name.endswith(("_proj.weight", "lm_head.weight")):
            continue
        module = name[: -len(".weight")]
        fmt = linear_format(ckpt.dtype, module, scheme)
        if fmt == "fp8" and len(ckpt.infos.get(module + ".weight_scale", ((),))[0]) in (2, 4):
            fmt = "fp8_block"
        entry = formats.setdefault(fmt, {"linears": 0, "bytes": 0})
        entry["linears"] += 1
        entry["bytes"] += sum(b for n, b in sizes.items() if n.startswith(module + "."))
    ckpt.close()
    return {"scheme": scheme.describe(), "linear_formats": formats,
            "total_bytes": sum(sizes.values())}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def format_checkpoint(c: dict) -> str:
    lines = [f"checkpoint      {c['scheme']}; {_size(c['total_bytes'])} stored"]
    for fmt, e in sorted(c["linear_formats"].items()):
        lines.append(f"  {fmt:<12} {e['linears']:6d} Linears  {_size(e['bytes'])}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- a parallel engine
def engine_ranks(engine_dir) -> dict:
    """Per rank of a parallel engine dir: its heads, experts, weight bytes and KV plan (every
    rank has its own cache: under TP its KV heads only, under attention DP all of them)."""
    import json
    from pathlib import Path

    from .engine.parallel.build import read_layout
    from .engine.parallel.mapping import ParallelMapping

    layout = read_layout(Path(engine_dir))
    cfg = BeamConfig.from_hf(Path(engine_dir))
    ranks = []
    for r in range(layout.world):
        raw = json.loads((Path(engine_dir) / f"rank{r}" / "engine.json").read_text())
        m = ParallelMapping.from_json(raw["parallel"], f"rank{r}/engine.json")
        q, kv = m.heads(cfg)
        experts = m.experts(cfg)
        plan = raw["kv_plan"]
        ranks.append({
            "rank": r, "query_heads": [q.start, q.stop - 1], "kv_heads": [kv.start, kv.stop - 1],
            "experts": [experts.start, experts.stop - 1], "moe_tp_rank": m.moe_tp_rank,
            "weight_bytes": sum(f["bytes"] for n, f in raw["files"].items()
                                if n.startswith("weights-")),
            "kv_blocks": plan["num_blocks"], "kv_max_tokens": plan["max_tokens"],
            "kv_bytes": plan["total_bytes"], "kv_dtype": plan["kv_dtype"]})
    return {"layout": layout.describe(), "world": layout.world, "ranks": ranks}


def format_ranks(p: dict) -> str:
    lines = [f"parallel        {p['layout']}, {p['world']} ranks (one engine dir each)"]
    for r in p["ranks"]:
        lines.append(f"  rank {r['rank']}: q heads {r['query_heads'][0]}-{r['query_heads'][1]}, "
                     f"kv heads {r['kv_heads'][0]}-{r['kv_heads'][1]}, experts "
                     f"{r['experts'][0]}-{r['experts'][1]} (slice {r['moe_tp_rank']}); weights "
                     f"{_size(r['weight_bytes'])}; KV {r['kv_blocks']} blocks = "
                     f"{r['kv_max_tokens']:,} tokens, {_size(r['kv_bytes'])} {r['kv_dtype']}")
    return "\n".join(lines)
