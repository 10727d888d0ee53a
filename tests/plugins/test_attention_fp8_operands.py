"""The FP8 cache's operand forms (plugins/_attention_tiles.py, DECODE_CONFIG "fp8_operands"):
each turns every E4M3 code into the FP16 it stands for (the BITS form: that value times 2^-8),
the kernels fold the 2^8 into their scales, and so the three FP16 settings compute the same
sums on exactly scaled operands: the same bits. Against the reference op on awkward shapes and
on caches that hold every finite E4M3 code (subnormals, +-448); the decode loop's sm_90 build
without per-element conversions or byte-wise shared-memory reads; bad settings refused."""

from __future__ import annotations

import collections
import re

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import plugins  # noqa: F401  (registers torch.ops.beam.*)
from beam_trtllm.config import PRESETS
from conftest import tol
from kernel_cases import KERNEL_DEVICE, Seq, attention_case
from plugins import _attention_prefill, _pdl, tuning
from plugins._attention_decode import launch_decode
from plugins._attention_prefill import launch_prefill
from plugins._attention_tiles import _E4M3X4_BITS, FP8_BITS, FP8_CVT, as_operands, fp8_forms
from plugins._common import FP8_DTYPE
from plugins._decode_config import FP8_FORMS, FP8_SETTINGS
from plugins.attention import ref_attention
from plugins.registry import triton_interpreted

BF16 = torch.bfloat16
FP16_SETTINGS = [FP8_SETTINGS[n] for n in ("cvt", "bits", "cvt_k_bits_v")]
CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
NAN_CODES = (0x7F, 0xFF)


@triton.jit
def _codes_kernel(x_ptr, out_ptr, FORM: tl.constexpr, PIN: tl.constexpr):
    offs = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]  # a [16, 16] tile
    tl.store(out_ptr + offs, as_operands(tl.load(x_ptr + offs), tl.bfloat16, FORM, PIN))


def _on_cpu(case: dict) -> dict:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in case.items()}


@pytest.mark.kernel
@pytest.mark.parametrize("pin", [False, True], ids=["operand-layout", "pinned"])
@pytest.mark.parametrize("form", [FP8_CVT.value, FP8_BITS.value], ids=["cvt", "bits"])
def test_every_e4m3_code_becomes_its_fp16_value(form, pin):
    """All 256 codes through the tiles' conversion (on the GPU its PTX, in the interpreter
    Triton ops): CVT gives the code's value, BITS that value times 2^-8, both exactly, for
    the subnormal codes and +-448 too; the two NaN codes, which the cache's saturating store
    never writes, stay NaN (CVT on the GPU) or read as +-480 (times 2^-8 for BITS)."""
    codes = CODES.to(KERNEL_DEVICE)
    out = torch.empty(256, dtype=torch.float16, device=KERNEL_DEVICE)
    _codes_kernel[(1,)](codes.view(FP8_DTYPE), out, FORM=form, PIN=pin)
    got = out.cpu().double()
    want = CODES.view(FP8_DTYPE).double() * (2.0**-8 if form == FP8_BITS.value else 1.0)
    finite = torch.ones(256, dtype=torch.bool)
    finite[list(NAN_CODES)] = False
    assert torch.equal(got[finite], want[finite])
    nan_reads = got[list(NAN_CODES)]
    if form == FP8_BITS.value:
        assert nan_reads.tolist() == [480 * 2.0**-8, -480 * 2.0**-8]
    elif triton_interpreted():  # (the interpreter's FP8 cast has no NaN: it reads +-480)
        assert nan_reads.tolist() == [480.0, -480.0]
    else:
        assert nan_reads.isnan().all()


def _prmt(a: np.ndarray, selector: int) -> np.ndarray:
    """PTX prmt.b32 d, a, 0, selector (default mode): byte i of d is byte (selector nibble i
    & 7) of {0, a}, or that byte's sign bit repeated when the nibble's bit 3 is set."""
    out = np.zeros_like(a)
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        src = nibble & 7
        byte = (a >> np.uint32(8 * src)) & np.uint32(0xFF) if src < 4 else np.zeros_like(a)
        if nibble & 8:
            byte = np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0))
        out |= byte.astype(np.uint32) << np.uint32(8 * i)
    return out


def test_bits_ptx_moves_each_code_into_its_half_word():
    """The BITS form's PTX (_attention_tiles._E4M3X4_BITS: two PRMTs, shifts and masks),
    emulated on every code in each of the four byte positions of a word (the others random):
    FP16 halves 0..3 hold fp16_from_e4m3 of bytes 0..3, the formula the interpreter runs."""
    asm = _E4M3X4_BITS.value
    selectors = [int(s, 16) for s in re.findall(r"prmt\.b32 t\d, \$2, 0, 0x([0-9A-F]+);", asm)]
    shift = int(re.search(r"shl\.b32 t0, t0, (\d+);", asm).group(1))
    mask = int(re.search(r"and\.b32 \$0, t0, 0x([0-9A-F]+);", asm).group(1), 16)
    rng = np.random.default_rng(0)
    codes = np.arange(256, dtype=np.uint32)
    b = codes.astype(np.uint16)
    want = ((b & 0x80) << 8) | ((b & 0x7F) << 7)  # fp16_from_e4m3's bits
    for pos in range(4):
        words = rng.integers(0, 2**32, 256, dtype=np.uint32)
        words = (words & ~np.uint32(0xFF << (8 * pos))) | (codes << np.uint32(8 * pos))
        halves = []
        for selector in selectors:
            r = (_prmt(words, selector) << np.uint32(shift)) & np.uint32(mask)
            halves += [r & np.uint32(0xFFFF), r >> np.uint32(16)]
        assert np.array_equal(halves[pos].astype(np.uint16), want), pos
    finite = ~np.isin(codes, NAN_CODES)
    assert np.array_equal(want.view(np.float16).astype(np.float64)[finite],
                          (CODES.view(FP8_DTYPE).double() * 2.0**-8).numpy()[finite])


def _settings_outputs(case: dict, decode: bool) -> dict:
    """The op's output under each fp8_operands setting (decode: launch_decode's config;
    a mixed step: the full layers' prefill setting, patched)."""
    outs = {}
    for setting in FP8_FORMS:
        if decode:
            args = {k: v for k, v in case.items() if k != "cu_seqlens_q"}
            outs[setting] = launch_decode(**args, config={"fp8_operands": setting}).cpu()
        else:
            kind = "sliding" if case["window"] else "full"
            saved = _attention_prefill.PREFILL_CONFIG[kind]["fp8_operands"]
            try:
                _attention_prefill.PREFILL_CONFIG[kind]["fp8_operands"] = setting
                outs[setting] = torch.ops.beam.attention(**case).cpu()
            finally:
                _attention_prefill.PREFILL_CONFIG[kind]["fp8_operands"] = saved
    return outs


DECODE = {"full": [Seq(0, 1), Seq(45, 1), Seq(130, 1, hist=9)],
          "sliding": [Seq(2, 1), Seq(61, 1), Seq(33, 1, hist=30)]}
MIXED = {"full": [Seq(0, 7), Seq(37, 1), Seq(20, 13, hist=5), Seq(3, 40)],
         "sliding": [Seq(0, 11), Seq(29, 5), Seq(40, 1, hist=36)]}


@pytest.mark.kernel
@pytest.mark.parametrize("step", ["decode", "mixed"])
@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_fp8_settings_match_the_reference_and_the_fp16_ones_each_other(kind, step):
    """G = 3 query heads a KV head, D = 40 (a masked 64-wide tile), lengths off the block size,
    hist_start > 0: every setting within the attention tolerance of the reference; the FP16
    ones (cvt, bits, K by cvt and V by bits) bit for bit alike, since each multiplies exactly
    the same values (BITS' operands are CVT's times 2^-8, its scales 2^8 times CVT's), and
    nearer the reference than the cast, which rounds P to BF16: at most half as many of their
    BF16 outputs differ from the reference's (interpreter: 2-5% against 25-34%)."""
    window = 8 if kind == "sliding" else 0
    seqs = (DECODE if step == "decode" else MIXED)[kind]
    case = attention_case(seqs, 6, 2, 40, window, 16, BF16, FP8_DTYPE, seed=21,
                          device=KERNEL_DEVICE)
    outs = _settings_outputs(case, step == "decode")
    want = ref_attention(**_on_cpu(case))
    for setting, got in outs.items():
        assert not got.isnan().any(), setting
        torch.testing.assert_close(got, want, **tol("attention", BF16), msg=f"setting {setting}")
    first = outs[FP16_SETTINGS[0]].view(torch.int16)
    for setting in FP16_SETTINGS[1:]:
        assert torch.equal(outs[setting].view(torch.int16), first), setting
    differ = {s: float((got != want).float().mean()) for s, got in outs.items()}
    assert differ[FP16_SETTINGS[0]] <= 0.5 * differ[FP8_SETTINGS["cast"]], differ


def _extreme_case(step: str) -> dict:
    """A full layer whose 300 cached positions hold every finite E4M3 code (the 14 subnormal
    ones and +-448 among them; K / V up to 5 and 4 at the case's scales), and queries with
    elements below FP16's normal range (2^-14) and up to 300."""
    seqs = [Seq(300, 1)] if step == "decode" else [Seq(300, 6)]
    case = attention_case(seqs, 6, 2, 32, 0, 16, BF16, FP8_DTYPE, seed=22)
    gen = torch.Generator().manual_seed(23)
    finite = CODES[[c for c in range(256) if c not in NAN_CODES]]
    j = torch.arange(300)
    rows, slots = case["cache_index"][0].long()[j // 16], j % 16
    for name in ("k_cache", "v_cache"):
        picks = finite[torch.randint(0, len(finite), (300, 2, 32), generator=gen)]
        picks.view(-1)[: len(finite)] = finite  # each code at least once
        case[name][rows, slots] = picks.view(FP8_DTYPE)
    q = case["q"].float()
    q[..., ::4] *= 2.0**-18  # FP16 subnormals once converted
    big = q[..., 1::8]
    q[..., 1::8] = 300.0 * torch.sign(big) * torch.rand(big.shape, generator=gen)
    case["q"] = q.to(BF16)
    return {k: v.to(KERNEL_DEVICE) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


@pytest.mark.kernel
@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_fp8_settings_at_e4m3_extremes(step):
    """Every finite code read back (subnormals and +-448), queries at FP16's range ends: each
    setting within the attention tolerance of the reference, the FP16 ones alike."""
    case = _extreme_case(step)
    outs = _settings_outputs(case, step == "decode")
    want = ref_attention(**_on_cpu(case))
    for setting, got in outs.items():
        torch.testing.assert_close(got, want, **tol("attention", BF16), msg=f"setting {setting}")
    for setting in FP16_SETTINGS[1:]:
        assert torch.equal(outs[setting].view(torch.int16),
                           outs[FP16_SETTINGS[0]].view(torch.int16)), setting


@pytest.mark.kernel
@pytest.mark.parametrize("kv_dtype", [BF16, FP8_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_block_table_shifts_give_the_runtime_division_bits(kind, kv_dtype):
    """The block-table positions by shifts and masks (a power-of-two block size: 16 paged, an
    8-slot ring) and by runtime division (`pow2_blocks` off, as before the shifts) read the
    same keys: the same bits, decode and prefill kernels; a block size of 12 takes the division
    either way. (The BF16 cache's kernels differ from before only there.)"""
    window = 8 if kind == "sliding" else 0
    for block_size in (16, 12):
        if window and block_size == 12:
            continue  # (a ring's block is the window)
        for seqs in (DECODE[kind], MIXED[kind]):
            case = attention_case(seqs, 6, 2, 32, window, block_size, BF16, kv_dtype, seed=24,
                                  device=KERNEL_DEVICE)
            got = []
            for pow2 in (True, False):
                if seqs is DECODE[kind]:
                    args = {k: v for k, v in case.items() if k != "cu_seqlens_q"}
                    got.append(launch_decode(**args, config={"pow2_blocks": pow2}).cpu())
                else:
                    got.append(launch_prefill(**case, config={"pow2_blocks": pow2}).cpu())
            assert torch.equal(got[0].view(torch.int16), got[1].view(torch.int16)), block_size


def test_settings_are_checked():
    """fp8_forms refuses an unknown setting by name; 16-bit caches and FP32 models take the
    cast whatever the setting; a tuned table with an unknown setting installs nothing."""
    with pytest.raises(ValueError, match="fp8_operands must be one of"):
        fp8_forms(7, BF16, FP8_DTYPE)
    assert fp8_forms(3, BF16, BF16) == fp8_forms(3, torch.float32, FP8_DTYPE) == (1, 1)
    assert fp8_forms(4, BF16, FP8_DTYPE) == (FP8_CVT.value, FP8_BITS.value)
    key = ["attention_decode", 1, 2048, 48, 8, 128, "bfloat16", "float8_e4m3fn"]
    with pytest.raises(tuning.TuningError, match="fp8_operands must be one of"):
        tuning.install({"entries": [{"key": key, "config": {"fp8_operands": 5}}]})
    assert not tuning.installed()


# ----------------------------------------------------------------------------- sm_90 builds
BEAM = PRESETS["beam-1.0-501b"]


def _loop_ops(config: dict, kv_dtype, monkeypatch) -> collections.Counter:
    """SASS opcodes inside the split kernel's loop, batch-1 decode at Beam's heads over a long
    paged cache in 50 splits (the H200's count), launched as the decode chain launches it."""
    from sm90 import compile_instead_of_launch, loop_instructions, spill_bytes

    monkeypatch.setattr(_pdl, "has_pdl", lambda device: True)
    case = attention_case([Seq(20000, 1)], BEAM.num_attention_heads, BEAM.num_key_value_heads,
                          BEAM.head_dim, 0, 64, BF16, kv_dtype)
    case.pop("cu_seqlens_q")
    with compile_instead_of_launch() as compiled:
        launch_decode(**case, config=dict(config, splits=50))
    kernel = dict(compiled)["_decode_split_kernel"]
    assert spill_bytes(kernel) == 0
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", c).split()[0]
                               for c in loop_instructions(kernel))


@pytest.mark.slow
def test_fp16_forms_decode_loop_has_no_per_element_conversions(monkeypatch):
    """The sm_90 decode loop (a 128-key tile): Triton's cast to BF16 converts each f16 on its
    own (F2F) and reads V's codes from shared memory a byte at a time (LDS.U8); the FP16
    settings do neither, and take at most 1.3x the instructions of the BF16 cache's loop
    (which moves twice the bytes) and at most 0.6x the cast's."""
    bf16 = sum(_loop_ops({}, BF16, monkeypatch).values())
    cast = _loop_ops({"fp8_operands": FP8_SETTINGS["cast"]}, FP8_DTYPE, monkeypatch)
    assert cast["F2F.BF16.F16"] and cast["LDS.U8"]  # (what the FP16 forms remove)
    for setting in FP16_SETTINGS:
        ops = _loop_ops({"fp8_operands": setting}, FP8_DTYPE, monkeypatch)
        assert not ops["F2F.BF16.F16"] and not ops["LDS.U8"], setting
        assert sum(ops.values()) <= min(1.3 * bf16, 0.6 * sum(cast.values())), \
            (setting, sum(ops.values()), bf16, sum(cast.values()))


@pytest.mark.parametrize("setting", FP16_SETTINGS)
def test_fp16_forms_build_for_awkward_shapes(setting, monkeypatch):
    """The tests' shapes build for sm_90 too (the GPU runs them): 3 query heads a KV head,
    head dims 32 and 40, 16- and 64-key tiles, rings and paged caches, one tile a split and
    loops; no spills."""
    from sm90 import compile_instead_of_launch, spill_bytes

    monkeypatch.setattr(_pdl, "has_pdl", lambda device: True)
    with compile_instead_of_launch() as compiled:
        for d, window, tiles in ((32, 0, {}), (40, 8, {}), (32, 0, {"BLOCK_N": 16,
                                                                     "BLOCK_N_SHORT": 16})):
            case = attention_case(DECODE["sliding" if window else "full"], 6, 2, d, window, 16,
                                  BF16, FP8_DTYPE)
            case.pop("cu_seqlens_q")
            for splits in (1, 3):
                launch_decode(**case, config=dict(tiles, fp8_operands=setting, splits=splits))
        saved = _attention_prefill.PREFILL_CONFIG["full"]["fp8_operands"]
        try:
            _attention_prefill.PREFILL_CONFIG["full"]["fp8_operands"] = setting
            launch_prefill(**attention_case(MIXED["full"], 6, 2, 40, 0, 16, BF16, FP8_DTYPE))
        finally:
            _attention_prefill.PREFILL_CONFIG["full"]["fp8_operands"] = saved
    assert {name for name, _ in compiled} >= {"_decode_split_kernel", "_prefill_kernel"}
    for name, kernel in compiled:
        assert spill_bytes(kernel) <= (20 if name == "_decode_split_kernel" else 0), name
