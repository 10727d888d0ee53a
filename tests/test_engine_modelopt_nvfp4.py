"""Engines built from NVFP4 checkpoints exported by ModelOpt 0.47 itself (`mtq.quantize` +
`export_hf_checkpoint` on transformers' BeamForCausalLM, tests/modelopt_reference.py), with the
canonical attention output gate `self_attn.gate_proj` quantized like q_proj or left in BF16
(ModelOpt then fuses only q/k/v), against transformers' model on the dequantized weights
(NVFP4 runs W4A16: no activation quantizer); AWQ / INT4 ModelOpt schemes refused by name."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from engine_helpers import TINY_OPTS, one_thread, prompts  # noqa: F401

from beam_trtllm.config import BeamConfig
from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.plan import BuildOptions
from beam_trtllm.engine.types import EngineError, SamplingParams
from beam_trtllm.hf_model import logits, model_from_state_dict
from conftest import tol

pytestmark = pytest.mark.usefixtures("one_thread")


def export_nvfp4(ckpt_dir, out_dir, gate_bf16: bool, batches):
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt_reference import load_bf16

    model = load_bf16(ckpt_dir)
    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    if gate_bf16:
        cfg["quant_cfg"].append({"quantizer_name": "*self_attn.gate_proj*", "enable": False})

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                m(input_ids=ids, use_cache=False)

    mtq.quantize(model, cfg, forward_loop)
    export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=str(out_dir))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the exporter writes weights only
        shutil.copyfile(ckpt_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="module")
def exported(tiny_dir, tmp_path_factory):
    from convert.calib_data import load_calib_tokens

    base = tmp_path_factory.mktemp("modelopt")
    batches = [load_calib_tokens(tiny_dir, None, 2, 32).ids]
    return {gate: export_nvfp4(tiny_dir, base / gate, gate == "gate-bf16", batches)
            for gate in ("gate-nvfp4", "gate-bf16")}


def _model_on_dequant(ckpt):
    from beam_trtllm.checkpoint import expected_tensors
    from convert.dequantize import QuantizedCheckpoint

    q = QuantizedCheckpoint(ckpt)
    cfg = BeamConfig.from_hf(ckpt)
    state = {n: q.dequant_tensor(n).float() for n in expected_tensors(cfg)}
    q.close()
    return model_from_state_dict(cfg, state, torch.float32)


@pytest.mark.parametrize("gate, segments", [("gate-nvfp4", ["nvfp4"]),
                                            ("gate-bf16", ["nvfp4", "bf16"])])
def test_modelopt_export_builds_and_matches_the_dequantized_model(exported, tmp_path, gate,
                                                                  segments):
    ckpt = exported[gate]
    hfq = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert hfq["quant_algo"] == "NVFP4"  # ModelOpt's own export, not ours
    engine_dir = build_engine(ckpt, tmp_path / "engine", BuildOptions(**TINY_OPTS,
                                                                      dtype="float32"))
    spec = json.loads((engine_dir / "engine.json").read_text())
    assert spec["quantization"]["scheme"] == "ModelOpt NVFP4"
    layer0 = spec["quantization"]["layers"]["layer0"]
    assert [s["format"] for s in layer0["self_attn.qkvg_proj"]] == segments
    assert spec["quantization"]["layers"]["layer1"]["experts"] == "nvfp4"
    model = _model_on_dequant(ckpt)
    engine = Engine.from_dir(engine_dir, device="cpu")
    for p in prompts(47, [6, 29]):
        res = engine.generate([p], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0))[0]
        ids = res["token_ids"]
        lp = logits(model, torch.tensor([p + ids]))[0, len(p) - 1:-1].log_softmax(-1)
        assert ids == lp.argmax(-1).tolist()  # greedy: the model's own choice at every step
        want = lp.gather(1, torch.tensor(ids)[:, None])[:, 0]
        got = torch.tensor([x.logprob for x in res["logprobs"]])
        torch.testing.assert_close(got, want, **tol("nvfp4-engine-vs-dequant", torch.float32))


@pytest.mark.parametrize("algo", ["NVFP4_AWQ", "W4A16_AWQ", "W4A8_AWQ", "INT8_SQ"])
def test_awq_and_int_modelopt_schemes_are_refused_by_name(exported, tmp_path, algo):
    ckpt = shutil.copytree(exported["gate-nvfp4"], tmp_path / "ckpt")
    for name, key in (("hf_quant_config.json", "quantization"), ("config.json",
                                                                  "quantization_config")):
        data = json.loads((ckpt / name).read_text())
        data[key]["quant_algo"] = algo
        (ckpt / name).write_text(json.dumps(data))
    with pytest.raises(EngineError, match=f"ModelOpt quant_algo '{algo}' is not a scheme"):
        build_engine(ckpt, tmp_path / "engine", BuildOptions(**TINY_OPTS))
