"""Repacking checkpoint weights into the layout the `beam::` ops read (docs/DESIGN.md §2).

Per decoder layer, from a BF16, ModelOpt-quantized or compressed-tensors FP8_DYNAMIC checkpoint
(the format of each Linear is read off its tensors, so mixed precision works; compressed-
tensors Linears are "fp8_channel": FP8 weights with one scale per output row, activations
quantized per token by the op):
- `self_attn.qkvg_proj`: q, k, v and the output gate's `gate_proj` packed along the output dim
  (vLLM's qkv_gate_proj: all four read the same x), so one GEMM produces the `qkvg` row
  `beam::qk_prep` takes; `self_attn.gate_bias` [Hq] beside it. Matrices pack into one *segment* (one GEMM)
  when they share a format and what the GEMM needs to share: FP8 W8A8 the activation scale
  (weight scales become per-row), NVFP4 the global `weight_scale_2` (ModelOpt's fused-input
  rule gives q/k/v one), 128-row alignment for FP8 blocks. Otherwise they become consecutive
  segments (e.g. NVFP4 q/k/v with a gate_proj of another global scale).
- `self_attn.o_proj`, dense `mlp.gate_up_proj` (gate rows, then up rows) and `mlp.down_proj`.
- MoE: router weight/bias (FP32) and all experts stacked: `w13 [E, 2I, H]` (each expert's gate
  rows then up rows), `w2 [E, H, I]` plus the scales of §2.
- FP8 KV scales `self_attn.k_scale` / `v_scale`.
Engine tensor names: `{packed}.{segment}.{field}`, e.g.
`model.layers.3.self_attn.qkvg_proj.0.weight`, and `model.layers.3.mlp.experts.w13`.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..config import BeamConfig
from ..quant_formats import FP8_BLOCK, fp8_block_scale_2d
from ..quant_schemes import Scheme
from .types import EngineError

FIELDS = {
    "bf16": ("weight",),
    "fp8": ("weight", "weight_scale", "input_scale"),
    "fp8_block": ("weight", "weight_scale"),
    "fp8_channel": ("weight", "weight_scale"),  # compressed-tensors FP8_DYNAMIC: scale [N]
    "nvfp4": ("weight", "weight_scale", "weight_scale_2"),
}
PACKED = {  # engine name -> checkpoint Linears packed into it, in output-row order
    "self_attn.qkvg_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                            "self_attn.gate_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")

Get = Callable[[str], torch.Tensor]  # checkpoint tensor by name (raises EngineError if absent)


def linear_format(get_dtype: Callable[[str], "torch.dtype | None"], name: str,
                  scheme: Scheme | None = None) -> str:
    """The format of checkpoint Linear `name` (module path), from its weight's dtype; in a
    compressed-tensors checkpoint from its scheme (targets and `ignore`), which the weight's
    dtype must agree with."""
    dtype = get_dtype(f"{name}.weight")
    if dtype is None:
        raise EngineError(f"checkpoint has no tensor {name}.weight")
    if scheme is not None and scheme.method == "compressed-tensors":
        return _ct_format(name, dtype, scheme)
    if dtype in (torch.bfloat16, torch.float16, torch.float32):
        return "bf16"
    if dtype == torch.uint8:
        return "nvfp4"
    if dtype == torch.float8_e4m3fn:
        return "fp8"  # fp8 vs fp8_block is told apart by the scale's rank in `_part`
    raise EngineError(f"checkpoint tensor {name}.weight has dtype {dtype}, which no beam:: "
                      "GEMM reads (bf16, float8_e4m3fn or uint8 NVFP4 expected)")


def _ct_format(name: str, dtype: torch.dtype, scheme: Scheme) -> str:
    if scheme.ct_quantized(name):
        if dtype != torch.float8_e4m3fn:
            raise EngineError(f"checkpoint tensor {name}.weight is {dtype}, but the "
                              "compressed-tensors scheme quantizes it (no `ignore` entry matches "
                              f"{name}): expected float8_e4m3fn")
        return "fp8_channel"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise EngineError(f"checkpoint tensor {name}.weight is {dtype}, but the "
                          f"compressed-tensors scheme leaves {name} unquantized (ignore "
                          f"{scheme.ignore}, targets {scheme.targets})")
    return "bf16"


def _channel_part(get: Get, get_dtype, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors FP8_DYNAMIC: weight_scale [N, 1] in the model dtype -> FP32 [N]."""
    scale_name = f"{name}.weight_scale"
    if get_dtype(scale_name) is None:
        raise EngineError(f"checkpoint has no tensor {scale_name}: the per-channel scale of the "
                          f"FP8 weight {name}.weight {list(w.shape)}")
    scale = get(scale_name)
    n = w.shape[0]
    if tuple(scale.shape) not in ((n, 1), (n,)) or not scale.is_floating_point():
        raise EngineError(f"checkpoint tensor {scale_name} is {scale.dtype} {list(scale.shape)}; "
                          f"a per-channel FP8 weight [{n}, {w.shape[1]}] needs a float scale "
                          f"[{n}, 1]")
    scale = scale.float().reshape(n)
    if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
        raise EngineError(f"checkpoint tensor {scale_name} holds a scale that is not a positive "
                          "finite number")
    return {"weight": w, "weight_scale": scale.contiguous()}


def _part(get: Get, get_dtype, name: str, fmt: str,
          dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """One checkpoint Linear in the engine's per-format fields (FP8 scales made per-row;
    an unquantized weight in the engine's activation dtype)."""
    w = get(f"{name}.weight")
    if fmt == "bf16":
        return {"weight": w.to(dtype)}
    if fmt == "fp8_channel":
        return _channel_part(get, get_dtype, name, w)
    if fmt == "nvfp4":
        if get_dtype(f"{name}.input_scale") is not None:
            get(f"{name}.input_scale")  # W4A16 on Hopper: activations stay BF16, scale unused
        return {"weight": w, "weight_scale": get(f"{name}.weight_scale"),
                "weight_scale_2": get(f"{name}.weight_scale_2").float().reshape(())}
    scale = get(f"{name}.weight_scale").float()
    if _is_block_scale(scale, w, get_dtype(f"{name}.input_scale") is not None, name):
        scale = fp8_block_scale_2d(scale).reshape(-(-w.shape[0] // FP8_BLOCK), -(-w.shape[1] // FP8_BLOCK))
        return {"weight": w, "weight_scale": scale.contiguous(), "_block": torch.tensor(1)}
    per_row = scale.reshape(-1).expand(w.shape[0]).contiguous() if scale.numel() == 1 else scale
    return {"weight": w, "weight_scale": per_row,
            "input_scale": get(f"{name}.input_scale").float().reshape(())}


def _is_block_scale(scale: torch.Tensor, w: torch.Tensor, has_input_scale: bool, name: str) -> bool:
    """ModelOpt writes 128x128 block scales as [nb, 1, kb, 1] (0-d for a single block) and no
    input_scale (weight-only blocks, activations quantized per token in the GEMM)."""
    if scale.dim() in (2, 4):
        return True
    if scale.dim() == 0 and not has_input_scale:
        if w.shape[0] > FP8_BLOCK or w.shape[1] > FP8_BLOCK:
            raise EngineError(f"checkpoint tensor {name}.weight is FP8 with one scale and no "
                              "input_scale: neither a per-tensor W8A8 nor a block-scaled Linear")
        return True
    return False


def _packable(fmt: str, seg: list[dict], part: dict) -> bool:
    if fmt in ("bf16", "fp8_channel"):  # per-token activation scales: nothing to share
        return True
    if fmt == "nvfp4":
        return bool(torch.equal(seg[0]["weight_scale_2"], part["weight_scale_2"]))
    if "_block" in part:  # 128x128 blocks must not straddle two matrices
        return all(p["weight"].shape[0] % FP8_BLOCK == 0 for p in seg)
    return bool(torch.equal(seg[0]["input_scale"], part["input_scale"]))


def _concat(fmt: str, parts: list[dict]) -> dict[str, torch.Tensor]:
    out = {"weight": torch.cat([p["weight"] for p in parts])}
    if fmt == "bf16":
        return out
    out["weight_scale"] = torch.cat([p["weight_scale"] for p in parts])
    for key in ("weight_scale_2", "input_scale"):
        if key in parts[0]:
            out[key] = parts[0][key]
    return out


def pack_linears(get: Get, get_dtype, prefix: str, names: tuple[str, ...],
                 dtype: torch.dtype = torch.bfloat16, scheme: Scheme | None = None):
    """Checkpoint Linears `prefix + name` -> (engine tensors {"{seg}.{field}": t}, segment plan).

    Plan entry per segment: {"format", "parts", "rows"} (rows = output features)."""
    segments: list[tuple[str, list[str], list[dict]]] = []
    for name in names:
        full = prefix + name
        fmt = linear_format(get_dtype, full, scheme)
        part = _part(get, get_dtype, full, fmt, dtype)
        fmt = "fp8_block" if "_block" in part else fmt
        if segments and segments[-1][0] == fmt and _packable(fmt, segments[-1][2], part):
            segments[-1][1].append(name)
            segments[-1][2].append(part)
        else:
            segments.append((fmt, [name], [part]))
    tensors, plan = {}, []
    for s, (fmt, seg_names, parts) in enumerate(segments):
        for key, t in _concat(fmt, parts).items():
            tensors[f"{s}.{key}"] = t.contiguous()
        plan.append({"format": fmt, "parts": seg_names,
                     "rows": sum(int(p["weight"].shape[0]) for p in parts)})
    return tensors, plan


# ---------------------------------------------------------------------------- experts
def pack_experts(get: Get, get_dtype, prefix: str, cfg: BeamConfig,
                 dtype: torch.dtype = torch.bfloat16, scheme: Scheme | None = None,
                 experts: range | None = None):
    """The routed experts of one layer (all, or an expert-parallel rank's contiguous range)
    -> ({w13, w2, scales}, format) in the moe op layout."""
    experts = range(cfg.num_experts) if experts is None else experts
    fmt = linear_format(get_dtype, f"{prefix}mlp.experts.{experts.start}.gate_proj", scheme)
    gate, up, down = [], [], []
    for e in experts:
        p = f"{prefix}mlp.experts.{e}."
        for name in ("gate_proj", "up_proj", "down_proj"):
            if linear_format(get_dtype, p + name, scheme) != fmt:
                raise EngineError(f"{p}{name} is not {fmt} like expert 0's gate_proj: the moe op "
                                  "needs every expert of a layer in one format")
        gate.append(_part(get, get_dtype, p + "gate_proj", fmt, dtype))
        up.append(_part(get, get_dtype, p + "up_proj", fmt, dtype))
        down.append(_part(get, get_dtype, p + "down_proj", fmt, dtype))
    if fmt == "fp8" and "_block" in gate[0]:
        fmt = "fp8_block"
    out = {"w13": torch.stack([torch.cat([g["weight"], u["weight"]]) for g, u in zip(gate, up)]),
           "w2": torch.stack([d["weight"] for d in down])}
    if fmt == "bf16":
        return out, fmt
    if fmt == "nvfp4":
        for e, (g, u) in enumerate(zip(gate, up)):
            if not torch.equal(g["weight_scale_2"], u["weight_scale_2"]):
                raise EngineError(f"{prefix}mlp.experts.{e}: gate_proj and up_proj have different "
                                  "weight_scale_2; the fused w13 needs one (ModelOpt's fused-input rule)")
        out["w13_scale"] = torch.stack([torch.cat([g["weight_scale"], u["weight_scale"]])
                                        for g, u in zip(gate, up)])
        out["w13_scale_2"] = torch.stack([g["weight_scale_2"] for g in gate])
        out["w2_scale"] = torch.stack([d["weight_scale"] for d in down])
        out["w2_scale_2"] = torch.stack([d["weight_scale_2"] for d in down])
        return out, fmt
    if fmt == "fp8_block":
        out["w13_scale"] = torch.stack([torch.cat([_rows(g["weight_scale"], g["weight"].shape[0]),
                                                   _rows(u["weight_scale"], u["weight"].shape[0])])
                                        for g, u in zip(gate, up)])
        out["w2_scale"] = torch.stack([_rows(d["weight_scale"], d["weight"].shape[0]) for d in down])
        return out, fmt
    out["w13_scale"] = torch.stack([torch.cat([g["weight_scale"], u["weight_scale"]])
                                    for g, u in zip(gate, up)])
    out["w2_scale"] = torch.stack([d["weight_scale"] for d in down])
    if fmt == "fp8_channel":  # activations scaled per token by the op
        return out, fmt
    out["a13_scale"] = _shared_scale([s for g, u in zip(gate, up) for s in (g, u)],
                                     f"{prefix}mlp.experts.*.gate_proj/up_proj.input_scale")
    out["a2_scale"] = _shared_scale(down, f"{prefix}mlp.experts.*.down_proj.input_scale")
    return out, fmt


def _rows(block_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """[ceil(N/128), ceil(K/128)] block scales -> [N, ceil(K/128)] (each row its block's)."""
    return block_scale.repeat_interleave(FP8_BLOCK, 0)[:rows]


def _shared_scale(parts: list[dict], what: str) -> torch.Tensor:
    scales = torch.stack([p["input_scale"] for p in parts])
    if not bool((scales == scales[0]).all()):
        raise EngineError(f"{what}: the experts' activation scales differ ({float(scales.min()):.6g}"
                          f"..{float(scales.max()):.6g}); the moe_fp8 op quantizes a layer's "
                          "activations with one static scale (ModelOpt syncs them across experts)")
    return scales[0].clone()


# ---------------------------------------------------------------------------- whole model
def layer_tensors(get: Get, get_dtype, cfg: BeamConfig, i: int,
                  dtype: torch.dtype = torch.bfloat16, scheme: Scheme | None = None,
                  experts: range | None = None):
    """Engine tensors of decoder layer i and its plan entry (segments and expert format);
    unquantized tensors in `dtype` (the router FP32). `experts`: an expert-parallel rank's."""
    p = f"model.layers.{i}."
    out: dict[str, torch.Tensor] = {}
    plan: dict = {}
    for norm in LAYER_NORMS:
        out[f"{p}{norm}.weight"] = get(f"{p}{norm}.weight").to(dtype)
    for name in ("q_norm.weight", "k_norm.weight", "gate_bias"):
        out[f"{p}self_attn.{name}"] = get(f"{p}self_attn.{name}").to(dtype)
    packed = ["self_attn.qkvg_proj", "self_attn.o_proj"]
    if not cfg.is_moe(i):
        packed += ["mlp.gate_up_proj", "mlp.down_proj"]
    for name in packed:
        tensors, segs = pack_linears(get, get_dtype, p, PACKED[name], dtype, scheme)
        out.update({f"{p}{name}.{k}": t for k, t in tensors.items()})
        plan[name] = segs
    if cfg.is_moe(i):
        out[f"{p}mlp.gate.weight"] = get(f"{p}mlp.gate.weight").float()
        out[f"{p}mlp.gate.e_score_correction_bias"] = get(f"{p}mlp.gate.e_score_correction_bias").float()
        packed_experts, fmt = pack_experts(get, get_dtype, p, cfg, dtype, scheme, experts)
        out.update({f"{p}mlp.experts.{k}": t.contiguous() for k, t in packed_experts.items()})
        plan["experts"] = fmt
    for kv in ("k", "v"):
        name = f"{p}self_attn.{kv}_proj.{kv}_scale"
        if get_dtype(name) is not None:
            out[f"{p}self_attn.{kv}_scale"] = get(name).float().reshape(())
    return out, plan


def iter_engine_tensors(get: Get, get_dtype, cfg: BeamConfig,
                        dtype: torch.dtype = torch.bfloat16,
                        scheme: Scheme | None = None,
                        experts: range | None = None) -> Iterator[tuple[str, dict, dict]]:
    """Yield (group, tensors, plan) one group at a time: "embed", each layer, "head". `scheme`:
    the checkpoint's declared quantization (quant_schemes.read_scheme); `experts`: the expert
    range of an expert-parallel rank (default all)."""
    yield "embed", {"model.embed_tokens.weight": get("model.embed_tokens.weight").to(dtype)}, {}
    for i in range(cfg.num_hidden_layers):
        tensors, plan = layer_tensors(get, get_dtype, cfg, i, dtype, scheme, experts)
        yield f"layer{i}", tensors, plan
    if linear_format(get_dtype, "lm_head", scheme) != "bf16":
        raise EngineError("checkpoint tensor lm_head.weight is quantized; the engine runs the "
                          "LM head unquantized (every shipped recipe and published FP8 / NVFP4 "
                          "Beam keeps it BF16)")
    yield "head", {"model.norm.weight": get("model.norm.weight").to(dtype),
                   "lm_head.weight": get("lm_head.weight").to(dtype)}, {}
