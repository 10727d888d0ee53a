"""DFlash2 drafter checkpoints (beam_trtllm/draft/): the layouts vLLM 0.33 / SGLang 0.5.23 load,
and refusals naming the field or tensor (shared/research/dflash2.md §1-§2)."""

from __future__ import annotations

import json

import pytest
import torch
from draft_helpers import CFG, TARGET, random_weights, spec_names, target_tables
from safetensors.torch import save_file

from beam_trtllm.draft import DFlash2Drafter, DraftConfig, DraftError, load_draft_weights, save_draft

def write_vllm_dir(path, weights, prefix="", renames=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CFG.to_dict()))
    renames = renames or {}
    save_file({prefix + renames.get(n, n): t.contiguous() for n, t in weights.items()},
              str(path / "model.safetensors"))
    return path


def test_vllm_and_sglang_layouts_load(tmp_path):
    from transformers import AutoConfig

    weights = random_weights(CFG, 0)
    assert sorted(weights) == sorted(spec_names(CFG.num_hidden_layers))
    plain = write_vllm_dir(tmp_path / "vllm", weights)
    sglang = write_vllm_dir(tmp_path / "sglang", weights, "model.", {
        "fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"})
    for path in (plain, sglang):
        got = load_draft_weights(path, DraftConfig.from_dir(path))
        assert got.keys() == weights.keys()
        assert all(torch.equal(got[n], weights[n]) for n in weights)
    embed, head = target_tables()
    model = DFlash2Drafter.from_dir(sglang, TARGET, embed, head, "cpu", torch.float32)
    assert model.cfg == CFG and model.cfg.num_draft_tokens == 5
    hf = AutoConfig.from_pretrained(plain)  # what vLLM's get_config reads
    assert hf.architectures == ["DFlash2BeamDraftModel"] and hf.is_causal is False
    assert hf.layer_types == ["sliding_attention"] * 2
    assert hf.dflash_config["target_layer_ids"] == [1, 3, 5]
    assert hf.dflash_config["conv_group_size"] == 8 and hf.dflash_config["selector_top_k"] == 7
    # a copy of the target's embed_tokens is dropped (vLLM replaces it); an lm_head is not ours
    save_file({**weights, "embed_tokens.weight": embed}, str(plain / "model.safetensors"))
    assert load_draft_weights(plain, CFG).keys() == weights.keys()
    save_file({**weights, "lm_head.weight": head}, str(plain / "model.safetensors"))
    with pytest.raises(DraftError, match="unexpected tensor lm_head.weight"):
        load_draft_weights(plain, CFG)


def test_save_round_trips_in_bf16(tmp_path):
    weights = random_weights(CFG, 0)
    sha = save_draft(tmp_path / "d", CFG, weights)
    assert len(sha) == 64 and DraftConfig.from_dir(tmp_path / "d") == CFG
    got = load_draft_weights(tmp_path / "d", CFG)
    assert all(got[n].dtype == torch.bfloat16 for n in got)
    assert torch.equal(got["fc.weight"], weights["fc.weight"].bfloat16())


@pytest.mark.parametrize("edit, field", [
    (lambda w: w.pop("layers.1.mlp.up_proj.weight"), "missing tensor layers.1.mlp.up_proj.weight"),
    (lambda w: w.update({"layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
     "unexpected tensor layers.0.self_attn.q_proj.bias"),
    (lambda w: w.update({"layers.0.mlp_conv.base_kernel": torch.zeros(2, 4, 64)}),
     r"tensor layers.0.mlp_conv.base_kernel has shape \[2, 4, 64\], the config implies "
     r"\[2, 3, 64\]"),
    (lambda w: w.update({"candidate_selector.successor_codebook": torch.zeros(512, 11)}),
     "tensor candidate_selector.successor_codebook has shape"),
])
def test_a_bad_tensor_is_refused_by_name(tmp_path, edit, field):
    weights = random_weights(CFG, 0)
    edit(weights)
    path = write_vllm_dir(tmp_path / "d", weights)
    with pytest.raises(DraftError, match=field):
        load_draft_weights(path, CFG)


def _cfg_with(**edits):
    d = CFG.to_dict()
    for key, value in edits.items():
        where = d
        *head, last = key.split(".")
        for k in head:
            where = where[k]
        if value is KeyError:
            del where[last]
        else:
            where[last] = value
    return d


@pytest.mark.parametrize("edits, field", [
    ({"dflash_config.target_layer_ids": [3, 1, 5]}, "target_layer_ids .* sorted"),
    ({"dflash_config.target_layer_ids": [1, 3, 3]}, "target_layer_ids .* duplicates"),
    ({"dflash_config.target_layer_ids": [1, 3, -1]}, "target_layer_ids must be non-negative"),
    ({"dflash_config.target_layer_ids": [1, 6]}, "target_layer_ids .* out of range"),
    ({"dflash_config.mask_token_id": 512}, "mask_token_id 512 is not a token id"),
    ({"dflash_config.mask_token_id": KeyError, "mask_token_id": KeyError}, "no mask_token_id"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"is_causal": True}, "is_causal must be false"),
    ({"is_causal": KeyError}, "is_causal must be false"),
    ({"dflash_config.conv_group_size": 7}, "conv_group_size 7 must divide hidden_size 64"),
    ({"dflash_config.sample_from_anchor": True}, "sample_from_anchor"),
    ({"architectures": ["DFlashDraftModel"]}, "architectures"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
    ({"hidden_size": KeyError}, "missing field hidden_size"),
] + [({f"dflash_config.{k}": KeyError}, f"dflash_config lacks {k} .vLLM requires")
     for k in ("target_layer_ids", "conv_kernel_size", "conv_group_size", "selector_rank",
               "selector_top_k", "final_logit_softcapping")])
def test_a_bad_config_is_refused_naming_the_field(edits, field):
    with pytest.raises(DraftError, match=field) as err:
        DraftConfig.from_dict(_cfg_with(**edits), "d/config.json")
    assert str(err.value).startswith("d/config.json: ")


def test_config_defaults_and_aliases():
    d = _cfg_with(**{"dflash_config.block_size": KeyError, "block_size": KeyError,
                     "dflash_config.mask_token_id": KeyError, "mask_token_id": KeyError})
    d["pard_token"] = 7  # one of vLLM's aliases
    c = DraftConfig.from_dict(d)
    assert c.block_size == 16 and c.mask_token_id == 7  # SGLang's default block
    d["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}
    assert DraftConfig.from_dict(d).rope_theta == 5e5


@pytest.mark.parametrize("change, field", [
    ({"vocab_size": 1024}, "vocab_size 512 != the target's 1024"),
    ({"hidden_size": 128, "head_dim": 32}, "hidden_size 64 != the target's 128"),
    ({"num_hidden_layers": 4, "layer_types": ("sliding_attention",) * 3 + ("full_attention",),
      "mlp_layer_types": ("dense",) * 3 + ("sparse",)}, "target_layer_ids"),
])
def test_a_drafter_that_does_not_fit_the_target_is_refused(tmp_path, change, field):
    target = TARGET.replace(**change)
    path = write_vllm_dir(tmp_path / "d", random_weights(CFG, 0))
    embed, head = target_tables()
    with pytest.raises(DraftError, match=field) as err:
        DFlash2Drafter.from_dir(path, target, embed, head, "cpu", torch.float32)
    assert str(path) in str(err.value)


# ---------------------------------------------------------------------------- the forward
