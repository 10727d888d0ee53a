"""How the beam:: ops are registered (plugins/registry.py `beam_op`): straight on a
torch.library.Library, with the schema torch.library.custom_op would infer, the mutated
arguments marked for torch.compile's functionalization, a fake impl for every op, and
torch.compile giving the eager results, in-place cache writes included."""

from __future__ import annotations

import pytest
import torch

import plugins  # noqa: F401  (registers torch.ops.beam.*)
from plugins.registry import registered_ops

# ops that write into their cache arguments; every other op is functional
MUTATES = {"cache_write": ("k_cache", "v_cache"), "qk_prep": ("k_cache", "v_cache"),
           "spec_accept": ("anchors", "next_start", "packed"),
           "verify_rows": ("input_ids", "positions", "q_start", "slot_full", "slot_sliding")}


@pytest.mark.parametrize("name", sorted(registered_ops()))
def test_every_op_is_defined_with_its_mutations_and_a_fake_impl(name):
    schema = getattr(torch.ops.beam, name).default._schema
    written = tuple(a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write)
    assert written == MUTATES.get(name, ()), f"beam::{name} marks {written} as written"
    # register_fake installs the Meta kernel FakeTensor tracing (torch.compile) runs
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"beam::{name}", "Meta"), name


def _write_then_norm(k, v, k_cache, v_cache, slots, scale, w):
    torch.ops.beam.cache_write(k, v, k_cache, v_cache, slots, scale, scale)
    return torch.ops.beam.rmsnorm(k_cache.flatten(0, 1).flatten(1), w, 1e-6)


def test_compiled_graph_writes_the_cache_and_matches_eager():
    g = torch.Generator().manual_seed(7)
    hkv, d, slots = 2, 8, torch.tensor([5, -1, 0])
    k, v = (torch.randn(3, hkv, d, generator=g) for _ in range(2))
    w, scale = torch.rand(hkv * d, generator=g) + 0.5, torch.tensor(1.0)
    caches = [torch.zeros(2, 4, hkv, d) for _ in range(4)]
    eager = _write_then_norm(k, v, caches[0], caches[1], slots, scale, w)
    compiled = torch.compile(_write_then_norm, fullgraph=True, backend="aot_eager")
    got = compiled(k, v, caches[2], caches[3], slots, scale, w)
    assert torch.equal(got, eager)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert caches[2].flatten(0, 1)[5].abs().sum() > 0  # slot 5 written in place, -1 skipped
