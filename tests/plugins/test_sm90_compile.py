"""The attention-side kernels compile for the H200 (sm_90) at Beam-1.0 shapes, without
spilling registers, with their K/V loads software-pipelined (cp.async) and the prefill's
matrix products on Hopper's warpgroup MMA. No GPU needed: see sm90.py."""

from __future__ import annotations

import pytest
import torch

import plugins  # noqa: F401
from beam_trtllm.config import PRESETS
from kernel_cases import Seq, attention_case
from plugins.add_rmsnorm import _launch_add_rmsnorm
from plugins.attention import _launch_attention
from plugins.cache_write import _launch_cache_write
from plugins.group_router import _launch_group_router
from plugins.qk_prep import _launch_qk_prep
from sm90 import compile_instead_of_launch, resource_usage, spill_bytes

BEAM = PRESETS["beam-1.0-501b"]
HQ, HKV, D, H = BEAM.num_attention_heads, BEAM.num_key_value_heads, BEAM.head_dim, BEAM.hidden_size
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _attention(kv_dtype, new):
    case = attention_case([Seq(300, new), Seq(70, new, hist=3)], HQ, HKV, D, 0, 64, BF16, kv_dtype)
    _launch_attention(**case)


def _qk_prep(kv_dtype, full):
    t, one = 3, torch.ones(())
    cache = torch.zeros(2, 64, HKV, D, dtype=kv_dtype)
    _launch_qk_prep(torch.randn(t, HQ * D + 2 * HKV * D + HQ, dtype=BF16), torch.arange(t),
                    torch.ones(D, dtype=BF16), torch.ones(D, dtype=BF16), cache, cache.clone(),
                    torch.arange(t), one, one, full, 1e-6, 1e4, 2048.0, 0.1)


def _misc():
    x = torch.randn(2, H, dtype=BF16)
    w = torch.ones(H, dtype=BF16)
    _launch_add_rmsnorm(x, x, w, w, 0.9, 0.4, 1e-6)
    cache = torch.zeros(2, 64, HKV, D, dtype=FP8)
    k = torch.randn(3, HKV, D, dtype=BF16)
    _launch_cache_write(k, k, cache, cache.clone(), torch.arange(3), torch.ones(()), torch.ones(()))
    router = (torch.randn(256, H), torch.zeros(256), 8, 4, 8, 2.5, True)
    _launch_group_router(x[:1], *router)
    _launch_group_router(torch.randn(40, H, dtype=BF16), *router)  # the tiled FP32-dot path


BUILDS = {
    "attention-decode-bf16": lambda: _attention(BF16, 1),
    "attention-decode-fp8": lambda: _attention(FP8, 1),
    "attention-prefill-bf16": lambda: _attention(BF16, 5),
    "attention-prefill-fp8": lambda: _attention(FP8, 5),
    "qk_prep-full-fp8": lambda: _qk_prep(FP8, True),
    "qk_prep-sliding-bf16": lambda: _qk_prep(BF16, False),
    "norm-cache-router": _misc,
}


@pytest.mark.parametrize("build", list(BUILDS))
def test_kernels_compile_for_hopper_without_spills(build):
    with compile_instead_of_launch() as compiled:
        BUILDS[build]()
    assert compiled
    for name, kernel in compiled:
        assert spill_bytes(kernel) == 0, f"{name} spills registers: {resource_usage(kernel)}"
        if name == "_decode_split_kernel":
            assert "cp.async.cg.shared.global" in kernel.asm["ptx"], "K/V loads not pipelined"
        if name == "_prefill_kernel":
            assert "warp_group_dot" in kernel.asm["ttgir"], "prefill does not use wgmma"
