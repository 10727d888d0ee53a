"""Activation and KV calibration, streamed one decoder layer at a time through transformers' Beam.

ModelOpt's max calibration runs the whole BF16 `BeamForCausalLM` and records, per Linear,
amax |input| and, per attention, amax of K and V as they enter the cache. This runs the same
computation with transformers' own modules (`transformers.models.beam.modeling_beam`), built
and loaded one `BeamDecoderLayer` at a time: the hidden states of all calibration tokens go
through layer i, then layer i is dropped. The layer inputs are made as `BeamModel.forward`
makes them (its RoPE module, `compute_attention_scaling`, its mask functions; no cache, as
ModelOpt's calibration loop runs with `use_cache=False`). Inside a MoE layer the experts are
read one at a time when the router first sends them tokens (`LazyExperts`, a `BeamExperts`
whose forward is BeamExperts' eager loop), so the peak is the layer's attention + router + two
experts (the one computing and the next one being read), not the layer's 256 experts (20 GB for
Beam). Same ops, same order, same dtype as the full model, so the amax values equal ModelOpt's
(tests/test_convert_modelopt.py checks the exported scales byte for byte on the tiny model).

Threads: the GEMMs (every Linear, the experts' F.linear, SDPA) run on all cores' intra-op
threads and every other op on ONE thread, while two reader threads fetch the next expert and
the next layer's weights. With all ops on two intra-op threads calibration ran 2-3x slower on
full-size layers of 1,024 tokens and ~100x on the tiny model on the 2-core box (OpenMP barriers
in every small op such as BeamExperts' `index_add_`, which wait for a core another process
holds); with all ops on one thread a BF16 GEMM runs at 275 instead of 750 GFLOPS, 1.5x slower
calibration of the default 8,192 tokens (docs/CONVERT.md "Calibration"). The amax values are
the same whatever the threads (tests/test_convert_modelopt.py).

What is recorded, and how:
- Linear inputs: forward pre-hooks (q/k/v/gate_proj of the attention all read the same x);
- an expert's gate_up input and down input: inside `LazyExperts.forward`. ModelOpt's
  `_QuantFusedExperts` shares one input quantizer over a layer's experts, so every expert's
  input amax becomes the max over the layer's experts (`sync_experts`), experts the router
  never picked included; the coverage (experts that got tokens per layer) is printed and kept;
- K and V after k_norm and, on sliding layers, after RoPE (what enters the cache): an attention
  function registered with transformers' `AttentionInterface` records them, then runs SDPA.
"""

from __future__ import annotations

import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from beam_trtllm.config import BeamConfig

from .st_io import byte_buffer

DTYPE = torch.bfloat16  # the model dtype ModelOpt calibrates in (export dtype of the checkpoint)
# The attention ModelOpt's model runs: transformers' default for BeamForCausalLM.from_pretrained.
# Eager attention rounds differently in BF16, which would move every later layer's amax.
BASE_ATTENTION = "sdpa"
RECORDING_ATTENTION = "beam_trt_calibration"  # BASE_ATTENTION that records K/V amax first


def _amax(x: torch.Tensor) -> torch.Tensor:
    lo, hi = torch.aminmax(x.detach())
    return torch.maximum(lo.abs(), hi.abs()).float().cpu()


@dataclass
class Calibration:
    input_amax: dict[str, torch.Tensor] = field(default_factory=dict)  # Linear -> fp32 []
    kv_amax: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    expert_tokens: dict[int, list[int]] = field(default_factory=dict)  # MoE layer -> per expert
    tokens: int = 0

    @property
    def coverage(self) -> dict[int, int]:
        """MoE layer -> how many experts received tokens."""
        return {i: sum(c > 0 for c in counts) for i, counts in self.expert_tokens.items()}

    def record(self, name: str, x: torch.Tensor) -> None:
        amax, old = _amax(x), self.input_amax.get(name)
        self.input_amax[name] = amax if old is None else torch.maximum(old, amax)

    def record_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        new = (_amax(key), _amax(value))
        old = self.kv_amax.get(layer)
        self.kv_amax[layer] = new if old is None else tuple(map(torch.maximum, old, new))

    def to_json(self) -> dict:
        return {"input_amax": {k: v.item() for k, v in self.input_amax.items()},
                "kv_amax": {str(k): [a.item(), b.item()] for k, (a, b) in self.kv_amax.items()},
                "expert_tokens": {str(k): v for k, v in self.expert_tokens.items()},
                "tokens": self.tokens}

    @classmethod
    def from_json(cls, raw: dict) -> "Calibration":
        t = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731  (exact: values are fp32)
        return cls({k: t(v) for k, v in raw["input_amax"].items()},
                   {int(k): (t(a), t(b)) for k, (a, b) in raw["kv_amax"].items()},
                   {int(k): v for k, v in raw["expert_tokens"].items()}, raw["tokens"])


_GEMM_THREADS = [1]  # intra-op threads for the GEMMs: the caller's setting (calibrate)


@contextlib.contextmanager
def _gemm_threads():
    torch.set_num_threads(_GEMM_THREADS[0])
    try:
        yield
    finally:
        torch.set_num_threads(1)


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' BASE_ATTENTION, after recording amax |K|, |V| as they enter the cache (the
    tensors ModelOpt's `_QuantAttention` hands its k/v_bmm_quantizers)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    module.kv_calibration.record_kv(module.layer_idx, key, value)
    base = ALL_ATTENTION_FUNCTIONS[BASE_ATTENTION]
    with _gemm_threads():
        return base(module, query, key, value, attention_mask, **kwargs)


def _register_recording_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(RECORDING_ATTENTION, _recording_attention)
    base_mask = ALL_MASK_ATTENTION_FUNCTIONS[BASE_ATTENTION]
    AttentionMaskInterface.register(RECORDING_ATTENTION, base_mask)


@functools.cache
def _lazy_experts_class():  # a function: transformers is imported only when calibrating
    from transformers.models.beam.modeling_beam import BeamExperts

    class LazyExperts(BeamExperts):
        """`mlp.experts` of one layer whose expert e is read from the checkpoint when the router
        first sends it tokens, and dropped after; records the gate/up and the down input."""

        def __init__(self, config, prefix: str, read, device, calib: Calibration, ahead):
            with torch.device("meta"):
                super().__init__(config)
            del self.gate_up_proj, self.down_proj  # the weights stay on disk until used
            self.prefix, self.read, self.device, self.calib = prefix, read, device, calib
            self.ahead = ahead  # one-thread pool that reads the next expert meanwhile
            self.tokens = [0] * self.num_experts

        def _expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
            p = f"{self.prefix}{e}."
            load = lambda n: self.read(p + n).to(self.device, DTYPE)  # noqa: E731
            # gate rows first: the [2I, H] slice BeamExperts.gate_up_proj[e] would be
            gate, up = load("gate_proj.weight"), load("up_proj.weight")
            shape = (gate.shape[0] + up.shape[0], gate.shape[1])
            if torch.device(self.device).type == "cpu":  # huge pages (st_io.byte_buffer)
                gate_up = byte_buffer(shape[0] * shape[1] * gate.element_size()).view(DTYPE)
                gate_up = gate_up.view(shape)
            else:
                gate_up = torch.empty(shape, dtype=DTYPE, device=self.device)
            torch.cat([gate, up], out=gate_up)
            return gate_up, load("down_proj.weight")

        def _record(self, e: int, gate_up_input: torch.Tensor, down_input: torch.Tensor) -> None:
            p = f"{self.prefix}{e}."
            self.tokens[e] += gate_up_input.shape[0]
            self.calib.record(p + "gate_proj", gate_up_input)
            self.calib.record(p + "up_proj", gate_up_input)
            self.calib.record(p + "down_proj", down_input)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            # BeamExperts.forward (eager), the expert weights read per expert, one ahead
            final = torch.zeros_like(hidden_states)
            with torch.no_grad():
                mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
                hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            order = [int(e[0]) for e in hit if int(e[0]) != self.num_experts]
            pending = self.ahead.submit(self._expert, order[0]) if order else None
            for j, expert_idx in enumerate(order):
                gate_up, down = pending.result()
                if j + 1 < len(order):
                    pending = self.ahead.submit(self._expert, order[j + 1])
                top_k_pos, token_idx = torch.where(mask[expert_idx])
                x = hidden_states[token_idx]
                with _gemm_threads():
                    current = F.linear(x, gate_up)
                current = self._apply_gate(current)
                self._record(expert_idx, x, current)
                with _gemm_threads():
                    current = F.linear(current, down)
                current = current * top_k_weights[token_idx, top_k_pos, None]
                final.index_add_(0, token_idx, current.to(final.dtype))
                del gate_up, down  # at most two resident: this one and the next being read
            return final

    return LazyExperts


def _watch(module: nn.Linear, name: str, calib: Calibration) -> None:
    """Record the Linear's input amax, then run its GEMM on the GEMM threads."""
    def before(_module, args):
        calib.record(name, args[0])
        torch.set_num_threads(_GEMM_THREADS[0])

    module.register_forward_pre_hook(before)
    module.register_forward_hook(lambda *_: torch.set_num_threads(1))


def _layer_state(hf_cfg, i: int, read, device) -> dict[str, torch.Tensor]:
    """Layer i's weights except the experts (read by LazyExperts when routed)."""
    from transformers.models.beam.modeling_beam import BeamDecoderLayer

    with torch.device("meta"):
        names = [k for k in BeamDecoderLayer(hf_cfg, i).state_dict() if ".experts." not in k]
    prefix = f"model.layers.{i}."
    return {k: read(prefix + k).to(device, torch.float32 if k.startswith("mlp.gate.") else DTYPE)
            for k in names}  # the router stays FP32


def _load_layer(hf_cfg, i: int, state, read, device, calib: Calibration, ahead):
    """transformers' BeamDecoderLayer i with its weights (experts lazy), hooked for calibration."""
    from transformers.models.beam.modeling_beam import BeamDecoderLayer

    with torch.device("meta"):
        layer = BeamDecoderLayer(hf_cfg, i)
    prefix = f"model.layers.{i}."
    experts = None
    if hf_cfg.mlp_layer_types[i] == "sparse":
        experts = _lazy_experts_class()(hf_cfg, prefix + "mlp.experts.", read, device, calib,
                                        ahead)
        layer.mlp.experts = experts
    layer.load_state_dict(state, assign=True, strict=True)
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            _watch(module, prefix + name, calib)
    layer.self_attn.kv_calibration = calib
    return layer.eval().requires_grad_(False), experts


def _layer_inputs(hf_cfg, h: torch.Tensor):
    """Per layer type: (mask, RoPE cos/sin or None, SSMax scaling or None), as BeamModel.forward
    makes them for a forward without cache or padding."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.models.beam.modeling_beam import (BeamRotaryEmbedding,
                                                        compute_attention_scaling)

    position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    kwargs = {"config": hf_cfg, "inputs_embeds": h, "attention_mask": None, "cache": None,
              "position_ids": position_ids}
    masks = {"full_attention": create_causal_mask,
             "sliding_attention": create_sliding_window_causal_mask}
    rotary = BeamRotaryEmbedding(hf_cfg, device=h.device)
    out = {}
    for layer_type in set(hf_cfg.layer_types):
        if hf_cfg.rope_parameters[layer_type] is None:  # full layers: NoPE with SSMax
            rope, scaling = None, compute_attention_scaling(position_ids)
        else:
            rope, scaling = rotary(h, position_ids, layer_type), None
        out[layer_type] = (masks[layer_type](**kwargs), rope, scaling)
    return out, position_ids


def sync_experts(cfg: BeamConfig, calib: Calibration, layer: int) -> None:
    """Every expert of the layer gets the layer's max input amax per projection."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}" for e in range(cfg.num_experts)]
        seen = [calib.input_amax[n] for n in names if n in calib.input_amax]
        if seen:
            top = torch.stack(seen).max()
            for n in names:
                calib.input_amax[n] = top.clone()


def calibrate(cfg: BeamConfig, read, ids: torch.Tensor, device="cpu", log=print) -> Calibration:
    """`read(name)` -> input tensor. ids [samples, seq_len]. One layer resident at a time (and
    the next one's dense weights, read ahead); GEMMs on the caller's torch threads, every other
    op on one (module docstring)."""
    threads = torch.get_num_threads()
    _GEMM_THREADS[0] = threads
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="beam-calib-experts") as ahead, \
                ThreadPoolExecutor(1, thread_name_prefix="beam-calib-layer") as next_layer:
            return _calibrate(cfg, read, ids, device, log, ahead, next_layer)
    finally:
        torch.set_num_threads(threads)


@torch.inference_mode()
def _calibrate(cfg: BeamConfig, read, ids: torch.Tensor, device, log, ahead,
               next_layer) -> Calibration:
    from beam_trtllm.hf_model import hf_config

    _register_recording_attention()
    hf_cfg = hf_config(cfg, attn_implementation=RECORDING_ATTENTION)
    calib = Calibration(tokens=ids.numel())
    ids = ids.to(device)
    h = F.embedding(ids, read("model.embed_tokens.weight").to(device, DTYPE))
    inputs, position_ids = _layer_inputs(hf_cfg, h)
    state = next_layer.submit(_layer_state, hf_cfg, 0, read, device)
    for i in range(cfg.num_hidden_layers):
        layer, experts = _load_layer(hf_cfg, i, state.result(), read, device, calib, ahead)
        if i + 1 < cfg.num_hidden_layers:
            state = next_layer.submit(_layer_state, hf_cfg, i + 1, read, device)
        mask, rope, scaling = inputs[hf_cfg.layer_types[i]]
        h = layer(h, position_embeddings=rope, attention_mask=mask, position_ids=position_ids,
                  attention_scaling=scaling)
        extra = ""
        if experts is not None:
            calib.expert_tokens[i] = experts.tokens
            sync_experts(cfg, calib, i)
            counts = experts.tokens
            extra = (f", {calib.coverage[i]}/{cfg.num_experts} experts routed "
                     f"(tokens per expert: min {min(counts)}, max {max(counts)})")
        log(f"  calibrated layer {i + 1}/{cfg.num_hidden_layers}{extra}")
        del layer, experts
    return calib
