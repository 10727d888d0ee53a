"""Small helpers shared by the attention-side op files: input checks that name the op and the
tensor, the KV-cache quantization rule, and Triton helpers that round exactly like torch.

Why the rounding helpers exist: Triton's interpreter (how the kernels are tested on the CPU)
truncates FP32 -> BF16 instead of rounding to nearest-even, and its FP32 -> FP8 rounding drops
the carry into the exponent (31.3 becomes 16, not 32). The helpers below round in FP32 bit
arithmetic to a value that the target format holds exactly, so the final cast has nothing left
to round: interpreter and GPU then store the same bits as torch's `.to(dtype)`. Compiled, the
BF16 helper is the GPU's own cast (nearest even already); the FP8 one keeps its bit arithmetic
(it also saturates) at a few integer instructions per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import wait_for_inputs
from .registry import PluginError, triton_interpreted

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


# ----------------------------------------------------------------------------- python side
def check(cond: bool, op: str, message: str) -> None:
    """Raise the op's one clear error (names the op; the message names the input)."""
    if not cond:
        raise PluginError(f"beam::{op}: {message}")


def check_tensor(op: str, name: str, t: torch.Tensor, ndim: int | None = None,
                 dtypes: tuple[torch.dtype, ...] | None = None, device: torch.device | None = None):
    # messages are formatted only on failure: every eager op runs several of these a call
    if ndim is not None and t.dim() != ndim:
        check(False, op, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        check(False, op, f"{name} must be one of ({names}), got {t.dtype}")
    if device is not None and t.device != device:
        check(False, op, f"{name} is on {t.device}, expected {device}")


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
CACHE_DTYPES = FLOAT_DTYPES + (FP8_DTYPE,)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """The KV-cache store rule: FP8 caches hold clamp(x / scale, ±448) (saturating, so an
    outlier beyond the calibrated range cannot become NaN); other caches hold x as is."""
    if is_fp8(cache_dtype):
        return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)
    return x.to(cache_dtype)


def from_cache(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP32 values of cache entries (FP8 entries times their per-layer scale)."""
    if is_fp8(x.dtype):
        return x.float() * scale.float()
    return x.float()


def check_cache_pair(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     k_scale: torch.Tensor, v_scale: torch.Tensor, device: torch.device) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, c, ndim=4, dtypes=CACHE_DTYPES, device=device)
        check(c.stride(-1) == 1, op, f"{name} must be contiguous in its last (head_dim) dim")
    check(k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype, op,
          f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} "
          f"{v_cache.dtype} must match")
    check(k_cache.stride() == v_cache.stride(), op,
          "k_cache and v_cache must have the same strides")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_tensor(op, name, s, dtypes=(torch.float32,), device=device)
        check(s.numel() == 1, op, f"{name} must hold one value, got shape {tuple(s.shape)}")


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached: the query is not free); 4 for the CPU, where
    kernels run in the interpreter and a small persistent grid still exercises the loops."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds scalar kernel arguments as 1-element arrays and turns
    them into loop bounds with `int(array)`, which NumPy >= 2.3 refuses for 1-d arrays, so
    every `for i in range(0, n)` over a runtime `n` fails in the interpreter. Index through
    the single element instead (interpreter only; compiled kernels are untouched)."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_beam_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._beam_fixed = True
    interpreter._patch_lang_tensor = patched


if triton_interpreted():
    _fix_interpreter_scalar_index()


# ----------------------------------------------------------------------------- triton side
# Compiled for a GPU, Triton's FP32 -> BF16 conversion is cvt.rn (nearest even) already, so the
# bit arithmetic of bf16_grid runs in the interpreter only. On the H200 it cost add_rmsnorm 12
# points of copy bandwidth at [16384, 5120] (2026-11-29, commit 81c8a4e), and it turned the GPU's
# canonical NaN (0x7FFFFFFF) into -0.0: the carry of the rounding add ran into the sign bit.
INTERPRETED = tl.constexpr(triton_interpreted())


@triton.jit
def bf16_grid(x):
    """FP32 x rounded to nearest-even BF16, returned as an FP32 value that BF16 holds exactly
    (NaN stays NaN)."""
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
    else:
        x = x.to(tl.bfloat16).to(tl.float32)
    return x


@triton.jit
def div_rn_by(x, s):
    """RN(x / s) in FP32 for an FP32 divisor s (a scalar, or a column broadcast along rows)
    shared by many x: RN32(x · RN64(1/s)) in FP64. Exact wherever the quotient is a normal
    FP32: the FP64 product is within 2^-52 (relative) of x/s, while x/s, unless it is one
    itself, is at least ~2^-49 away from any FP32 rounding midpoint (a 25-bit significand;
    x/s equal to one would need x = M·s, more than 24 bits), so both round alike. Subnormal
    quotients may differ by one ulp; the FP8 quantizers round those to ±0 either way.
    On the H200, 16e9 random pairs matched div.rn (docs/benchmarks-history.md). Per element:
    two conversions and a DMUL; div.rn.f32 is a range check and a branch to a slow path per
    element, which kept add_rmsnorm_fp8's 8 quotients a thread from overlapping (4.7 µs at
    batch 1 against 2.7 without codes, H200)."""
    s_inv = 1.0 / s.to(tl.float64)  # div.rn.f64
    return (x.to(tl.float64) * s_inv).to(tl.float32)


@triton.jit
def to_e4m3(x):
    """FP32 x -> float8_e4m3fn saturated to ±448 and rounded to nearest even: torch's
    `x.clamp(-448, 448).to(float8_e4m3fn)`, NaN kept. Compiled, Triton's cast is one
    `cvt.rn.satfinite.e4m3x2.f32` a pair, which rounds and saturates exactly so (the bit
    arithmetic of e4m3_grid cost add_rmsnorm_fp8 ~2 µs of its 5 at batch 1 on the H200); the
    interpreter's cast neither rounds to nearest nor saturates, so there x is put on the grid
    first."""
    if INTERPRETED:
        x = e4m3_grid(x)
    return x.to(tl.float8e4nv)


@triton.jit
def e4m3_grid(x):
    """FP32 x saturated to ±448 and rounded to nearest-even float8_e4m3fn, as an exact FP32
    (NaN stays NaN, as torch's cast keeps it; plain min / max would turn it into a bound)."""
    x = tl.maximum(x, -448.0, propagate_nan=tl.PropagateNan.ALL)
    x = tl.minimum(x, 448.0, propagate_nan=tl.PropagateNan.ALL)
    bits = x.to(tl.uint32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    ulp_exp = tl.maximum(exponent, -6) - 3  # 3 mantissa bits; below 2^-6 the spacing is 2^-9
    # Adding then subtracting 1.5 * 2^(ulp_exp + 23) rounds to a multiple of 2^ulp_exp (RTNE).
    magic = (((ulp_exp + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (x + magic) - magic
    sign = bits & 0x80000000  # keep -0.0 for tiny negatives, as torch does
    return (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """x (FP32) -> dtype with round-to-nearest-even, bit-identical to torch on GPU and CPU."""
    if dtype == tl.bfloat16:
        if INTERPRETED:  # (compiled, the cast below rounds to nearest even itself)
            x = bf16_grid(x)
    elif dtype == tl.float8e4nv:
        return to_e4m3(x)
    return x.to(dtype)


def sum_partials(y: torch.Tensor, dtype: torch.dtype, weights: torch.Tensor | None = None,
                 scale: float = 1.0) -> torch.Tensor:
    """y [T, N], or a split GEMM's partials [S, T, N] summed in order (or an MoE's per-slot
    outputs weighted by weights [T, S], from 0, the FP32 sum times `scale`: the routed scale)
    and rounded to dtype. The references of the ops that take partials (add_rmsnorm,
    qk_prep); `summed_partials` is the kernels' twin."""
    if y.dim() == 2:
        return y
    if weights is None:
        total = y[0]
        for part in y[1:]:
            total = total + part
        return total.to(dtype)
    total = torch.zeros(y.shape[1:], dtype=torch.float32, device=y.device)
    for s, part in enumerate(y):
        total = total + part.float() * weights[:, s:s + 1]
    return (total * scale).to(dtype)


@triton.jit
def summed_partials(ptrs, mask, stride_s, PARTIALS: tl.constexpr, dtype: tl.constexpr):
    """FP32 values at ptrs: as they are (PARTIALS = 0), or PARTIALS FP32 partial sums (a split
    GEMM's, stride_s apart) added in order and rounded to dtype, as the unsplit GEMM's output
    would be (`sum_partials` in a kernel)."""
    v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for part in tl.static_range(1, PARTIALS):
        v += tl.load(ptrs + part * stride_s, mask=mask, other=0.0).to(tl.float32)
    if PARTIALS > 0:
        v = cast_rne(v, dtype).to(tl.float32)
    return v


@triton.jit
def rows_times_weights(x_ptr, stride_x, w_ptr, stride_w, t, e, k_lo, k_hi, T, E,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr):
    """FP32 sums x[t, k_lo:k_hi] · w[e, k_lo:k_hi] -> [BLOCK_T, BLOCK_E] for token rows t
    [BLOCK_T] < T and weight rows e [BLOCK_E] < E (both contiguous in k). x is taken in w's
    dtype (the router's FP32 weight upcasts it; a 16-bit weight of x's dtype multiplies as is):
    USE_DOT a tensor-core product (DOT_PREC for FP32 operands), else FP32 FMAs, for a few
    tokens whose cost is reading w once (beam::group_router's logits)."""
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w = weight_tile(w_ptr, stride_w, e, k0, k_hi, E, BLOCK_K)
        acc += rows_times_tile(x_ptr, stride_x, w, t, k0, k_hi, T, BLOCK_K, USE_DOT, DOT_PREC)
    return acc


@triton.jit
def rows_times_weights_after_wait(x_ptr, stride_x, w_ptr, stride_w, t, e, k_lo, k_hi, T, E,
                                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                                  BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                                  DOT_PREC: tl.constexpr, PRELOAD: tl.constexpr,
                                  PDL: tl.constexpr):
    """rows_times_weights in a decode-chain kernel (_pdl.py), whose x is ready only after its
    wait for the kernel before it. PRELOAD (the range is one BLOCK_K step): the weight tile is
    read before the wait, x after it; the same sum."""
    if PRELOAD:
        w = weight_tile(w_ptr, stride_w, e, k_lo, k_hi, E, BLOCK_K)
        wait_for_inputs(PDL)
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        acc += rows_times_tile(x_ptr, stride_x, w, t, k_lo, k_hi, T, BLOCK_K, USE_DOT, DOT_PREC)
    else:
        wait_for_inputs(PDL)
        acc = rows_times_weights(x_ptr, stride_x, w_ptr, stride_w, t, e, k_lo, k_hi, T, E,
                                 BLOCK_T, BLOCK_E, BLOCK_K, USE_DOT, DOT_PREC)
    return acc


@triton.jit
def weight_tile(w_ptr, stride_w, e, k0, k_hi, E, BLOCK_K: tl.constexpr):
    """w[e, k0:k0 + BLOCK_K] (zero beyond k_hi and E): one step of rows_times_weights, which a
    decode-chain kernel reads before its wait when its range is one step."""
    kk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + e[:, None].to(tl.int64) * stride_w + kk[None, :],
                   mask=(e[:, None] < E) & (kk[None, :] < k_hi), other=0.0)


@triton.jit
def rows_times_tile(x_ptr, stride_x, w, t, k0, k_hi, T, BLOCK_K: tl.constexpr,
                    USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr):
    """x[t, k0:k0 + BLOCK_K] · w^T for a weight_tile w, as rows_times_weights sums it."""
    kk = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_x + kk[None, :],
                mask=(t[:, None] < T) & (kk[None, :] < k_hi), other=0.0)
    x = x.to(w.dtype)
    if USE_DOT:
        return tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
    return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


# Last-program handoffs (a kernel's last program to finish does a follow-up's work): int32
# counters the programs draw tickets from. The MoE's combine tickets ("combine") and pair
# counters ("pairs"), the attention's per-(sequence, KV head) tickets ("attention"), the
# router's per-token-block tickets ("router").
COUNTER_KINDS = ("combine", "pairs", "attention", "router")
_COUNTERS: dict = {}


@triton.jit
def last_to_arrive(ticket, count):
    """Whether this program draws the last of `count` tickets at `ticket`: after a barrier,
    so that every thread's stores precede the draw, a gpu-scope acq_rel add (the last drawer
    then sees every other drawer's stores). The caller puts the ticket back to zero after."""
    tl.debug_barrier()
    return tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == count - 1


def sync_counters(device: torch.device, count: int, kind: str) -> torch.Tensor:
    """>= count zeroed int32 counters of one `kind` (COUNTER_KINDS), one set per device and
    stream (two launches running at once must not share them; the programs put back to zero
    what they use, so the set stays zero between launches). Never freed: a CUDA graph keeps
    the pointer it captured."""
    assert kind in COUNTER_KINDS, kind
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    sets = _COUNTERS.setdefault((str(device), stream, kind), [])
    if not sets or sets[-1].numel() < count:
        sets.append(torch.zeros(max(count, 4096), dtype=torch.int32, device=device))
    return sets[-1]


def prepare_counters(device: torch.device) -> None:
    """Make the current stream's counters now (every kind, at the smallest set's 4096, enough
    for any decode-sized call): made by a first call inside a CUDA-graph capture, their zeroing
    would be part of every replay (and of a launch count)."""
    for kind in COUNTER_KINDS:
        sync_counters(device, 1, kind)
