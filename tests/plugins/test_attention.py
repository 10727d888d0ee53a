"""beam::attention (+ qk_prep / cache_write as the engine chains them): the ops against
transformers' BeamAttention (its forward, with its masks), the FP8 cache's own-key round trip,
and the Triton kernels against the reference op."""

from __future__ import annotations

import pytest
import torch

import hf_oracle
import plugins  # noqa: F401  (registers torch.ops.beam.*)
from beam_trtllm.config import PRESETS
from beam_trtllm.quant_formats import quantize_fp8_activation
from conftest import tol
from kernel_cases import DTYPE_CASES, KERNEL_DEVICE, OpsAttentionLayer, Seq, attention_case
from plugins import attention as attention_op
from plugins._common import FP8_DTYPE, from_cache
from plugins.attention import as_cached, ref_attention
from plugins.cache_write import ref_cache_write
from plugins.registry import triton_interpreted

TINY = PRESETS["tiny"]
BACKENDS = [pytest.param("cpu", id="reference"),
            pytest.param(KERNEL_DEVICE, id="triton", marks=pytest.mark.kernel)]


def _runs_kernels(device: str) -> bool:
    """Whether beam:: ops on `device` run the Triton kernels (else their references)."""
    return device == "cuda" or triton_interpreted()


def _tiny_attention(layer: int, seed: int = 0):
    """transformers' BeamAttention of the tiny preset's layer (FP32, eager), seeded weights with
    a nonzero gate_bias."""
    return hf_oracle.attention(TINY, layer, torch.float32, seed)


# Two sequences stepped together: prefill chunks longer than the window (8), a mixed step
# (one decodes while the other prefills) and a pure decode step (T == B). The second sequence
# starts at position 2040 (its keys below are gone: hist_start), so it crosses 2048, where
# SSMax is 2^0.1 and RoPE's angles are large.
CHUNKS = [(11, 3), (5, 1), (1, 9), (1, 1), (1, 1)]
STARTS = [0, 2040]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_ops_compose_to_transformers_attention(device, kind):
    """qk_prep -> attention -> cache_write, chunk by chunk over paged / ring caches, give what
    transformers' BeamAttention.forward gives for each whole sequence at once."""
    layer = TINY.full_layers[0] if kind == "full" else TINY.sliding_layers[0]
    attn = _tiny_attention(layer)
    total = [sum(c[b] for c in CHUNKS) for b in range(2)]
    ops = OpsAttentionLayer(TINY, attn, 2, max(STARTS) + max(total), block_size=4,
                            kv_dtype=torch.float32, device=device)
    ops.hist[:] = torch.tensor(STARTS, dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, TINY.hidden_size, generator=gen) for n in total]
    with torch.no_grad():
        want = [hf_oracle.attention_forward(TINY, attn, x[None],
                                            torch.arange(s, s + len(x))[None])[0]
                for x, s in zip(xs, STARTS)]
        done = [0, 0]
        for chunk in CHUNKS:
            inputs = [xs[b][done[b]: done[b] + chunk[b]] for b in range(2)]
            got = ops.step(inputs, [s + n for s, n in zip(STARTS, done)])
            for b in range(2):
                torch.testing.assert_close(got[b], want[b][done[b]: done[b] + chunk[b]],
                                           **tol("fp32-reorder", torch.float32))
                done[b] += chunk[b]


@pytest.mark.parametrize("device", BACKENDS)
def test_hist_start_hides_older_keys_like_a_mask_without_them(device):
    """After a prefix restore the keys below hist_start are gone: the op with hist_start = h
    equals transformers' BeamAttention whose mask also hides the keys below h from those
    queries."""
    attn = _tiny_attention(TINY.full_layers[1])
    hist, cached, new = 6, 13, 3
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(cached + new, TINY.hidden_size, generator=gen)
    ops = OpsAttentionLayer(TINY, attn, 1, cached + new, block_size=4, kv_dtype=torch.float32,
                            device=device)
    with torch.no_grad():
        ops.step([x[:cached]], [0])  # fills the paged cache for positions 0..12
        ops.hist[0] = hist
        got = ops.step([x[cached:]], [cached])[0]
        want = hf_oracle.attention_forward(
            TINY, attn, x[None], torch.arange(cached + new)[None],
            and_mask_function=lambda b, h, q, kv: (q < cached) | (kv >= hist))[0, cached:]
    torch.testing.assert_close(got, want, **tol("fp32-reorder", torch.float32))


def test_fp8_cache_reads_entries_times_their_scale():
    """An FP8 cache reads entry * scale, and the step's own keys and values enter as the cache
    would store them: the op on FP8 caches equals the op on their dequantized values with this
    step's K / V given already round-tripped."""
    case = attention_case([Seq(9, 1), Seq(20, 4, hist=3)], 6, 2, 32, 0, 8, torch.float32,
                          FP8_DTYPE, seed=3)
    one = torch.tensor(1.0)
    dequantized = dict(case, k_cache=from_cache(case["k_cache"], case["k_scale"]),
                       v_cache=from_cache(case["v_cache"], case["v_scale"]), k_scale=one,
                       v_scale=one, k_new=as_cached(case["k_new"], FP8_DTYPE, case["k_scale"]),
                       v_new=as_cached(case["v_new"], FP8_DTYPE, case["v_scale"]))
    assert not torch.equal(dequantized["k_new"], case["k_new"])  # the round trip moves keys
    assert torch.equal(ref_attention(**case), ref_attention(**dequantized))


def _cached_twin(case: dict, seq: Seq) -> dict:
    """The queries of a one-sequence prefill chunk `case` run instead as len(chunk) decode
    steps (one sequence each, T == B) whose cache already holds the chunk's earlier keys,
    written by cache_write's rule: paged, one shared block table; sliding, one ring each (a
    copy of the chunk's ring plus the keys before that query)."""
    n, c = seq.new, seq.cached
    k_new, v_new = case["k_new"].cpu(), case["v_new"].cpu()
    ks, vs = case["k_scale"].cpu(), case["v_scale"].cpu()
    index = case["cache_index"].cpu().long()
    k_cache, v_cache = case["k_cache"].cpu(), case["v_cache"].cpu()
    bs, window = k_cache.shape[1], case["window"]
    if window:  # ring i: the chunk's ring, then keys c .. c+i-1 (slot j % window)
        k_cache = k_cache[index[0, 0]].repeat(n, 1, 1, 1)
        v_cache = v_cache[index[0, 0]].repeat(n, 1, 1, 1)
        for i in range(n):
            j = torch.arange(c, c + i)
            ref_cache_write(k_new[:i], v_new[:i], k_cache, v_cache, i * bs + j % window, ks, vs)
        index = torch.arange(n)[:, None]
    else:  # every position of the chunk written into the table's blocks; later ones unread
        j = torch.arange(c, c + n)
        k_cache, v_cache = k_cache.clone(), v_cache.clone()
        slots = index[0, (j // bs) % index.shape[1]] * bs + j % bs
        ref_cache_write(k_new, v_new, k_cache, v_cache, slots, ks, vs)
        index = index.expand(n, -1)
    dev = case["q"].device
    return dict(case, k_cache=k_cache.to(dev), v_cache=v_cache.to(dev),
                cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=dev),
                q_start=torch.arange(c, c + n, dtype=torch.int32, device=dev),
                hist_start=torch.full((n,), seq.hist, dtype=torch.int32, device=dev),
                cache_index=index.int().contiguous().to(dev))


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_fp8_chunk_sees_its_own_keys_as_a_later_step_reads_them(kind, dtype, device):
    """With an FP8 cache a prefill chunk's queries see the chunk's keys as the cache stores
    them: the chunk's result (prefill kernel) equals its queries run one by one with those keys
    already cached (decode kernel), so no result depends on whether a prefix was cached. Keys
    taken unrounded instead (before the round trip) would miss by more than the tolerance."""
    seq = Seq(13, 6, hist=2)
    window = 8 if kind == "sliding" else 0
    cold = attention_case([seq], 6, 2, 32, window, 8, dtype, FP8_DTYPE, seed=12, device=device)
    cached = _cached_twin(cold, seq)
    got_cold, got_cached = (torch.ops.beam.attention(**c).cpu() for c in (cold, cached))
    assert not got_cold.isnan().any() and not got_cached.isnan().any()
    if not _runs_kernels(device):  # the reference: the same sums over the same values
        what = "fp32-reorder" if dtype == torch.float32 else "bf16-1ulp"
    else:  # the prefill and the decode kernel: two summation orders
        what = "attention"
        torch.testing.assert_close(got_cold, ref_attention(**{
            k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in cold.items()}),
            **tol("attention", dtype))
    torch.testing.assert_close(got_cold, got_cached, **tol(what, dtype))
    unrounded = attention_op.as_cached
    try:
        attention_op.as_cached = lambda x, cache_dtype, scale: x.float()
        before = ref_attention(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                  for k, v in cold.items()})
    finally:
        attention_op.as_cached = unrounded
    atol, rtol = tol("attention", dtype).values()
    assert not torch.allclose(before.float(), got_cached.float(), atol=atol, rtol=rtol)


# Kernels against the reference op on awkward shapes: G = 3 query heads per KV head, D = 32,
# lengths not a multiple of the block size, windows shorter and longer than the sequences,
# hist_start > 0, fresh prefills, chunks on top of a cache (one long enough for key tiles
# below the diagonal, which the kernel runs unmasked), decodes.
# "sliding-wide": a window (40) wider than a key tile plus a query tile, so that the chunks
# of 45 and 70 tokens have tiles every row sees (unmasked) between the masked window-start
# and diagonal tiles.
WINDOWS = {"full": 0, "sliding": 8, "sliding-wide": 40}
MIXED = {
    "full": [Seq(0, 7), Seq(37, 1), Seq(20, 13, hist=5), Seq(50, 1, hist=17), Seq(3, 40)],
    "sliding": [Seq(0, 11), Seq(3, 1), Seq(29, 5), Seq(40, 1, hist=36), Seq(9, 12)],
    "sliding-wide": [Seq(0, 70), Seq(30, 45, hist=12), Seq(61, 1), Seq(5, 9)],
}
DECODE = {
    "full": [Seq(0, 1), Seq(45, 1), Seq(130, 1, hist=9)],
    "sliding": [Seq(2, 1), Seq(61, 1), Seq(33, 1, hist=30)],
    "sliding-wide": [Seq(70, 1), Seq(39, 1, hist=3)],
}


@pytest.mark.kernel
@pytest.mark.parametrize("dtype,kv_dtype", DTYPE_CASES + [
    pytest.param(torch.float32, FP8_DTYPE, id="fp32-fp8kv")])  # FP8 tiles via Triton's cast
@pytest.mark.parametrize("step", ["mixed", "decode"])
@pytest.mark.parametrize("kind", list(WINDOWS))
def test_attention_kernel_matches_reference(kind, step, dtype, kv_dtype):
    seqs = (MIXED if step == "mixed" else DECODE)[kind]
    window = WINDOWS[kind]
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
