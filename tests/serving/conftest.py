"""Fixtures of the serving tests: one tiny engine dir, graphs launched once per module.

Every graph runs the real Dynamo frontend and real workers on 127.0.0.1 (file discovery in
the test's own folder). After every test, `kv_all_free` counts the KV blocks, pins and
reservations of every live worker from its status file and fails the test if any is held.
"""

import json
from dataclasses import replace

import pytest

NUM_BLOCKS = 64  # small on purpose: a few long prompts evict a prefix (the offload test)


@pytest.fixture(scope="session")
def engine_dir(tiny_dir, tmp_path_factory):
    from beam_trtllm.config import BeamConfig
    from beam_trtllm.engine.build import build_engine
    from beam_trtllm.engine.plan import GIB, BuildOptions, kv_plan

    cfg = BeamConfig.from_hf(tiny_dir)
    base = BuildOptions(max_batch=16, max_seq_len=1024, max_num_tokens=512, block_size=16)
    plan = kv_plan(cfg, base, "bf16")
    gib = (NUM_BLOCKS * plan.bytes_per_block + plan.ring_bytes + 1) / GIB
    opts = replace(base, kv_memory_gib=gib)
    out = build_engine(tiny_dir, tmp_path_factory.mktemp("engine") / "engine", opts)
    assert json.loads((out / "engine.json").read_text())["kv_plan"]["num_blocks"] == NUM_BLOCKS
    return out


@pytest.fixture(scope="session")
def reference(engine_dir):
    """Greedy outputs of the same engine dir run in-process, in one batch for the session:
    the reference for 'identical greedy output' through Dynamo."""
    from beam_trtllm.engine.engine import Engine
    from beam_trtllm.engine.types import SamplingParams
    from beam_trtllm.tokenizer import TextTokenizer
    from helpers.serving import REF_TOKENS, reference_prompts

    engine = Engine.from_dir(engine_dir, device="cpu")
    prompts = reference_prompts(TextTokenizer(engine_dir))
    outs = engine.generate(list(prompts.values()), SamplingParams(max_tokens=REF_TOKENS))
    return {key: (o["token_ids"], o["finish_reason"]) for key, o in zip(prompts, outs)}
