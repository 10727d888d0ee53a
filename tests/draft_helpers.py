"""Shared pieces of the drafter tests (test_draft_model.py, test_draft_checkpoint.py): a small
DFlash2 config over the tiny target, its checkpoint names, seeded weights and contexts."""

from __future__ import annotations

import torch

from beam_trtllm.config import PRESETS
from beam_trtllm.draft import DFlash2Drafter, DraftConfig, DraftKV, expected_tensors

TARGET = PRESETS["tiny"]  # V 512, H 64, 6 layers
CFG = DraftConfig(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=96, rms_norm_eps=1e-6, vocab_size=512,
    max_position_embeddings=4096, rope_theta=10000.0, sliding_window=16,
    target_layer_ids=(1, 3, 5), block_size=6, conv_kernel_size=3, conv_group_size=8,
    selector_rank=12, selector_top_k=7, final_logit_softcapping=30.0, mask_token_id=509,
    num_target_layers=6)
KV_BLOCK = 4  # awkward: a block of 6 rows spans two or three KV blocks


def spec_names(n_layers: int) -> list[str]:
    """Every tensor name of the research file's §2, written out (not from the code)."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight",
             "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
             "candidate_selector.hidden_projection.weight"]
    for i in range(n_layers):
        names += [f"layers.{i}.{n}" for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            "attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
            "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight")]
    return names


def random_weights(cfg: DraftConfig, seed: int) -> dict[str, torch.Tensor]:
    """Trained-looking weights: projections N(0, 1/fan_in), norms ~1, convs near the identity
    with a dynamic part, codebooks of unit-scale rows."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_tensors(cfg).items():
        z = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            out[name] = 1.0 + 0.1 * z
        elif name.endswith("base_kernel"):
            out[name] = 0.3 * z + torch.tensor([1.0] + [0.0] * (shape[1] - 1))[None, :, None]
        elif name.endswith("kernel_projection.weight"):
            out[name] = 0.3 * z / shape[-1] ** 0.5
        else:
            out[name] = z / shape[-1] ** 0.5
    return out


def target_tables(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(CFG.vocab_size, CFG.hidden_size, generator=gen)  # unit variance
    head = 2.0 * torch.randn(CFG.vocab_size, CFG.hidden_size, generator=gen) / 8.0  # logits ~2
    return embed, head


def drafter(weights=None, seed: int = 0) -> DFlash2Drafter:
    embed, head = target_tables()
    return DFlash2Drafter(CFG, weights or random_weights(CFG, seed), embed, head, "cpu",
                          torch.float32)


def with_context(model: DFlash2Drafter, starts: list[int], seed: int = 2):
    """A DraftKV with context K/V at positions [0, P0) of each request (random target states
    of RMS ~2) and shuffled block tables; returns (kv, block_table, states per request)."""
    gen = torch.Generator().manual_seed(seed)
    m = -(-(max(starts) + CFG.block_size) // KV_BLOCK) + 1
    table = torch.randperm(len(starts) * m, generator=gen).view(len(starts), m).int()
    kv = DraftKV(CFG, len(starts) * m, KV_BLOCK, "cpu", torch.float32)
    states = []
    for r, p0 in enumerate(starts):
        hidden = 2.0 * torch.randn(p0, 3 * CFG.hidden_size, generator=gen)
        pos = torch.arange(p0)
        k, v = model.context_kv(hidden, pos)
        kv.write(DraftKV.slots_of(table[r:r + 1], pos[None], KV_BLOCK)[0], k, v)
        states.append(hidden)
    return kv, table, states


# ---------------------------------------------------------------------------- checkpoints


def forbid_host_reads(monkeypatch) -> None:
    """Make every host read of a device value raise (a capturable draft step makes none);
    `monkeypatch.undo()` lifts it."""
    def sync(*args, **kwargs):
        raise AssertionError("draft read a device value on the host")
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                 "numpy"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    monkeypatch.setattr(torch, "nonzero", sync)
