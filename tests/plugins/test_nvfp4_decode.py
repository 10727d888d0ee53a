"""The arithmetic of the NVFP4 code-pair decoder (plugins/_tiles.py, `_E2M1_PAIR_TO_BF16`),
which only runs as PTX on a GPU: the same integer steps in Python over every pair of codes,
against the E2M1 table; and the activations' K order that goes with it (in the interpreter)."""

import struct

import pytest
import torch
import triton
import triton.language as tl

from plugins import _tiles

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def _bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


@pytest.mark.parametrize("c", range(4))
def test_code_pair_arithmetic_decodes_every_pair(c):
    """Codes c and c + 4 of a word (the others random): AND with the pair's mask, multiply
    by 2^a + 2^b (mod 2^32), AND with PAIR_KEEP -> BF16 halves E2M1(code) * 2^-126."""
    gen = torch.Generator().manual_seed(c)
    mask = (_tiles.PAIR_MASK_EVEN if c % 2 == 0 else _tiles.PAIR_MASK_ODD).value
    mul = (_tiles.PAIR_MUL_EVEN if c % 2 == 0 else _tiles.PAIR_MUL_ODD).value
    for low in range(16):
        for high in range(16):
            other = int(torch.randint(0, 1 << 32, (1,), generator=gen))
            word = other & ~((0xF << 4 * c) | (0xF << 4 * (c + 4))) & 0xFFFFFFFF
            word |= low << 4 * c | high << 4 * (c + 4)
            src = word >> 8 if c >= 2 else word
            t = ((src & mask) * mul) & 0xFFFFFFFF & _tiles.PAIR_KEEP
            got = (_bf16(t & 0xFFFF) * 2.0**126, _bf16(t >> 16) * 2.0**126)
            assert got == (_e2m1(low), _e2m1(high)), f"word {word:#010x}, c={c}"


@triton.jit
def _activations_kernel(a_ptr, out_ptr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    a = _tiles.nvfp4_activations(tl.load(a_ptr + offs), True, _tiles.A_SIDE_PAIRS, BLOCK_M,
                                 BLOCK_K)
    tl.store(out_ptr + offs, a)


@pytest.mark.kernel
def test_activations_take_the_code_pair_order():
    """Position 8w + 2c + j of the permuted activations holds k = 8w + c + 4j, where the
    code-pair tile holds code c + 4j of word w."""
    from kernel_cases import KERNEL_DEVICE

    bm, bk = 8, 32
    a = torch.arange(bm * bk, dtype=torch.float32).view(bm, bk).to(KERNEL_DEVICE)
    out = torch.empty_like(a)
    _activations_kernel[(1,)](a, out, BLOCK_M=bm, BLOCK_K=bk)
    w, c, j = torch.meshgrid(torch.arange(bk // 8), torch.arange(4), torch.arange(2),
                             indexing="ij")
    positions, ks = (8 * w + 2 * c + j).flatten(), (8 * w + c + 4 * j).flatten()
    assert torch.equal(out.cpu()[:, positions], a.cpu()[:, ks])
