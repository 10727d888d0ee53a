"""The trained tiny Beam's architecture and transformers' `BeamForCausalLM` built from it.

`CANONICAL` has every feature of Beam on: sliding (RoPE) and full (NoPE + SSMax) layers,
dense and sparse MLP layers, grouped routing (4 groups of 4 experts, 2 groups kept, top 4),
the routed scale, the per-head attention gate and its bias, the final logit softcap. Sizes:
11.7M parameters, 23.4 MB in BF16 (router FP32); moe_intermediate_size is 128 so that the
fp8-block recipe's 128x128 blocks do not cut the fused gate/up boundary (convert/plan.py), and
every dim is a multiple of NVFP4's 16. The sliding window (128) is shorter than the training
rows (512), so the ring matters.

The router's `e_score_correction_bias` is trained as DeepSeek-V3 trains it (auxiliary-loss-free
balancing, `RouterBalancer`): it moves against each expert's load after every step.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import DENSE, FULL, SLIDING, SPARSE, BeamConfig
from ..hf_model import hf_config

S, F, D, P = SLIDING, FULL, DENSE, SPARSE

CANONICAL = BeamConfig(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=384,
    moe_intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    layer_types=(S, S, F, S, S, F, S, F),
    mlp_layer_types=(D, D, D, D, P, P, P, P),
    num_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    final_logit_softcapping=30.0,
    sliding_window=128,
    max_position_embeddings=4096,
)

# For tests and CPU smoke runs: the same features at a size a few CPU steps train.
SMALL = BeamConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=(S, F, S, F),
    mlp_layer_types=(D, P, D, P),
    num_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    sliding_window=16,
    max_position_embeddings=1024,
)

SIZES = {"canonical": CANONICAL, "small": SMALL}


def weight_bytes(cfg: BeamConfig) -> int:
    """Bytes of the BF16 checkpoint's tensors (routers FP32, as transformers keeps them)."""
    router = cfg.router_params * len(cfg.moe_layers)
    return 2 * (cfg.total_params - router) + 4 * router


def build_model(cfg: BeamConfig, seed: int, attn_implementation: str = "sdpa"):
    """transformers' BeamForCausalLM with transformers' own initialization, seeded (FP32)."""
    from transformers import BeamForCausalLM

    torch.manual_seed(seed)
    model = BeamForCausalLM(hf_config(cfg, attn_implementation))
    n = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for name, b in model.named_buffers() if "e_score_correction_bias" in name)
    if n != cfg.total_params:
        raise RuntimeError(f"transformers' model has {n} parameters, BeamConfig counts "
                           f"{cfg.total_params}")
    return model


AUTOCAST_EXPERTS = "beam_autocast_grouped_mm"


class _CastExperts:
    """An experts module seen with its weights cast to `dtype` (differentiably: the FP32
    master weights receive the gradients); every other attribute is the module's."""

    def __init__(self, module, dtype: torch.dtype):
        self._module = module
        self.gate_up_proj = module.gate_up_proj.to(dtype)
        self.down_proj = module.down_proj.to(dtype)

    def __getattr__(self, name):
        return getattr(self._module, name)


def autocast_grouped_mm(module, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm experts forward, with its weights cast as autocast casts an
    nn.Linear's: torch's grouped_mm takes no part in autocast (pytorch#174763), and on FP32
    weights it runs a per-expert fallback loop instead of the fused BF16 kernel."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    device = hidden_states.device.type
    if torch.is_autocast_enabled(device):
        module = _CastExperts(module, torch.get_autocast_dtype(device))
    return grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)


def register_autocast_experts() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(AUTOCAST_EXPERTS, autocast_grouped_mm)


def routers(model) -> list:
    from transformers.models.beam.modeling_beam import BeamTopKRouter

    return [m for m in model.modules() if isinstance(m, BeamTopKRouter)]


class RouterBalancer:
    """Counts each router's expert choices during training steps; `update` moves every
    `e_score_correction_bias` by `rate` up for experts chosen less than average and down for
    the others (DeepSeek-V3 §2.1.2), and reports the worst max/mean load of the step."""

    def __init__(self, model, rate: float):
        self.rate = rate
        self.routers = routers(model)
        self.counts = [torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers]
        self.hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int):
        def count(module, args, output):
            if module.training:
                idx = output[2].reshape(-1)
                self.counts[i] += torch.bincount(idx, minlength=module.num_experts).float()
        return count

    @torch.no_grad()
    def update(self) -> torch.Tensor:
        """No host sync (the step's kernels stay queued): all device ops, a tensor returned."""
        worst = torch.zeros((), device=self.counts[0].device) if self.counts else torch.zeros(())
        for router, load in zip(self.routers, self.counts):
            mean = load.mean()
            router.e_score_correction_bias += self.rate * torch.sign(mean - load)
            worst = torch.maximum(worst, load.max() / mean.clamp_min(1.0))
            load.zero_()
        return worst

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def to_checkpoint_dtypes(model):
    """BF16 everywhere except the routers (FP32, transformers' `_keep_in_fp32_modules_strict`)."""
    model.to(torch.bfloat16)
    for router in routers(model):
        router.float()
    return model


def save_checkpoint(model, out_dir: Path, ids: dict[str, int], eos: list[int]) -> None:
    """transformers' save_pretrained in BF16 (routers FP32), with the generation config the
    tiny Beams carry (greedy, Beam's stop tokens)."""
    from transformers import GenerationConfig

    from ..tokenizer import END_OF_TEXT, PAD

    model.config.bos_token_id, model.config.eos_token_id = ids[END_OF_TEXT], eos
    model.config.pad_token_id = ids[PAD]
    model.generation_config = GenerationConfig(bos_token_id=ids[END_OF_TEXT], eos_token_id=eos,
                                               pad_token_id=ids[PAD], do_sample=False)
    model.set_experts_implementation("grouped_mm")  # the training-only adapter is not saved
    to_checkpoint_dtypes(model).save_pretrained(out_dir)
