"""A DFlash2 drafter's tensors in the layout vLLM 0.33 and SGLang 0.5.23 load
(shared/research/dflash2.md §2): safetensors + config.json, names relative to the drafter with
no biases, no embed_tokens and no lm_head (both are the target's).

Reading accepts what either engine accepts: an optional `model.` prefix, and SGLang's
`encoder.fc.weight` / `encoder.output_norm_enc.weight` for `fc.weight` / `hidden_norm.weight`.
A copy of the target's `embed_tokens.weight` is dropped (vLLM loads it into a parameter it then
replaces with the target's). Every other name must be exactly the expected set with the
expected shapes: the first missing, extra or misshaped tensor is refused by name, before any
tensor data is read.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import DraftConfig, DraftError
from .quant import QUANT_FILE, SCALE_SUFFIX, check_scales, check_stored_dtypes, read_quant

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SGLANG_RENAMES = {"encoder.fc.weight": "fc.weight",
                  "encoder.output_norm_enc.weight": "hidden_norm.weight"}
DROPPED = ("embed_tokens.weight",)  # the target's; vLLM replaces what a checkpoint ships
STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def expected_tensors(c: DraftConfig, fp8: tuple[str, ...] = ()) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape, in a fixed order; `fp8`: quantized modules (quant.py), whose
    per-channel `weight_scale` [N] follows each one's weight."""
    h, d, taps, g = c.hidden_size, c.head_dim, c.conv_kernel_size, c.conv_groups
    q, kv, inter = c.num_attention_heads * d, c.num_key_value_heads * d, c.intermediate_size
    out = {"fc.weight": (h, len(c.target_layer_ids) * h), "hidden_norm.weight": (h,)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        out.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        for conv in ("attention_conv", "mlp_conv"):
            out[p + conv + ".base_kernel"] = (2, taps, h)
            out[p + conv + ".kernel_projection.weight"] = (2 * taps * g, h)
    out.update({
        "norm.weight": (h,),
        "candidate_selector.predecessor_codebook": (c.vocab_size, c.selector_rank),
        "candidate_selector.successor_codebook": (c.vocab_size, c.selector_rank),
        "candidate_selector.hidden_projection.weight": (c.selector_rank, h),
    })
    if not fp8:
        return out
    quantized = set(fp8)
    with_scales: dict[str, tuple[int, ...]] = {}
    for name, shape in out.items():
        with_scales[name] = shape
        if name.endswith(".weight") and name[:-len(".weight")] in quantized:
            with_scales[name[:-len(".weight")] + SCALE_SUFFIX] = (shape[0],)
    return with_scales


def canonical_name(stored: str) -> str:
    """The drafter-relative name vLLM uses for a stored name (prefix and SGLang renames)."""
    name = stored[len("model."):] if stored.startswith("model.") else stored
    return SGLANG_RENAMES.get(name, name)


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise DraftError(f"{index}: not a safetensors index ({exc})") from None
        return [path / f for f in sorted(set(mapping.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftError(f"{path}: no drafter weights (*.safetensors)")
    return files


def stored_tensors(path: Path) -> dict[str, tuple[Path, str, tuple[int, ...], str]]:
    """canonical name -> (file, stored name, shape, dtype), read from the headers only."""
    out: dict[str, tuple[Path, str, tuple[int, ...], str]] = {}
    for file in _weight_files(path):
        if not file.is_file():
            raise DraftError(f"{file}: listed in the index but missing")
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():
                sl = f.get_slice(stored)
                name = canonical_name(stored)
                if name in out:
                    raise DraftError(f"{file}: tensor {stored} duplicates {out[name][1]} "
                                     f"(both are {name})")
                out[name] = (file, stored, tuple(sl.get_shape()), sl.get_dtype())
    return out


def check_tensors(c: DraftConfig, shapes: dict[str, tuple[int, ...]], where: str,
                  fp8: tuple[str, ...] = (), files: dict[str, str] | None = None) -> None:
    """Refuse the first missing, extra or misshaped tensor, by name (`fp8`: the quantized
    modules, whose scales are then expected too; `files`: name -> the file that holds it, for
    the message)."""
    want = expected_tensors(c, fp8)
    at = (files or {}).get
    for name, shape in want.items():
        if name not in shapes:
            why = (f" (the per-channel scale of the FP8 weight {name[:-len(SCALE_SUFFIX)]}.weight)"
                   if name.endswith(SCALE_SUFFIX) else "")
            raise DraftError(f"{where}: missing tensor {name} {list(shape)}{why}")
        if tuple(shapes[name]) != shape:
            raise DraftError(f"{at(name, where)}: tensor {name} has shape {list(shapes[name])}, "
                             f"the config implies {list(shape)}")
    for name, shape in shapes.items():
        if name in DROPPED and tuple(shape) == (c.vocab_size, c.hidden_size):
            continue
        if name not in want:
            why = (f"a per-channel FP8 scale, but no {QUANT_FILE} names "
                   f"{name[:-len(SCALE_SUFFIX)]}" if name.endswith(SCALE_SUFFIX) else
                   "not a DFlash2BeamDraftModel weight; embed_tokens / lm_head are the target's")
            raise DraftError(f"{at(name, where)}: unexpected tensor {name} {list(shape)} ({why})")


def load_draft_weights(path: str | Path, c: DraftConfig) -> dict[str, torch.Tensor]:
    """Validated tensors of a drafter dir, drafter-relative names, as stored (FP32/BF16/FP16;
    with a quant.json its FP8 modules' codes and FP32 scales, quant.py)."""
    path = Path(path)
    fp8 = read_quant(path, c)
    infos = stored_tensors(path)
    files = {n: str(i[0]) for n, i in infos.items()}
    check_tensors(c, {n: i[2] for n, i in infos.items()}, str(path), fp8, files)
    wanted = expected_tensors(c, fp8)
    check_stored_dtypes({n: i for n, i in infos.items() if n in wanted}, fp8,
                        tuple(STORED_DTYPES), path)
    out: dict[str, torch.Tensor] = {}
    for name in wanted:
        file, stored, _, _ = infos[name]
        with safe_open(str(file), framework="pt") as f:
            out[name] = f.get_tensor(stored)
    check_scales(out, fp8, files)
    return out


def fp8_modules_of(weights: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """The modules of a weights dict stored as FP8 codes (in the dict's order)."""
    return tuple(n[:-len(".weight")] for n, t in weights.items()
                 if n.endswith(".weight") and t.dtype == torch.float8_e4m3fn)


def save_draft(out_dir: str | Path, c: DraftConfig, weights: dict[str, torch.Tensor],
               dtype: torch.dtype = torch.bfloat16) -> str:
    """Write config.json + model.safetensors (vLLM's names, `dtype`); returns the weights'
    SHA-256."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_tensors(c, {n: tuple(t.shape) for n, t in weights.items()}, "weights to save")
    state = {n: weights[n].detach().to("cpu", dtype).contiguous() for n in expected_tensors(c)}
    (out / "config.json").write_text(json.dumps(c.to_dict(), indent=2) + "\n")
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_FILE)
    return sha256_file(out / WEIGHTS_FILE)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def init_draft_weights(c: DraftConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """FP32 weights to train from: projections N(0, 1/fan_in), norms 1, each conv the
    identity (side s, tap 0 = 1, the rest 0; kernel_projection 0: SGLang's initialization,
    which makes each layer a plain pre-norm layer), the predecessor codebook 0 (the pairwise
    term starts at 0 and its gradient does not), the successor codebook N(0, 1/r)."""
    out = {}
    for name, shape in expected_tensors(c).items():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            out[name] = torch.ones(shape)
        elif name.endswith("base_kernel"):
            out[name] = identity_kernel(shape)
        elif name.endswith("kernel_projection.weight") or name.endswith("predecessor_codebook"):
            out[name] = torch.zeros(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    return out


def identity_kernel(shape: tuple[int, ...]) -> torch.Tensor:
    kernel = torch.zeros(shape)
    kernel[:, 0] = 1.0
    return kernel
