"""A request's tokens do not depend on cache state or on its batch: the same prompt gives the
same greedy tokens cold, as a full prefix-cache hit, as a partial hit, and beside other
requests that arrive and leave around it, for BF16 and FP8 KV caches and BF16, FP8 and NVFP4
weights (BF16 activations, as served).

What makes it hold (docs/ENGINE.md "Cache invariance"): a prefill takes its own chunk's keys as
the cache will return them (with an FP8 cache, their FP8 round trip, beam::attention), cached
positions' K/V are read back rather than recomputed (full layers) or recomputed from early
enough that they are exact (sliding layers: the restore span), and every op computes a token's
row independently of the other rows of its step."""

from __future__ import annotations

import pytest
from engine_helpers import TINY_OPTS, drive, greedy, one_thread, prompts  # noqa: F401

from beam_trtllm.engine.build import build_engine
from beam_trtllm.engine.engine import Engine
from beam_trtllm.engine.plan import BuildOptions

pytestmark = pytest.mark.usefixtures("one_thread")

KV_ONLY = "name: kv-only\ndescription: BF16 weights, FP8 KV scales\nrules:\n" \
          "  - {match: \"*\", format: none}\n"
WEIGHTS = ("bf16", "fp8", "nvfp4")
KV = ("bf16", "fp8")
N = 10  # generated tokens


@pytest.fixture(scope="module")
def checkpoints(tiny_dir, tmp_path_factory):
    """weights -> a checkpoint with FP8 KV scales (BF16 weights: a recipe that quantizes
    nothing but calibrates the KV scales)."""
    from convert import ConvertOptions, convert

    base = tmp_path_factory.mktemp("invariance")
    (base / "kv-only.yaml").write_text(KV_ONLY)
    recipes = {"bf16": str(base / "kv-only.yaml"), "fp8": "fp8", "nvfp4": "nvfp4"}
    return {w: convert(tiny_dir, base / f"tiny-{w}", ConvertOptions(
        recipe, kv_cache="fp8", calib_samples=2, calib_seq_len=48, workers=1))
        for w, recipe in recipes.items()}


def _engine(ckpt, tmp_path, kv: str) -> Engine:
    opts = BuildOptions(**{**TINY_OPTS, "kv_dtype": kv})
    return Engine.from_dir(build_engine(ckpt, tmp_path / f"engine-{kv}", opts), device="cpu")


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_same_tokens_whatever_the_cache_and_the_batch(checkpoints, tmp_path, weights, kv):
    target, other, side = prompts(31, [45, 30, 23])
    cold = _engine(checkpoints[weights], tmp_path / "cold", kv)
    want = drive(cold, {0: [("p", target, greedy(N))]})["p"]["tokens"]
    assert cold.blocks.stats["hits"] == 0

    engine = _engine(checkpoints[weights], tmp_path / "warm", kv)
    # a partial hit: an earlier request shared the first 20 tokens (5 blocks of 4)
    drive(engine, {0: [("a", target[:20] + other, greedy(3))]})
    hits = engine.blocks.stats["hits"]
    assert drive(engine, {0: [("p1", target, greedy(N))]})["p1"]["tokens"] == want, "partial hit"
    assert engine.blocks.stats["hits"] - hits == 5
    # a full hit: every full block of the prompt is cached now
    hits = engine.blocks.stats["hits"]
    assert drive(engine, {0: [("p2", target, greedy(N))]})["p2"]["tokens"] == want, "full hit"
    assert engine.blocks.stats["hits"] - hits == (len(target) - 1) // 4
    # beside other requests: a prefill chunk and decodes share its steps, others join and leave
    fresh = _engine(checkpoints[weights], tmp_path / "batched", kv)
    results = drive(fresh, {0: [("x", other, greedy(12)), ("p", target, greedy(N))],
                            2: [("y", side, greedy(4))], 5: [("z", other[:7], greedy(9))]})
    assert results["p"]["tokens"] == want, "beside other requests"
