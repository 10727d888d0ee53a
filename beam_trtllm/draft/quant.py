"""FP8 for the DFlash2 drafter (`beam-trt build --draft-quant fp8`, docs/SPECULATIVE.md
"Quantized drafter"): FP8 E4M3 weights with one FP32 scale per output channel, activations
quantized per token inside the GEMM, `beam::linear_fp8_channel` (compressed-tensors'
FP8_DYNAMIC numerics).

A quantized drafter dir holds the drafter's `config.json` unchanged (what vLLM and SGLang
read), `model.safetensors` with each quantized Linear as `<module>.weight` float8_e4m3fn
[N, K] plus `<module>.weight_scale` float32 [N] (the op's layout), every other tensor as the
BF16 drafter stored it, and `quant.json`, the record: {"format": "fp8_channel", "modules":
[...]} naming the quantized Linears. Without quant.json a drafter is unquantized.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .config import DraftConfig, DraftError

QUANT_FILE = "quant.json"
FP8_CHANNEL = "fp8_channel"  # the only format: per-channel FP8 weights, per-token activations
FP8_MAX = 448.0
FP8_DTYPE = "F8_E4M3"  # safetensors' name of torch.float8_e4m3fn
SCALE_SUFFIX = ".weight_scale"
RECORD_FIELDS = ("format", "weights", "activations", "modules")
_LAYER = re.compile(r"^layers\.\d+\.")

# Every drafter tensor -> its precision in a quantized drafter, and why: the drafter's own
# tensors, then each layer's (names without `layers.{i}.`). The matmuls that carry the
# drafter's cost go to FP8; what is elementwise, a gather, or small stays as stored.
TENSOR_PRECISION: dict[str, tuple[str, str]] = {
    "fc.weight": ("fp8", "the context projection [H, n*H]: the largest matmul, run on every "
                  "verified token; RMSNorm follows, so a per-row scale error is normalised"),
    "hidden_norm.weight": ("bf16", "norm weights: elementwise"),
    "norm.weight": ("bf16", "norm weights: elementwise"),
    "candidate_selector.hidden_projection.weight": (
        "bf16", "the selector's low-rank factor [r, H]: small, and its output enters the "
        "pairwise scores that pick among near-tied candidates"),
    "candidate_selector.predecessor_codebook": ("bf16", "selector codebook: a gather of rows"),
    "candidate_selector.successor_codebook": ("bf16", "selector codebook: a gather of rows"),
}
LAYER_TENSOR_PRECISION: dict[str, tuple[str, str]] = {
    "self_attn.q_proj.weight": ("fp8", "attention projection, an [.., H] GEMM per block row"),
    "self_attn.k_proj.weight": ("fp8", "attention projection (block rows and context tokens)"),
    "self_attn.v_proj.weight": ("fp8", "attention projection (block rows and context tokens)"),
    "self_attn.o_proj.weight": ("fp8", "attention output projection"),
    "mlp.gate_proj.weight": ("fp8", "MLP, the largest per-block-row GEMMs"),
    "mlp.up_proj.weight": ("fp8", "MLP, the largest per-block-row GEMMs"),
    "mlp.down_proj.weight": ("fp8", "MLP, the largest per-block-row GEMMs"),
    "attention_conv.kernel_projection.weight": (
        "fp8", "a plain Linear H -> 2*K*G (a tenth of a layer's weight bytes); alone it moves "
        "the trained tiny's block states about as much as fc does (~3%)"),
    "mlp_conv.kernel_projection.weight": ("fp8", "as attention_conv.kernel_projection"),
    "attention_conv.base_kernel": ("bf16", "conv bases: elementwise, [2, K, H], tiny"),
    "mlp_conv.base_kernel": ("bf16", "conv bases: elementwise, [2, K, H], tiny"),
    "input_layernorm.weight": ("bf16", "norm weights: elementwise"),
    "post_attention_layernorm.weight": ("bf16", "norm weights: elementwise"),
    "self_attn.q_norm.weight": ("bf16", "norm weights: elementwise"),
    "self_attn.k_norm.weight": ("bf16", "norm weights: elementwise"),
}


def precision_of(name: str) -> str:
    """'fp8' or 'bf16' for a drafter tensor name (vLLM's, drafter-relative)."""
    layer = _LAYER.match(name)
    table = LAYER_TENSOR_PRECISION if layer else TENSOR_PRECISION
    key = name[layer.end():] if layer else name
    if key not in table:
        raise DraftError(f"tensor {name}: no entry in the drafter's precision tables "
                         "(beam_trtllm/draft/quant.py)")
    return table[key][0]


def fp8_modules(c: DraftConfig) -> tuple[str, ...]:
    """The Linears (module names, no `.weight`) a quantized drafter of `c` stores in FP8."""
    own = [n[:-len(".weight")] for n, (p, _) in TENSOR_PRECISION.items() if p == "fp8"]
    per_layer = [n[:-len(".weight")] for n, (p, _) in LAYER_TENSOR_PRECISION.items() if p == "fp8"]
    return tuple(own) + tuple(f"layers.{i}.{m}" for i in range(c.num_hidden_layers)
                              for m in per_layer)


def quantize_fp8_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (codes float8_e4m3fn [N, K], scale float32 [N]), scale = amax(row) / 448 in
    FP32 and codes = fp8(w / scale), the row's amax landing on 448 exactly. An all-zero row
    gets the smallest normal scale (its codes are 0 whatever it is; the op needs scale > 0)."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.contiguous(), scale.contiguous()


def quantize_draft(c: DraftConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A drafter's validated weights (load_draft_weights) -> the quantized state dict: FP8
    codes and scales for `fp8_modules(c)`, every other tensor as it was stored."""
    out: dict[str, torch.Tensor] = {}
    quantized = set(fp8_modules(c))
    for name, t in weights.items():
        module = name[:-len(".weight")]
        if module in quantized:
            out[name], out[module + SCALE_SUFFIX] = quantize_fp8_channel(t)
        else:
            out[name] = t.contiguous()
    return out


def quant_record(c: DraftConfig) -> dict:
    """quant.json's content for a drafter quantized by `quantize_draft`."""
    return {"format": FP8_CHANNEL,
            "weights": "float8_e4m3fn [N, K], weight_scale float32 [N] (one per output channel)",
            "activations": "float8_e4m3fn per token, scaled dynamically inside "
                           "beam::linear_fp8_channel",
            "modules": list(fp8_modules(c))}


def read_quant(path: Path, c: DraftConfig) -> tuple[str, ...]:
    """The FP8 modules a drafter dir's quant.json names (() without one); an unknown format,
    field or module is refused naming the file."""
    file = Path(path) / QUANT_FILE
    if not file.is_file():
        return ()
    from ..config_json import ConfigError, read_raw

    try:  # (not JSON, not an object: refused by path, as the target's config.json is)
        raw, _ = read_raw(file)
    except ConfigError as exc:
        raise DraftError(f"drafter quantization: {exc}") from None
    extra = sorted(set(raw) - set(RECORD_FIELDS))
    if extra:
        raise DraftError(f"{file}: unknown field {extra[0]!r} (fields: {', '.join(RECORD_FIELDS)})")
    if raw.get("format") != FP8_CHANNEL:
        raise DraftError(f"{file}: format {raw.get('format')!r} is not a drafter quantization "
                         f"beam-trt runs (only {FP8_CHANNEL!r}: FP8 weights per channel, FP8 "
                         "activations per token)")
    modules = raw.get("modules")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise DraftError(f"{file}: modules must be a non-empty list of module names, got "
                         f"{modules!r}")
    allowed = set(fp8_modules(c))
    for m in modules:
        if m not in allowed:
            raise DraftError(f"{file}: module {m!r} is not a Linear the drafter runs in FP8 "
                             "(the precision tables of beam_trtllm/draft/quant.py)")
    if len(set(modules)) != len(modules):
        raise DraftError(f"{file}: modules lists a module twice")
    return tuple(m for m in fp8_modules(c) if m in set(modules))


def check_stored_dtypes(infos: dict, fp8: tuple[str, ...], stored_float: tuple[str, ...],
                        where: Path) -> None:
    """Each tensor's stored dtype: FP8 codes for the modules quant.json names, FP32 scales,
    a float dtype for the rest; a mismatch is refused naming the file and the tensor."""
    quantized = set(fp8)
    for name, (file, stored, _, dtype) in infos.items():
        if name.endswith(SCALE_SUFFIX):
            want, what = ("F32",), "a per-channel FP8 scale (float32)"
        elif name.endswith(".weight") and name[:-len(".weight")] in quantized:
            want, what = (FP8_DTYPE,), f"FP8 ({where / QUANT_FILE} names the module)"
        else:
            want, what = stored_float, "/".join(stored_float)
        if dtype not in want:
            hint = (f"; an FP8 drafter needs {QUANT_FILE}" if dtype == FP8_DTYPE and not fp8
                    else "")
            raise DraftError(f"{file}: tensor {stored} is {dtype}, expected {what}{hint}")


def check_scales(weights: dict[str, torch.Tensor], fp8: tuple[str, ...],
                 files: dict[str, str]) -> None:
    """Refuse a scale that is not a positive finite number (at load, on the host), naming its
    file (`files`: tensor name -> file)."""
    for m in fp8:
        scale = weights[m + SCALE_SUFFIX]
        if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
            raise DraftError(f"{files[m + SCALE_SUFFIX]}: tensor {m}{SCALE_SUFFIX} holds a scale "
                             "that is not a positive finite number")
