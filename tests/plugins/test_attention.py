"""beam::attention (+ qk_prep / cache_write as the engine chains them): the reference op
against reference.py's BeamAttention, and the Triton kernels against the reference op."""

from __future__ import annotations

import pytest
import torch

import plugins  # noqa: F401  (registers torch.ops.beam.*)
from beam_trtllm.config import PRESETS
from beam_trtllm.quant_formats import quantize_fp8_activation
from beam_trtllm.reference import BeamAttention, LayerKV
from conftest import tol
from kernel_cases import DTYPE_CASES, KERNEL_DEVICE, OpsAttentionLayer, Seq, attention_case
from plugins._common import FP8_DTYPE, from_cache
from plugins.attention import ref_attention

TINY = PRESETS["tiny"]
BACKENDS = [pytest.param("cpu", id="reference"),
            pytest.param(KERNEL_DEVICE, id="triton", marks=pytest.mark.kernel)]


def _tiny_attention(layer: int, seed: int = 0) -> BeamAttention:
    torch.manual_seed(seed)
    attn = BeamAttention(TINY, layer)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=TINY.hidden_size**-0.5)
    for norm in (attn.q_norm, attn.k_norm):
        torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1)
    return attn.eval().requires_grad_(False)


# Two sequences stepped together: prefill chunks longer than the window (8), a mixed step
# (one decodes while the other prefills) and a pure decode step (T == B).
CHUNKS = [(11, 3), (5, 1), (1, 9), (1, 1), (1, 1)]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_ops_compose_to_the_reference_layer(device, kind):
    layer = TINY.full_layers[0] if kind == "full" else TINY.sliding_layers[0]
    attn = _tiny_attention(layer)
    total = [sum(c[b] for c in CHUNKS) for b in range(2)]
    ops = OpsAttentionLayer(attn, 2, max(total), block_size=4, kv_dtype=torch.float32,
                            device=device)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, TINY.hidden_size, generator=gen) for n in total]
    caches = [LayerKV(keep_last=None if attn.is_full else TINY.sliding_window) for _ in range(2)]
    done = [0, 0]
    with torch.no_grad():
        for chunk in CHUNKS:
            inputs = [xs[b][done[b]: done[b] + chunk[b]] for b in range(2)]
            got = ops.step(inputs, list(done))
            for b in range(2):
                pos = torch.arange(done[b], done[b] + chunk[b])[None]
                want = attn(inputs[b][None], pos, caches[b])[0]
                torch.testing.assert_close(got[b], want, **tol("fp32-reorder", torch.float32))
                done[b] += chunk[b]


@pytest.mark.parametrize("device", BACKENDS)
def test_hist_start_hides_older_keys_like_a_reference_cache_without_them(device):
    """After a prefix restore the keys below hist_start are gone: the op with hist_start = h
    equals the reference layer whose cache holds only positions >= h."""
    attn = _tiny_attention(TINY.full_layers[1])
    hist, cached, new = 6, 13, 3
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(cached + new, TINY.hidden_size, generator=gen)
    ops = OpsAttentionLayer(attn, 1, cached + new, block_size=4, kv_dtype=torch.float32,
                            device=device)
    with torch.no_grad():
        ops.step([x[:cached]], [0])  # fills the paged cache for positions 0..12
        ops.hist[0] = hist
        got = ops.step([x[cached:]], [cached])[0]
        pos = torch.arange(cached + new)[None]
        _, k, v, _ = attn.project(x[None], pos)
        kept = LayerKV(k[:, hist:cached], v[:, hist:cached], pos[:, hist:cached])
        want = attn(x[None, cached:], pos[:, cached:], kept)[0]
    torch.testing.assert_close(got, want, **tol("fp32-reorder", torch.float32))


def test_fp8_cache_reads_entries_times_their_scale():
    case = attention_case([Seq(9, 1), Seq(20, 4, hist=3)], 6, 2, 32, 0, 8, torch.float32,
                          FP8_DTYPE, seed=3)
    dequantized = dict(case, k_cache=from_cache(case["k_cache"], case["k_scale"]),
                       v_cache=from_cache(case["v_cache"], case["v_scale"]),
                       k_scale=torch.tensor(1.0), v_scale=torch.tensor(1.0))
    assert torch.equal(ref_attention(**case), ref_attention(**dequantized))


# Kernels against the reference op on awkward shapes: G = 3 query heads per KV head, D = 32,
# lengths not a multiple of the block size, windows shorter and longer than the sequences,
# hist_start > 0, fresh prefills, chunks on top of a cache (one long enough for key tiles
# below the diagonal, which the kernel runs unmasked), decodes.
MIXED = {
    "full": [Seq(0, 7), Seq(37, 1), Seq(20, 13, hist=5), Seq(50, 1, hist=17), Seq(3, 40)],
    "sliding": [Seq(0, 11), Seq(3, 1), Seq(29, 5), Seq(40, 1, hist=36), Seq(9, 12)],
}
DECODE = {
    "full": [Seq(0, 1), Seq(45, 1), Seq(130, 1, hist=9)],
    "sliding": [Seq(2, 1), Seq(61, 1), Seq(33, 1, hist=30)],
}


@pytest.mark.kernel
@pytest.mark.parametrize("dtype,kv_dtype", DTYPE_CASES + [
    pytest.param(torch.float32, FP8_DTYPE, id="fp32-fp8kv")])  # FP8 tiles via Triton's cast
@pytest.mark.parametrize("step", ["mixed", "decode"])
@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_attention_kernel_matches_reference(kind, step, dtype, kv_dtype):
    seqs = (MIXED if step == "mixed" else DECODE)[kind]
    window = 8 if kind == "sliding" else 0
    case = attention_case(seqs, 6, 2, 32, window, 16, dtype, kv_dtype, seed=4,
                          device=KERNEL_DEVICE)
    got = torch.ops.beam.attention(**case)
    want = ref_attention(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                            for k, v in case.items()})
    assert not got.isnan().any(), "the kernel read a cache row it must not read"
    torch.testing.assert_close(got.cpu(), want, **tol("attention", dtype))


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("step", ["mixed", "decode"])
def test_fp8_output_is_the_quantized_output(device, step):
    """With out_scale (o_proj's input_scale) the op returns the FP8 codes of exactly the output
    it returns without it: decode combine and prefill epilogue; saturating, never NaN."""
    seqs = (MIXED if step == "mixed" else DECODE)["sliding"]
    case = attention_case(seqs, 6, 2, 32, 8, 16, torch.bfloat16, FP8_DTYPE, seed=5, device=device)
    out = torch.ops.beam.attention(**case)
    scale = (out.float().abs().amax() / 600).to(device)  # the largest outputs saturate
    got = torch.ops.beam.attention(**case, out_scale=scale)
    assert got.dtype == FP8_DTYPE and got.shape == out.shape
    want = quantize_fp8_activation(out, scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert (got.float().abs() == 448).any() and not got.float().isnan().any()


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("kv_dtype,fp8_out", [(torch.bfloat16, False), (FP8_DTYPE, True)])
def test_decode_one_split_writes_what_the_combine_writes(kind, kv_dtype, fp8_out, monkeypatch):
    """One split per KV head: the split program writes the gated output (or its FP8 codes)
    itself and no combine runs; several: partials merged by the combine. Same result."""
    from plugins import _attention_decode

    case = attention_case(DECODE[kind], 6, 2, 32, 8 if kind == "sliding" else 0, 16,
                          torch.bfloat16, kv_dtype, seed=6, device=KERNEL_DEVICE)
    if fp8_out:
        case["out_scale"] = torch.tensor(0.01, device=KERNEL_DEVICE)
    outs = {}
    for splits in (1, 3):
        monkeypatch.setattr(_attention_decode, "num_splits", lambda *a, n=splits: n)
        outs[splits] = torch.ops.beam.attention(**case).cpu()
    want = ref_attention(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                            for k, v in case.items()})
    # the attention entry of the tolerance table; for FP8 codes on the decoded values
    # (codes * out_scale), plus one E4M3 step (1/8 relative at most) where the kernel's output
    # and the reference's round to neighbouring codes
    atol, rtol = tol("attention", torch.bfloat16).values()
    scale = 0.01 if fp8_out else 1.0
    for splits, got in outs.items():
        torch.testing.assert_close(got.float() * scale, want.float() * scale, atol=atol,
                                   rtol=rtol + (0.125 if fp8_out else 0.0),
                                   msg=f"{splits} splits")


def _decode_case(kind: str, kv_dtype, seed: int, d: int = 32, fp8_out: bool = False) -> dict:
    """launch_decode's arguments for the DECODE sequences (6 query heads on 2 KV heads, block
    size 16, a window of 8 on the sliding layer); with fp8_out an output scale of 0.01."""
    case = attention_case(DECODE[kind], 6, 2, d, 8 if kind == "sliding" else 0, 16,
                          torch.bfloat16, kv_dtype, seed=seed, device=KERNEL_DEVICE)
    case.pop("cu_seqlens_q")
    if fp8_out:
        case["out_scale"] = torch.tensor(0.01, device=KERNEL_DEVICE)
    return case


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_DTYPE])
def test_decode_first_tile_read_before_the_wait_gives_the_same_bits(kind, kv_dtype):
    """The decode chain's form of the split kernel (PRELOAD, when launched early: each split's
    first K/V tile read before the wait for q) is the loop's first step peeled off: the same
    bits, with splits of one tile, of several, and empty ones (more splits than tiles)."""
    from plugins._attention_decode import launch_decode

    case = _decode_case(kind, kv_dtype, seed=7)
    for splits in (1, 2, 7):
        got = [launch_decode(**case, config={"splits": splits, "preload": preload}).cpu()
               for preload in (False, True)]
        assert torch.equal(got[0].view(torch.int16), got[1].view(torch.int16)), splits


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_DTYPE])
def test_decode_one_tile_splits_without_the_loop_give_the_same_bits(kind, kv_dtype):
    """Splits that cover the cache in one tile each (ONE_TILE: no K/V loop, the tile read
    before the wait) write the looping kernel's bits, read before the wait or after it; with
    empty splits too."""
    from plugins._attention_decode import launch_decode

    case = _decode_case(kind, kv_dtype, seed=9)
    capacity = case["cache_index"].shape[1] * case["k_cache"].shape[1]
    one_each = -(-capacity // 16)  # 16-key tiles: one a split, then some empty ones too
    for splits in (one_each, one_each + 3):
        for preload in (False, True):
            config = {"splits": splits, "preload": preload, "BLOCK_N": 16, "BLOCK_N_SHORT": 16}
            got = [launch_decode(**case, config=dict(config, one_tile=one)).cpu()
                   for one in (False, True)]
            assert torch.equal(got[0].view(torch.int16), got[1].view(torch.int16)), \
                (splits, preload)


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("fp8_out", [False, True])
def test_decode_combine_over_head_dim_slices_gives_the_same_bits(kind, fp8_out):
    """The combine's programs each merge a slice of the head dims (combine_block_d): the bits
    of one program a (sequence, KV head), for slices of 16 and 8 of head_dim 40 (a ragged
    last slice)."""
    from plugins._attention_decode import launch_decode

    case = _decode_case(kind, FP8_DTYPE, seed=10, d=40, fp8_out=fp8_out)
    view = torch.uint8 if fp8_out else torch.int16
    got = [launch_decode(**case, config={"splits": 3, "combine_block_d": width}).cpu()
           for width in (64, 16, 8)]
    for width, out in zip((16, 8), got[1:]):
        assert torch.equal(got[0].view(view), out.view(view)), width


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("kv_dtype,fp8_out", [(torch.bfloat16, False), (FP8_DTYPE, True)])
def test_decode_combine_folded_into_the_split_kernel_gives_the_same_bits(kind, kv_dtype,
                                                                         fp8_out):
    """The decode chain's "combine" fold (each (sequence, KV head)'s last split program merges
    the partials) writes the combine kernel's bits, for any number of splits, and leaves its
    tickets at zero."""
    from _moe_testdata import sync_counters_all_zero
    from plugins._attention_decode import launch_decode

    case = _decode_case(kind, kv_dtype, seed=8, fp8_out=fp8_out)
    view = torch.uint8 if fp8_out else torch.int16
    for splits in (2, 3, 7):
        got = [launch_decode(**case, config={"splits": splits, "fold_combine": fold}).cpu()
               for fold in (False, True)]
        assert torch.equal(got[0].view(view), got[1].view(view)), splits
        assert sync_counters_all_zero()
