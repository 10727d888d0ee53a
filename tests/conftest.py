"""Shared fixtures and the one tolerance table of the suite."""

from __future__ import annotations

import os

import pytest
import torch

# Every numeric comparison of a fast path against beam_trtllm/reference.py takes its tolerance
# from here. Key: (what, dtype). Value: (atol, rtol). Each entry says why it is not tighter.
TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    # FP32 reference against itself computed another way (cache vs recompute, batched vs
    # single): only summation order differs, so a few ULPs of values of magnitude ~10.
    ("fp32-reorder", torch.float32): (1e-4, 1e-4),
    # Engine (packed GEMMs, flattened ragged batch, beam:: ops) against the BF16 reference
    # model, as log-probabilities: the same BF16 roundings in the same places, but GEMMs of
    # other shapes may sum in another order, and one BF16 ulp of a logit of magnitude ~8 is
    # 0.03. On the CPU the two agree bit for bit today; the margin is for that reordering.
    ("engine-vs-reference", torch.bfloat16): (0.05, 0.0),
    # Empirical token frequencies of 4000 seeded draws against the exact probabilities: the
    # binomial standard deviation is at most 0.5 / sqrt(4000) = 0.008; 0.03 is ~4 sigma.
    ("sampling-frequency", torch.float32): (0.03, 0.0),
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
    from beam_trtllm.reference import BeamForCausalLM

    return BeamForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    # Two cores on CI: keep torch from oversubscribing them when tests run in parallel.
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
