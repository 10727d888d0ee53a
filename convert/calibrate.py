"""Activation and KV calibration, streamed one decoder layer at a time through the reference.

ModelOpt's max calibration runs the whole BF16 model and records, per Linear, amax |input| and,
per attention, amax of K and V as they enter the cache. This does the same computation with
`beam_trtllm.reference.BeamDecoderLayer` built and loaded one layer at a time: the hidden states
of all calibration tokens go through layer i, then layer i is dropped. Inside a MoE layer the
experts are loaded one at a time when the router first sends them tokens (`LazyExperts`), so the
peak is the layer's attention + router + one expert, not the layer's 256 experts (20 GB for Beam).
Same ops, same order, same dtype as the full model, so the amax values equal ModelOpt's
(tests/test_convert_modelopt.py checks them bit for bit on the tiny model).

Experts the router never picks: every expert's input amax becomes the max over the layer's
experts (gate/up/down separately), which is ModelOpt's `layer_sync_moe_local_experts_amax`; the
coverage (experts that got tokens per layer) is printed and kept in the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from beam_trtllm.config import BeamConfig
from beam_trtllm.reference import BeamDecoderLayer, BeamMLP

DTYPE = torch.bfloat16  # the model dtype ModelOpt calibrates in (export dtype of the checkpoint)


@dataclass
class Calibration:
    input_amax: dict[str, torch.Tensor] = field(default_factory=dict)  # Linear -> fp32 []
    kv_amax: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    coverage: dict[int, int] = field(default_factory=dict)  # MoE layer -> experts with tokens
    tokens: int = 0

    def record(self, name: str, x: torch.Tensor) -> None:
        lo, hi = torch.aminmax(x.detach())
        amax = torch.maximum(lo.abs(), hi.abs()).float().cpu()
        old = self.input_amax.get(name)
        self.input_amax[name] = amax if old is None else torch.maximum(old, amax)

    def to_json(self) -> dict:
        return {"input_amax": {k: v.item() for k, v in self.input_amax.items()},
                "kv_amax": {str(k): [a.item(), b.item()] for k, (a, b) in self.kv_amax.items()},
                "coverage": {str(k): v for k, v in self.coverage.items()}, "tokens": self.tokens}

    @classmethod
    def from_json(cls, raw: dict) -> "Calibration":
        t = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731  (exact: values are fp32)
        return cls({k: t(v) for k, v in raw["input_amax"].items()},
                   {int(k): (t(a), t(b)) for k, (a, b) in raw["kv_amax"].items()},
                   {int(k): v for k, v in raw["coverage"].items()}, raw["tokens"])


def _watch(module: nn.Linear, name: str, calib: Calibration) -> None:
    module.register_forward_pre_hook(lambda _m, args: calib.record(name, args[0]))


class LazyExperts(nn.Module):
    """`mlp.experts` whose expert e is read from the checkpoint when the router first uses it."""

    def __init__(self, cfg: BeamConfig, layer: int, read, device, calib: Calibration):
        super().__init__()
        self.cfg, self.layer, self.read, self.device, self.calib = cfg, layer, read, device, calib
        self.used: set[int] = set()

    def __getitem__(self, e: int) -> BeamMLP:
        prefix = f"model.layers.{self.layer}.mlp.experts.{e}."
        with torch.device("meta"):
            mlp = BeamMLP(self.cfg.hidden_size, self.cfg.moe_intermediate_size)
        state = {k: self.read(prefix + k).to(self.device, DTYPE) for k in mlp.state_dict()}
        mlp.load_state_dict(state, assign=True)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            _watch(getattr(mlp, proj), prefix + proj, self.calib)
        self.used.add(e)
        return mlp


def _load_layer(cfg, i, read, device, calib) -> tuple[BeamDecoderLayer, LazyExperts | None]:
    with torch.device("meta"):
        layer = BeamDecoderLayer(cfg, i)
    experts = None
    if cfg.is_moe(i):
        experts = LazyExperts(cfg, i, read, device, calib)
        layer.mlp.experts = experts
    prefix = f"model.layers.{i}."
    state = {}
    for k in layer.state_dict():
        dtype = torch.float32 if ".mlp.gate." in "." + k else DTYPE  # router stays FP32
        state[k] = read(prefix + k).to(device, dtype)
    layer.load_state_dict(state, assign=True, strict=True)
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            _watch(module, prefix + name, calib)
    return layer.eval().requires_grad_(False), experts


def _observe_kv(calib: Calibration, layer: int):
    def observe(k, v):
        for slot, t in enumerate((k, v)):
            lo, hi = torch.aminmax(t.detach())
            amax = torch.maximum(lo.abs(), hi.abs()).float().cpu()
            old = calib.kv_amax.get(layer, (None, None))
            pair = list(old)
            pair[slot] = amax if old[slot] is None else torch.maximum(old[slot], amax)
            calib.kv_amax[layer] = tuple(pair)
    return observe


def sync_experts(cfg: BeamConfig, calib: Calibration, layer: int) -> None:
    """Every expert of the layer gets the layer's max input amax per projection."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}" for e in range(cfg.n_routed_experts)]
        seen = [calib.input_amax[n] for n in names if n in calib.input_amax]
        if seen:
            top = torch.stack(seen).max()
            for n in names:
                calib.input_amax[n] = top.clone()


@torch.inference_mode()
def calibrate(cfg: BeamConfig, read, ids: torch.Tensor, device="cpu", log=print) -> Calibration:
    """`read(name)` -> input tensor. ids [samples, seq_len]. One layer resident at a time."""
    calib = Calibration(tokens=ids.numel())
    b, t = ids.shape
    ids = ids.to(device)
    positions = torch.arange(t, device=device).expand(b, t)
    h = F.embedding(ids, read("model.embed_tokens.weight").to(device, DTYPE))
    for i in range(cfg.num_hidden_layers):
        layer, experts = _load_layer(cfg, i, read, device, calib)
        layer.self_attn.kv_observer = _observe_kv(calib, i)
        h = layer(h, positions)
        if experts is not None:
            calib.coverage[i] = len(experts.used)
            sync_experts(cfg, calib, i)
        extra = (f", {calib.coverage[i]}/{cfg.n_routed_experts} experts routed"
                 if experts is not None else "")
        log(f"  calibrated layer {i + 1}/{cfg.num_hidden_layers}{extra}")
        del layer, experts
    return calib
