"""The benchmark's model: the canonical Beam at full width cut to 4 layers (0: dense sliding,
1-2: MoE sliding, 3: MoE full), random weights made directly on the device in the engine's
repacked layout (no checkpoint, no engine dir: 40 GB of FP8 weights would not fit the bench
machine's disk), plus the byte and FLOP counts of the floors."""

from __future__ import annotations

import torch

from beam_trtllm.config import DENSE, FULL, SLIDING, SPARSE, BeamConfig, preset
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.plan import BuildOptions, kv_plan

E2M1_RMS = 2.93  # RMS of uniformly random E2M1 codes
FP8_SPREAD = 32.0  # random FP8 codes ~ N(0, 32^2): well inside E4M3's range
NVFP4_BYTES = 0.5 + 1 / 16


def bench_config(smoke: bool) -> BeamConfig:
    types = (SLIDING, SLIDING, SLIDING, FULL)
    mlps = (DENSE, SPARSE, SPARSE, SPARSE)
    if not smoke:
        return preset("beam-1.0-501b").replace(num_hidden_layers=4, layer_types=types,
                                               mlp_layer_types=mlps)
    return BeamConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                      moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, mlp_layer_types=mlps,
                      num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                      sliding_window=16, layer_types=types, max_position_embeddings=4096)


def _fp8(shape, fan_in, device, lead=()):
    """Random FP8 weight [*lead, *shape] (made one leading slice at a time) and its scale."""
    w = torch.empty(*lead, *shape, dtype=torch.float8_e4m3fn, device=device)
    flat = w.view(-1, *shape)
    for k in range(flat.shape[0]):
        flat[k] = (torch.randn(shape, device=device) * FP8_SPREAD).to(torch.float8_e4m3fn)
    return w, 1.0 / (FP8_SPREAD * fan_in**0.5)


def _nvfp4(shape, device, lead=()):
    n, k = shape
    w = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=device)
    scale = torch.ones(*lead, n, k // 16, device=device).to(torch.float8_e4m3fn)
    return w, scale, 1.0 / (E2M1_RMS * k**0.5)


def _linear(rows: int, k: int, fmt: str, device, parts: list[str]):
    if fmt == "bf16":
        w = torch.randn(rows, k, device=device, dtype=torch.bfloat16) / k**0.5
        return {"0.weight": w}, [{"format": fmt, "parts": parts, "rows": rows}]
    if fmt == "fp8":
        w, s = _fp8((rows, k), k, device)
        t = {"weight": w, "weight_scale": torch.full((rows,), s, device=device),
             "input_scale": torch.tensor(5.0 / 448, device=device)}
    else:
        w, sc, s2 = _nvfp4((rows, k), device)
        t = {"weight": w, "weight_scale": sc, "weight_scale_2": torch.tensor(s2, device=device)}
    return {f"0.{n}": v for n, v in t.items()}, [{"format": fmt, "parts": parts, "rows": rows}]


def _experts(cfg: BeamConfig, fmt: str, device) -> dict:
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    f32 = dict(device=device, dtype=torch.float32)
    if fmt == "bf16":
        bf16 = dict(device=device, dtype=torch.bfloat16)
        w13 = torch.empty(e, 2 * i, h, **bf16)
        w2 = torch.empty(e, h, i, **bf16)
        for k in range(e):  # one expert at a time: no 20 GB FP32 temporary
            w13[k] = torch.randn(2 * i, h, device=device) / h**0.5
            w2[k] = torch.randn(h, i, device=device) / i**0.5
        return {"w13": w13, "w2": w2}
    if fmt == "fp8":
        w13, s13 = _fp8((2 * i, h), h, device, (e,))
        w2, s2 = _fp8((h, i), i, device, (e,))
        return {"w13": w13, "w13_scale": torch.full((e, 2 * i), s13, **f32), "w2": w2,
                "w2_scale": torch.full((e, h), s2, **f32), "a13_scale": torch.tensor(5.0 / 448, **f32),
                "a2_scale": torch.tensor(2.0 / 448, **f32)}
    w13, sc13, s13 = _nvfp4((2 * i, h), device, (e,))
    w2, sc2, s2 = _nvfp4((h, i), device, (e,))
    return {"w13": w13, "w13_scale": sc13, "w13_scale_2": torch.full((e,), s13, **f32),
            "w2": w2, "w2_scale": sc2, "w2_scale_2": torch.full((e,), s2, **f32)}


def random_weights(cfg: BeamConfig, fmt: str, device) -> tuple[dict, dict]:
    """As the shipped recipes quantize: the attention projections (q, k, v and the output
    gate's gate_proj in one packed GEMM, o_proj) FP8 per tensor W8A8 for fp8 and nvfp4, dense
    MLP and experts in `fmt`; everything BF16 for bf16."""
    h, bf16 = cfg.hidden_size, dict(device=device, dtype=torch.bfloat16)
    w = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, **bf16),
         "model.norm.weight": torch.ones(h, **bf16),
         "lm_head.weight": torch.randn(cfg.vocab_size, h, **bf16) * (2.0 / h**0.5)}
    plan = {}
    for li in range(cfg.num_hidden_layers):
        p, lp = f"model.layers.{li}.", {}
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            w[f"{p}{n}.weight"] = torch.ones(h, **bf16)
        for n in ("q_norm", "k_norm"):
            w[f"{p}self_attn.{n}.weight"] = torch.ones(cfg.head_dim, **bf16)
        w[f"{p}self_attn.gate_bias"] = 0.5 * torch.randn(cfg.num_attention_heads, **bf16)
        attn_fmt = "bf16" if fmt == "bf16" else "fp8"
        parts = [f"self_attn.{n}_proj" for n in ("q", "k", "v", "gate")]
        tensors, segs = _linear(cfg.qkv_gate_size, h, attn_fmt, device, parts)
        w.update({f"{p}self_attn.qkvg_proj.{n}": t for n, t in tensors.items()})
        lp["self_attn.qkvg_proj"] = segs
        linears = [("self_attn.o_proj", h, cfg.q_size, ["self_attn.o_proj"], attn_fmt)]
        if not cfg.is_moe(li):
            linears += [("mlp.gate_up_proj", 2 * cfg.intermediate_size, h, ["mlp.gate_proj", "mlp.up_proj"], fmt),
                        ("mlp.down_proj", h, cfg.intermediate_size, ["mlp.down_proj"], fmt)]
        for name, rows, k, parts, f in linears:
            tensors, lp[name] = _linear(rows, k, f, device, parts)
            w.update({f"{p}{name}.{n}": t for n, t in tensors.items()})
        if cfg.is_moe(li):
            w[f"{p}mlp.gate.weight"] = torch.randn(cfg.num_experts, h, device=device) / h**0.5
            w[f"{p}mlp.gate.e_score_correction_bias"] = 0.05 * torch.randn(cfg.num_experts, device=device)
            w.update({f"{p}mlp.experts.{n}": t for n, t in _experts(cfg, fmt, device).items()})
            lp["experts"] = fmt
        plan[f"layer{li}"] = lp
    return w, plan


def make_engine(cfg: BeamConfig, fmt: str, device, max_num_tokens: int) -> Engine:
    """CUDA graphs are captured later by the bench itself (so a capture failure is reported
    without losing the other measurements)."""
    cuda = device.type == "cuda"
    opts = BuildOptions(target="sm90" if cuda else "cpu", max_batch=64 if cuda else 4,
                        max_seq_len=4096 if cuda else 256, max_num_tokens=max_num_tokens,
                        block_size=32 if cuda else 8, kv_memory_gib=1.0 if cuda else 0.01,
                        cuda_graph_batch_sizes=(1, 64) if cuda else ())
    weights, plan = random_weights(cfg, fmt, device)
    return Engine(cfg, weights, plan, opts, kv_plan(cfg, opts, "bf16"), device, use_cuda_graphs=False)


# ---------------------------------------------------------------------------- floors
def _linear_params(cfg: BeamConfig, i: int) -> tuple[int, int, int]:
    """Params per token of layer i: (attention GEMMs: q/k/v/gate and o_proj, MLP GEMMs in the
    format, FP32 router)."""
    h = cfg.hidden_size
    attn = cfg.qkv_gate_size * h + h * cfg.q_size
    if not cfg.is_moe(i):
        return attn, 3 * h * cfg.intermediate_size, 0
    return attn, cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size, cfg.num_experts * h


def decode_bytes(cfg: BeamConfig, fmt: str, i: int, context: int) -> float:
    """Bytes a batch-1 decode step of layer i must read: weights with their scales, the FP32
    router, the gate bias and the KV of its visible context (BF16 cache)."""
    attn, mlp, router = _linear_params(cfg, i)
    fp8 = 1.0 + 4.0 / cfg.hidden_size  # + one FP32 scale per output row
    attn_per = 2.0 if fmt == "bf16" else fp8
    per = {"bf16": 2.0, "fp8": fp8, "nvfp4": NVFP4_BYTES}[fmt]
    visible = context if cfg.is_full(i) else min(context, cfg.sliding_window)
    return (attn * attn_per + mlp * per + router * 4 + cfg.num_attention_heads * 2
            + visible * cfg.kv_size * 2 * 2)


def prefill_flops(cfg: BeamConfig, fmt: str, i: int, seqs: int, seq_len: int) -> dict:
    """FLOPs of one prefill of layer i by the unit that runs them: FP8 tensor cores (W8A8
    GEMMs), BF16 tensor cores (W4A16 NVFP4 GEMMs, BF16 GEMMs, attention), FP32 (router)."""
    tokens = seqs * seq_len
    attn_w, mlp, router = _linear_params(cfg, i)
    w = seq_len if cfg.is_full(i) else cfg.sliding_window
    keys = sum(min(p + 1, w) for p in range(seq_len)) * seqs
    attention = 4.0 * keys * cfg.num_attention_heads * cfg.head_dim
    fp8_attn = attn_w if fmt != "bf16" else 0
    fp8 = 2.0 * tokens * (fp8_attn + (mlp if fmt == "fp8" else 0))
    bf16 = 2.0 * tokens * ((attn_w - fp8_attn) + (mlp if fmt != "fp8" else 0)) + attention
    return {"fp8": fp8, "bf16": bf16, "fp32": 2.0 * tokens * router}
