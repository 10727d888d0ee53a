"""Shared fixtures and the one tolerance table of the suite."""

from __future__ import annotations

import os

import pytest
import torch

# Every numeric comparison of a fast path against its reference (a plugin's ref_ op, or
# transformers' canonical Beam modules) takes its tolerance from here. Key: (what, dtype).
# Value: (atol, rtol). Each entry says why it is not tighter.
TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    # --- moe_* / linear_* kernels against their ref_ ops (plugins/) ------------------------
    # FP32: the same products summed in another order (MMA tiles vs BLAS), scales applied to
    # the sum instead of each operand: a few FP32 ULPs of outputs of magnitude ~4.
    ("moe", torch.float32): (2e-5, 1e-5),
    # BF16: gate, up, silu, h and y round to BF16 as in the reference, but the kernel sums in
    # another order, so a value near a rounding boundary lands one BF16 ULP away and that step
    # (2^-8 relative) carries into the down projection and the combine: outputs of magnitude
    # up to ~4 move by up to two ULPs there (2^-5 absolute).
    ("moe", torch.bfloat16): (3.2e-2, 1.6e-2),
    # FP8 activations (W8A8 / block): an FP32 reordering can move an element of h across an
    # FP8 rounding boundary; one E4M3 step is 1/16..1/8 of that element (|h| <~ 3), and the
    # down projection (weights ~ 1/sqrt(I)) spreads ~0.4 of it over every output.
    ("moe-fp8", torch.float32): (2e-2, 1e-3),
    # ... and in BF16 the reference also multiplies BF16-rounded dequantized weights and
    # activations (2^-9 relative each) where the kernel multiplies exact FP8 codes and scales
    # the FP32 sum, on top of the BF16 ULP steps above.
    ("moe-fp8", torch.bfloat16): (6.4e-2, 2e-2),
    # GPU: the FP8 MMA's reduced precision (entry "linear-fp8-mma") moves gate / up by ~1e-4
    # of their sums, which flips FP8 codes of h that summation order alone leaves alone; each
    # flip moves every output by up to ~0.04 (above), and on the H200 two flips met in one
    # output (max 0.045 FP32, 0.072 BF16 of 240-3400 outputs, 2026-11-29).
    ("moe-fp8-mma", torch.float32): (1e-1, 2e-2),
    ("moe-fp8-mma", torch.bfloat16): (1e-1, 2e-2),
    # A BF16 BeamMoE on decoded FP8 / NVFP4 weights rounds them to BF16 (2^-9 relative each);
    # the quantized references multiply the exact FP32 decoded values. That moves gate/up by
    # ~2^-9 of their RMS, flips FP8 codes of the activations near rounding boundaries, and
    # carries through two GEMMs: outputs of magnitude up to ~4 differ by up to ~2^-4 (which
    # also covers transformers' BF16 combine, the next entry's 2^-6).
    ("moe-ref-bf16-weights", torch.bfloat16): (6.4e-2, 2e-2),
    # transformers' eager BeamExperts rounds each weighted expert output and each of the k
    # partial sums to BF16 (2^-9 relative each, on sums up to ~1.6) and rounds again after the
    # routed scale; the spec pins an FP32 sum rounded once. k = 4 experts, outputs up to ~4:
    # a few BF16 steps of 2^-6 (measured 1.6e-2).
    ("moe-transformers-eager", torch.bfloat16): (3.2e-2, 1.6e-2),
    # linear_*: one GEMM on exactly decoded values, output rounded once. FP32: summation
    # order (few ULPs). BF16: a sum near a rounding boundary lands one ULP (2^-7 relative at
    # most) away.
    ("linear", torch.float32): (1e-5, 1e-5),
    ("linear", torch.bfloat16): (1e-5, 8e-3),
    # GPU only (bench/kernels_moe.py): Hopper's FP8 MMA adds the products of each 128-deep
    # step with ~14 bits of precision (DeepSeek-V3 report, 3.3.2; the kernels promote to FP32
    # every 128, as cuBLAS does), so outputs of RMS ~1 move by up to ~2^-7 beyond the ULP.
    ("linear-fp8-mma", torch.bfloat16): (1.6e-2, 1.6e-2),
    # ... and with FP32 outputs: measured on the H200 (2026-11-29, commit 4c4de9d, partial
    # sums promoted every 128 products; docs/benchmarks-history.md) at most 9.2e-4 absolute
    # on outputs of RMS ~1 and 1.0e-4 of the sum of |products|, per-tensor and 128x128-block
    # alike; 4x margin.
    ("linear-fp8-mma", torch.float32): (4e-3, 4e-3),
    # FP32 reference against itself computed another way (cache vs recompute, batched vs
    # single): only summation order differs, so a few ULPs of values of magnitude ~10.
    ("fp32-reorder", torch.float32): (1e-4, 1e-4),
    # --- attention-side kernels (plugins/) against their ref_ ops -----------------------------
    # BF16 outputs of FP32 math: the kernel sums in another order, so a result that lies near
    # a rounding boundary can land one BF16 ULP (2^-7 relative at most) away.
    ("bf16-1ulp", torch.bfloat16): (1e-5, 8e-3),
    # add_rmsnorm's x normalises the rounded h', which may itself be one ULP off: two ULPs.
    ("bf16-2ulp", torch.bfloat16): (1e-5, 1.6e-2),
    # qk_prep: a normed q/k element one ULP off (values up to ~8, ULP 2^-5) moves the RoPE'd
    # outputs that mix it by up to that ULP in absolute terms, even where they are near zero.
    ("qk-prep", torch.bfloat16): (3.2e-2, 8e-3),
    ("qk-prep", torch.float32): (1e-5, 1e-5),  # FP32: different sum order and exp, a few ULPs
    # cos / sin / exp / log1p of the same FP32 argument by another math library (libdevice on
    # the GPU, NumPy's float32 in the interpreter, torch's on the CPU): a few FP32 ULPs of
    # values of magnitude <= 1.4 (RoPE's cos / sin, the SSMax scale).
    ("fp32-math", torch.float32): (1e-6, 1e-6),
    # The kernel rounds the softmax probabilities to BF16 for the P·V tensor-core product
    # (2^-9 relative per term) and rounds the output to BF16; outputs are O(1). (With an FP8
    # cache's FP16 operand forms, plugins/_attention_tiles.py, P goes to FP16 instead: 2^-12
    # a term, finer; the codes' FP16 values are exact, and q's BF16 -> FP16 is but below 2^-14,
    # by 2^-25 at most.)
    ("attention", torch.bfloat16): (1e-2, 1e-2),
    # FP32 attention: IEEE FP32 dots (no TF32), online softmax: summation order only.
    ("attention", torch.float32): (1e-5, 1e-4),
    # Router weights: FP32 sigmoid (exp differs by ULPs) and the 8-term sum in another order.
    ("router-weights", torch.float32): (1e-6, 1e-5),
    # Our reference router's logits are FP64 dots rounded once, transformers' an FP32 GEMM
    # (its summation order by the CPU's kernel): logits a few ULPs apart, and an ULP of a
    # logit of -46 (the renormalisation case) is 4e-6, relative 4e-6 through the sigmoid.
    ("router-logits-fp32-gemm", torch.float32): (2e-6, 2e-5),
    # An FP32 MoE against transformers' on the same decoded weights and rows: the CPU's GEMM
    # kernel may sum in another order (oneDNN on AMX machines, by layout and row count):
    # a few ULPs of outputs of magnitude ~1 (1.9e-6 measured on fp8_block).
    ("moe-fp32-gemm-order", torch.float32): (1e-5, 1e-5),
    # --- engine (beam_trtllm/engine) ----------------------------------------------------------
    # FP32 engine against transformers' FP32 BeamForCausalLM, as log-probabilities: the same
    # math in FP32 summed in another order (tiled attention, packed GEMMs): a few ULPs of
    # logits of magnitude ~10 (measured 1.5e-6 on the tiny Beam).
    ("engine-vs-model", torch.float32): (2e-5, 0.0),
    # ... and on a quantized checkpoint: the same FP8 activation quantizers on both sides, but
    # an FP32 reordering can move an activation across an FP8 rounding boundary (one E4M3 step,
    # 1/16..1/8 of it), which moves a logit by up to ~1e-3 (none here: measured 1.8e-6).
    ("quantized-engine-vs-model", torch.float32): (2e-3, 0.0),
    # ModelOpt-exported NVFP4 (W4A16: NVFP4 weights, no activation quantizer) in an FP32
    # engine against transformers' FP32 model on the same decoded weights: only summation
    # order differs (packed q/k/v GEMM, tiled attention, the experts' FP32 combine), so a few
    # ULPs of logits of magnitude ~10, as "engine-vs-model" (no FP8 code can flip here).
    ("nvfp4-engine-vs-dequant", torch.float32): (2e-5, 0.0),
    # A tensor/expert-parallel FP32 engine against the single-rank one, as logits: a split
    # GEMM (o_proj and down_proj by heads / columns, each expert's down projection by its
    # moe_tp slice) is summed over the ranks in FP32 in another order and rounded once, and
    # attention-DP ranks batch other rows: a few FP32 ULPs of logits of magnitude ~10.
    ("parallel-vs-single", torch.float32): (2e-5, 0.0),
    # ... a BF16 engine on a GPU (tests/test_parallel_nccl.py): the experts run one (token,
    # expert) pair a row, whose launch shapes (pairs bucket, direct vs sorted) may sum in
    # another order, so an expert output can land one BF16 ULP away and the tiny's random
    # layers amplify it; the same kind of one-ULP change (TP2's extra rounding of each rank's
    # expert partial) moved the tiny's BF16 logits by 0.078 on the CPU: 3x that.
    ("parallel-vs-single", torch.bfloat16): (0.25, 0.0),
    # Empirical token frequencies of 4000 seeded draws against the exact probabilities: the
    # binomial standard deviation is at most 0.5 / sqrt(4000) = 0.008; 0.03 is ~4 sigma.
    ("sampling-frequency", torch.float32): (0.03, 0.0),
    # The DFlash2 drafter's BF16 path (beam_trtllm/draft/layers.py) against its FP32 path, final
    # normed states: ~15 BF16 roundings a layer (2^-9 relative each) compound over 2 layers and
    # a BF16 attention; measured max 0.088 (mean 0.009) over 8 seeds on |h| <= 5.2.
    ("draft-bf16-vs-fp32", torch.bfloat16): (0.12, 0.02),
    # The FP8 drafter (beam_trtllm/draft/quant.py) against the BF16 one, both BF16, on the
    # trained tiny's own states: its 19 GEMMs round weights and each token's inputs to E4M3
    # (up to 2^-4 relative each), and the 2 layers' residuals and convs carry it on; measured
    # max 0.97 on |h| <= 9.5 (7-10% of the states' norm), in 24 blocks of answers as of prompts.
    ("draft-fp8-vs-bf16", torch.bfloat16): (1.0, 0.1),
    # ... and the selector's scores S (the capped logits plus the pairwise term) over the BF16
    # drafter's candidates, from those states: measured max 1.17 on |S| <= 35.
    ("draft-fp8-scores", torch.float32): (1.5, 0.05),
    # The acceptance estimator's online fit (beam_trtllm/spec/adaptive.py) against the logistic
    # model its synthetic data came from: the last refit's round is 100 steps x 256 requests, so
    # the estimates carry that round's sampling error; over 12 seeds the slope's spread was
    # 0.015 and the last draft position's intercept (fewest observations) 0.05: ~4 sigma each.
    ("logistic-refit-slope", torch.float64): (0.06, 0.0),
    ("logistic-refit-intercept", torch.float64): (0.2, 0.0),
    # The estimator's host survival scores (numpy) against predict's (torch): each p rounds to
    # FP32 from an FP64 sigmoid computed two ways (a 1-ULP flip, 2^-24, at most), and the
    # running product over <= 7 positions carries <= 7 such flips.
    ("survival-host", torch.float64): (0.0, 1e-6),
}


def tol(what: str, dtype: torch.dtype) -> dict:
    atol, rtol = TOLERANCES[(what, dtype)]
    return {"atol": atol, "rtol": rtol}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A freshly made tiny Beam checkpoint (seed 0), shared read-only by the whole session."""
    from beam_trtllm.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("tiny") / "tiny-beam", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    """transformers' BeamForCausalLM (eager attention, FP32) of the tiny checkpoint."""
    from beam_trtllm.hf_model import load_model

    return load_model(tiny_dir, torch.float32)


@pytest.fixture(scope="session")
def hf_checkpoints(tiny_dir, tmp_path_factory):
    """One tiny canonical model as transformers saves it: {"fp32", "bf16", "fp16", "fused"} dirs
    (tests/hf_checkpoints.py), shared read-only by the whole session."""
    from hf_checkpoints import write_hf_checkpoints

    return write_hf_checkpoints(tmp_path_factory.mktemp("hf"), tiny_dir)


@pytest.fixture(scope="session")
def hf_tiny_fp32_dir(hf_checkpoints):
    return hf_checkpoints["fp32"]


@pytest.fixture(scope="session")
def hf_tiny_bf16_dir(hf_checkpoints):
    return hf_checkpoints["bf16"]


@pytest.fixture(scope="session")
def modelopt():
    """ModelOpt 0.47 imported once per session (~7 s on the 2-core box); its quantization and
    export modules are the oracle of the converter's tests."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "transformers X is not tested with modelopt"
        import modelopt.torch.export  # noqa: F401
        import modelopt.torch.quantization as mtq
    return mtq


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked `kernel` run Triton kernels: on a GPU, or on the CPU when TRITON_INTERPRET=1
    was set before Triton was imported (`make test` runs them as a second, interpreted pytest
    invocation). Anywhere else they are deselected rather than run against the wrong backend."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    kept = [item for item in items if item.get_closest_marker("kernel") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


def pytest_configure(config):
    # Two cores on CI: keep torch from oversubscribing them when tests run in parallel.
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
