"""The torch.library contracts of the attention-side ops: schemas and fake (meta) impls agree
with the real op (torch.library.opcheck), and bad inputs raise one PluginError naming the op
and the tensor."""

from __future__ import annotations

import pytest
import torch

import plugins  # noqa: F401  (registers torch.ops.beam.*)
from kernel_cases import Seq, attention_case
from plugins.registry import PluginError

H, HQ, HKV, D = 48, 6, 2, 16


def _qk_prep_args():
    t = 5
    k_cache = torch.zeros(3, 4, HKV, D)
    return (torch.randn(t, 2 * HQ * D + 2 * HKV * D), torch.arange(t), torch.ones(D),
            torch.ones(D), 0.5 * torch.randn(HQ), k_cache, k_cache.clone(),
            torch.tensor([0, 1, -1, 5, 11]), torch.tensor(1.0), torch.tensor(1.0), False, 1e-6,
            10000.0)


def _cases():
    x, w, s = torch.randn(5, H), torch.ones(H), torch.tensor(0.02)
    k_cache = torch.zeros(3, 4, HKV, D)
    attn = attention_case([Seq(3, 2), Seq(6, 1, hist=2)], HQ, HKV, D, 0, 4, torch.float32,
                          torch.float32)
    qk = _qk_prep_args()
    return {
        "rmsnorm": (x, w, 1e-6),
        "rmsnorm_fp8": (x, w, s, 1e-6),
        "add_rmsnorm": (x, torch.randn(5, H), w, w, 0.9, 0.4, 1e-6),
        "add_rmsnorm_fp8": (x, torch.randn(5, H), w, w, s, 0.9, 0.4, 1e-6),
        "qk_prep": qk,
        "qk_prep-partials": (torch.randn(2, *qk[0].shape), *qk[1:], torch.bfloat16),
        "attention-fp8-out": (*attn.values(), s),
        "cache_write": (torch.randn(2, HKV, D), torch.randn(2, HKV, D), k_cache, k_cache.clone(),
                        torch.tensor([7, -1]), torch.tensor(1.0), torch.tensor(1.0)),
        "attention": tuple(attn.values()),
        "group_router": (x, torch.randn(16, H), torch.zeros(16), 4, 2, 3, True),
    }


@pytest.mark.parametrize("case", ["rmsnorm", "rmsnorm_fp8", "add_rmsnorm", "add_rmsnorm_fp8",
                                  "qk_prep", "qk_prep-partials", "cache_write", "attention",
                                  "attention-fp8-out", "group_router"])
def test_schema_and_fake_impl_agree_with_the_op(case):
    op = getattr(torch.ops.beam, case.split("-")[0])
    torch.library.opcheck(op, _cases()[case], test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("op,arg,bad,needle", [
    ("rmsnorm", 1, torch.ones(H + 1), "weight has 49 entries"),
    ("add_rmsnorm", 1, torch.randn(5, H).double(), "y must be one of"),
    ("qk_prep", 0, torch.randn(5, 100), "qkvg width 100"),
    ("qk_prep", 0, torch.randn(5, HQ * D + 2 * HKV * D + HQ), "is not 2*Hq*D + 2*Hkv*D"),
    ("qk_prep", 7, torch.zeros(5, dtype=torch.int32), "slot_mapping must be one of (int64)"),
    ("qk_prep", 4, torch.zeros(HQ + 1), "gate_bias must be contiguous [Hq=6]"),
    ("qk_prep-partials", 13, None, "needs out_dtype"),
    ("add_rmsnorm_fp8", 4, torch.tensor([0.02]), "x_scale must have 0 dims"),
    ("attention-fp8-out", 13, torch.tensor(1, dtype=torch.int32), "out_scale must be one of"),
    ("cache_write", 2, torch.zeros(3, 4, HKV + 1, D), "k_cache"),
    ("attention", 6, torch.tensor([0, 2, 3]), "cu_seqlens_q must be one of (int32)"),
    ("attention", 3, torch.rand(3, HQ), "gate must have 3 dims"),  # the v1 per-head gate
    ("attention", 3, torch.rand(3, HQ, D).to(torch.bfloat16), "gate must be one of"),
    ("attention", 10, -1, "window must be >= 0"),
    ("group_router", 3, 5, "n_group=5"),
])
def test_bad_inputs_name_the_op_and_the_tensor(op, arg, bad, needle):
    args = list(_cases()[op])
    args[arg] = bad
    op = op.split("-")[0]
    with pytest.raises(PluginError, match=f"beam::{op}: .*") as err:
        getattr(torch.ops.beam, op)(*args)
    assert needle in str(err.value)


def test_decode_splits_fill_the_gpu_or_fit_whole_waves():
    """num_splits: at least programs_per_sm programs an SM (the default), or with wave_fit at
    most that many (whole waves where that is the kernel's occupancy); never a split shorter
    than min_split keys of the capacity. (The CPU counts 4 SMs.)"""
    from plugins._attention_decode import num_splits
    cpu = torch.device("cpu")
    args = dict(capacity=1 << 20, block_n=128, device=cpu, programs_per_sm=2, min_split=128)
    assert num_splits(3, 2, **args) == 2 and num_splits(3, 2, **args, wave_fit=True) == 1
    assert num_splits(1, 1, **args) == num_splits(1, 1, **args, wave_fit=True) == 8
    assert num_splits(64, 8, **args, wave_fit=True) == 1
    assert num_splits(1, 1, **dict(args, capacity=300)) == 3  # 300 keys: 3 splits of >= 128
