"""What each rank of the parallel-engine tests runs (imported by name in the spawned ranks,
so it lives in a module of its own): every layout of one world size in one launch, each
engine loaded, run and dropped in turn."""

from __future__ import annotations

import gc

from beam_trtllm.engine.parallel.launch import generate, load_rank
from engine_helpers import all_logits, greedy


def run_layouts(rank: int, engine_dirs: list[str], prompts, n: int, scenario) -> list[dict]:
    out = []
    for engine_dir in engine_dirs:
        engine = load_rank(engine_dir)
        res = {"logits": _all_logits(engine, prompts[0], n)}  # first: on a cold cache
        res["tokens"] = {i: r["token_ids"] for i, r in generate(engine, prompts, greedy(n)).items()}
        res.update(drive_scenario(engine, scenario))
        engine.blocks.check()
        res.update(used_blocks=engine.blocks.num_used, free_rows=engine.kv.free_rows,
                   max_seqs=engine.kv.max_seqs, requests_left=len(engine.scheduler.running)
                   + len(engine.scheduler.waiting), num_blocks=engine.blocks.num_blocks,
                   kv_heads=engine.kv.full.shape[-2])
        out.append(res)
        del engine
        gc.collect()
    return out


def _all_logits(engine, prompt, n):
    """Logits of every row of every forward while `prompt` (request 0) generates n tokens, on
    rank 0 (None on the others)."""
    logits, _ = all_logits(engine, prompt, n, run=lambda e, p, params: generate(e, [p], params))
    return logits if engine.parallel.mapping.rank == 0 else None


def drive_scenario(engine, scenario) -> dict:
    """scenario: {"arrivals": {step: [(rid, prompt, max_tokens, owner)]}, "aborts": {step:
    [rid]}}. Requests arrive at their steps (on every rank under TP, on rank `owner` under
    attention DP), aborts land on the owner, and every rank steps until all are done."""
    m = engine.parallel.mapping
    here = {}
    results: dict[str, dict] = {}
    last = max([*scenario["arrivals"], *scenario["aborts"]])
    step = 0
    while True:
        for rid, prompt, max_tokens, owner in scenario["arrivals"].get(step, []):
            if not m.attention_dp or owner % m.world == m.rank:
                engine.add_request(rid, prompt, greedy(max_tokens))
                here[rid] = True
                results[rid] = {"tokens": [], "finish_reason": None}
        for rid in scenario["aborts"].get(step, []):
            if rid in here:
                engine.abort(rid)
        for o in engine.step():
            results[o.request_id]["tokens"] += o.new_token_ids
            if o.finished:
                results[o.request_id]["finish_reason"] = o.finish_reason
        step += 1
        if step > last and not engine.parallel.any_unfinished(engine):
            break
        assert step < 2000, "parallel engine did not finish"
    return {"scenario": results, "prefix_hits": engine.blocks.stats["hits"]}


def nccl_rank(rank: int, engine_dir: str, prompts, n: int) -> dict:
    """tests/test_parallel_nccl.py: this rank on its GPU, over NCCL."""
    engine = load_rank(engine_dir, "cuda")
    logits = _all_logits(engine, prompts[0], n)
    tokens = {i: r["token_ids"] for i, r in generate(engine, prompts, greedy(n)).items()}
    engine.blocks.check()
    return {"logits": None if logits is None else logits.cpu(), "tokens": tokens,
            "used_blocks": engine.blocks.num_used, "backend": engine.parallel.comm.backend}
