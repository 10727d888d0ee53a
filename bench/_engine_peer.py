"""The peer of engine_bench's layers: transformers' BeamForCausalLM (the canonical model) in
BF16 with a static KV cache, its forward compiled by torch.compile in "reduce-overhead" mode
(Inductor kernels replayed as CUDA graphs) and the experts on torch's grouped GEMM, which is how
the model is served fast without a serving engine. Batch-1 decode at the bench's context.

It times whole-model decode steps of two models of engine_bench's width, the 4-layer bench model
and the same model with only its first (dense) layer, so that embedding, final norm and LM head
cancel: (step_4 - step_1) / 3 is the peer's mean time per MoE layer, to set beside the engine's
BF16 MoE layers (engine_bench --formats bf16) measured in the same run.
"""

from __future__ import annotations

import statistics
import time

import torch

from beam_trtllm.config import BeamConfig


@torch.no_grad()
def _random_model(cfg: BeamConfig, device, compile_mode: str | None, fullgraph: bool = True):
    from transformers import BeamForCausalLM

    from beam_trtllm.hf_model import hf_config

    hf = hf_config(cfg, "sdpa")
    hf._experts_implementation = "grouped_mm" if device.type == "cuda" else "eager"
    with torch.device("meta"):
        model = BeamForCausalLM(hf).to(torch.bfloat16)  # (on meta: no FP32 copy is made)
    model = model.to_empty(device=device)
    for name, t in model.state_dict().items():
        if ".mlp.gate." in name:
            t.copy_(torch.randn(t.shape, device=device) * 0.05)
        elif "norm" in name:
            t.fill_(1.0)
        else:  # one leading slice at a time: no FP32 temporary of a 20 GB expert tensor
            for piece in t.view(-1, t.shape[-1]).split(4096):
                piece.copy_(torch.randn(piece.shape, device=device) / t.shape[-1] ** 0.5)
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config).to(device)
    for layer in model.model.layers:  # transformers keeps the router in FP32
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.float()
    model.eval()
    if compile_mode is not None:
        # Inductor's cudagraph trees launched one of its fused kernels with a non-pointer
        # argument on the H200 (torch 2.11, 2026-12-01); its plain cudagraphify does not
        torch._inductor.config.triton.cudagraph_trees = False
        model.forward = torch.compile(model.forward, mode=compile_mode, fullgraph=fullgraph)
    return model


@torch.no_grad()
def _decode_step_ms(model, context: int, steps: int, device) -> float:
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=context + steps + 8)
    prompt = torch.randint(0, model.config.vocab_size - 8, (1, context), device=device)
    out = model(input_ids=prompt, cache=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[steps // 2:])  # the first steps compile and capture


def peer_layer_ms(cfg: BeamConfig, device, context: int, steps: int = 48,
                  compile_mode: str | None = "reduce-overhead") -> dict:
    """{"step_4", "step_1", "per_moe_layer"} ms of the compiled transformers model."""
    import gc

    out = {"fullgraph": True}
    for name, n in (("step_4", cfg.num_hidden_layers), ("step_1", 1)):
        sub = cfg.replace(num_hidden_layers=n, layer_types=cfg.layer_types[:n],
                          mlp_layer_types=cfg.mlp_layer_types[:n])
        mode = compile_mode if device.type == "cuda" else None
        model = _random_model(sub, device, mode, out["fullgraph"])
        try:
            out[name] = _decode_step_ms(model, context, steps, device)
        except Exception as exc:  # noqa: BLE001  (a graph break: compile it in pieces)
            print(f"peer: fullgraph compile failed ({type(exc).__name__}: {exc}); "
                  "compiling with graph breaks", flush=True)
            out["fullgraph"] = False
            torch._dynamo.reset()
            model = _random_model(sub, device, mode, False)
            out[name] = _decode_step_ms(model, context, steps, device)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    moe = len(cfg.moe_layers)
    out["per_moe_layer"] = (out["step_4"] - out["step_1"]) / moe
    out.update(context=context, compile_mode=compile_mode,
               experts="grouped_mm" if device.type == "cuda" else "eager",
               note=f"(step_4 - step_1) / {moe}: layer 0 is the dense one")
    return out
