"""Decoders (numba) of the 256-element super-blocks whose dot products are one integer sum
per block against Q8_K: the IQ grid formats (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
IQ1_M) and the ternary ones (TQ1_0, TQ2_0).

:func:`decode` turns a block's bytes into what ggml's generic C multiplies the activations
by: 256 signed integers (int8), one integer scale per 16 values (int32; 1 where the format
has none) and the float32 block scale ``d``. The matmul loops of
:mod:`qllama.backends.numpy.kernels.matmul` then take ``bsum = sum_s scale[s] * sum(q * y.qs)``
(exact) and combine ``(d*y.d) * (bsum * isum_scale(fmt))`` in block order, the row's float
sum times ``row_scale(fmt)``: the same integers as each format's
:meth:`~qllama.quants.base.QuantType.integer_form`, so the same float32 values as the oracle.

The IQ1 formats' values are ``grid + delta`` with ``delta = +-1/8``: they are decoded as eight
times that, ``8*grid +- 1``, and their block sums scaled by ``1/8`` (exact), as their
integer forms do. Each format a constant of its own kernel, so every branch on it folds away.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from qllama.backends.numpy.kernels.simd import half_to_float
from qllama.ggml_types import GGMLType
from qllama.jit import INLINE
from qllama.quants import iq_grids

F32 = np.float32
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0 = (
    int(GGMLType[n])
    for n in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")
)
FORMATS = (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0)

# the grids' values as the dot products read them (numba freezes these into the code)
GRID_IQ2XXS = np.ascontiguousarray(iq_grids.IQ2XXS.ints)
GRID_IQ2XS = np.ascontiguousarray(iq_grids.IQ2XS.ints)
GRID_IQ2S = np.ascontiguousarray(iq_grids.IQ2S.ints)
GRID_IQ3XXS = np.ascontiguousarray(iq_grids.IQ3XXS.ints)
GRID_IQ3S = np.ascontiguousarray(iq_grids.IQ3S.ints)
GRID_IQ1S = np.ascontiguousarray(iq_grids.IQ1S.ints)
KSIGNS = iq_grids.parity_signs(np.arange(128))  # 7 sign bits -> 8, the 8th their parity
POW3 = np.array([1, 3, 9, 27, 81], np.int32)  # TQ1_0's trit n of a byte: byte * 3**n


def _words(values: np.ndarray) -> np.ndarray:
    """``(n, 8)`` or ``(n, 4)`` int8 rows -> one little-endian word each (uint64 / uint32):
    a grid point's values in one load and one store."""
    v = np.ascontiguousarray(values.astype(np.int8))
    return v.view(np.uint64 if v.shape[1] == 8 else np.uint32)[:, 0].copy()


def _sign_masks(bits: int, width: int) -> np.ndarray:
    """For every sign pattern of ``bits`` bits: 0xFF in each byte whose bit is set, as one
    word of ``width`` bytes (bit i -> byte i)."""
    pattern = np.arange(1 << bits)[:, None] >> np.arange(width) & 1
    return _words(-pattern.astype(np.int8))  # -1 = 0xFF where set


# Grid points as words, and sign patterns as byte masks m: a point's signed values are
# (g ^ m) + (m & 0x01..01), byte by byte (every grid value of IQ2 and IQ3 is nonzero, so no
# byte carries into the next).
WORDS_IQ2XXS = _words(GRID_IQ2XXS)
WORDS_IQ2XS = _words(GRID_IQ2XS)
WORDS_IQ2S = _words(GRID_IQ2S)
WORDS_IQ3XXS = _words(GRID_IQ3XXS)
WORDS_IQ3S = _words(GRID_IQ3S)
MASK8 = _sign_masks(8, 8)  # a sign byte -> its 8 byte masks
MASK4 = _sign_masks(4, 4)  # a sign nibble -> its 4 byte masks
MASK_KSIGNS = MASK8[KSIGNS]  # 7 stored sign bits -> the 8 masks, the 8th their parity
# IQ1: each value times 8, plus the delta's sign: 8*grid + 1 and 8*grid - 1
WORDS_IQ1_PLUS = _words(8 * GRID_IQ1S + 1)
WORDS_IQ1_MINUS = _words(8 * GRID_IQ1S - 1)
ONES64 = np.uint64(0x0101010101010101)
ONES32 = np.uint32(0x01010101)


@njit(**INLINE)
def type_size(fmt: int) -> int:
    """Bytes of one 256-block of ``fmt``."""
    if fmt == IQ2_XXS:
        return 66
    if fmt == IQ2_XS:
        return 74
    if fmt == IQ2_S:
        return 82
    if fmt == IQ3_XXS:
        return 98
    if fmt == IQ3_S:
        return 110
    if fmt == IQ1_S:
        return 50
    if fmt == IQ1_M:
        return 56
    if fmt == TQ1_0:
        return 54
    return 66  # TQ2_0


@njit(**INLINE)
def row_scale(fmt: int) -> np.float32:
    """ggml's factor on a row's float sum: IQ2 ``0.125``, IQ3_XXS ``0.25``, else 1."""
    if fmt == IQ2_XXS or fmt == IQ2_XS or fmt == IQ2_S:
        return F32(0.125)
    if fmt == IQ3_XXS:
        return F32(0.25)
    return F32(1)


@njit(**INLINE)
def isum_scale(fmt: int) -> np.float32:
    """The factor on a block's integer sum: ``1/8`` for the IQ1 formats (decoded times 8)."""
    if fmt == IQ1_S or fmt == IQ1_M:
        return F32(0.125)
    return F32(1)


@njit(**INLINE)
def _signed8(q64, w, words, index, mask):
    """Word ``w`` of ``q64``: grid point ``index``'s 8 values negated where ``mask`` is 0xFF."""
    q64[w] = (words[index] ^ mask) + (mask & ONES64)


@njit(**INLINE)
def _signed4(q32, w, words, index, mask):
    """Word ``w`` of ``q32``: grid point ``index``'s 4 values negated where ``mask`` is 0xFF."""
    q32[w] = (words[index] ^ mask) + (mask & ONES32)


@njit(**INLINE)
def _u32(raw, o):
    """The little-endian u32 at byte ``o``, as int64."""
    return int(raw[o]) | (int(raw[o + 1]) << 8) | (int(raw[o + 2]) << 16) | (int(raw[o + 3]) << 24)


@njit(**INLINE)
def _u16(raw, o):
    """The little-endian u16 at byte ``o``, as int64."""
    return int(raw[o]) | (int(raw[o + 1]) << 8)


@njit(**INLINE)
def _scales_per_32(sc, b, s):
    """Sub-block scale ``s`` for both 16s of 32-block ``b``."""
    sc[2 * b] = s
    sc[2 * b + 1] = s


@njit(**INLINE)
def decode(raw, off, fmt, q, sc, half):
    """The 256-block at byte ``off``: its signed integers into ``q`` (256 int8), the integer
    scale of each 16 values into ``sc`` (16 int32); returns its float32 ``d``. ``half`` is
    2 bytes of scratch (IQ1_M assembles its fp16 ``d`` there)."""
    q64 = q.view(np.uint64)
    q32 = q.view(np.uint32)
    if fmt == IQ2_XXS:
        for b in range(8):  # 8 bytes a 32-block: 4 grid indices, then signs and scale
            o = off + 2 + 8 * b
            aux = _u32(raw, o + 4)
            for g in range(4):
                mask = MASK_KSIGNS[(aux >> (7 * g)) & 127]
                _signed8(q64, 4 * b + g, WORDS_IQ2XXS, raw[o + g], mask)
            _scales_per_32(sc, b, 2 * (aux >> 28) + 1)
        return half_to_float(raw, off)
    if fmt == IQ3_XXS:
        for b in range(8):  # 8 grid indices of 4 values, then a u32 of signs and scale
            aux = _u32(raw, off + 66 + 4 * b)
            for g in range(4):  # 8 values: two grid points under one sign byte
                signs = int(KSIGNS[(aux >> (7 * g)) & 127])
                o = off + 2 + 8 * b + 2 * g
                w = 8 * b + 2 * g
                _signed4(q32, w, WORDS_IQ3XXS, raw[o], MASK4[signs & 15])
                _signed4(q32, w + 1, WORDS_IQ3XXS, raw[o + 1], MASK4[signs >> 4])
            _scales_per_32(sc, b, 2 * (aux >> 28) + 1)
        return half_to_float(raw, off)
    if fmt == IQ3_S:
        for g in range(64):  # groups of 4: index bit 8 in qh, a sign byte per 8 values
            hi = (raw[off + 66 + g // 8] >> (g % 8)) & 1
            index = int(raw[off + 2 + g]) | (int(hi) << 8)
            signs = (int(raw[off + 74 + g // 2]) >> (4 * (g % 2))) & 15
            _signed4(q32, g, WORDS_IQ3S, index, MASK4[signs])
        for b in range(8):
            s = (raw[off + 106 + b // 2] >> (4 * (b % 2))) & 15
            _scales_per_32(sc, b, 2 * int(s) + 1)
        return half_to_float(raw, off)
    if fmt == IQ2_XS or fmt == IQ2_S:
        for g in range(32):  # groups of 8
            if fmt == IQ2_XS:
                word = _u16(raw, off + 2 + 2 * g)
                _signed8(q64, g, WORDS_IQ2XS, word & 511, MASK_KSIGNS[word >> 9])
            else:
                hi = (raw[off + 66 + g // 4] >> (2 * (g % 4))) & 3
                index = int(raw[off + 2 + g]) | (int(hi) << 8)
                _signed8(q64, g, WORDS_IQ2S, index, MASK8[raw[off + 34 + g]])
        base = off + (66 if fmt == IQ2_XS else 74)
        for b in range(8):
            s = raw[base + b]
            sc[2 * b] = 2 * int(s & 15) + 1
            sc[2 * b + 1] = 2 * int(s >> 4) + 1
        return half_to_float(raw, off)
    if fmt == IQ1_S:
        for b in range(8):  # a u16 per 32-block: index bits 8-10 of its 4 groups, scale, delta
            qh = _u16(raw, off + 34 + 2 * b)
            words = WORDS_IQ1_MINUS if qh >> 15 else WORDS_IQ1_PLUS
            for g in range(4):
                index = int(raw[off + 2 + 4 * b + g]) | (((qh >> (3 * g)) & 7) << 8)
                q64[4 * b + g] = words[index]
            _scales_per_32(sc, b, 2 * ((qh >> 12) & 7) + 1)
        return half_to_float(raw, off)
    if fmt == IQ1_M:
        for g in range(32):  # qh: a nibble per group, index bits 8-10 and the delta's sign
            nib = int(raw[off + 32 + g // 2]) >> (4 * (g % 2))
            index = int(raw[off + g]) | ((nib & 7) << 8)
            q64[g] = WORDS_IQ1_MINUS[index] if nib & 8 else WORDS_IQ1_PLUS[index]
        bits = 0
        for c in range(4):  # four u16: 3-bit scales of 16-blocks 4c..4c+3, a nibble of d
            word = _u16(raw, off + 48 + 2 * c)
            for i in range(4):
                sc[4 * c + i] = 2 * ((word >> (3 * i)) & 7) + 1
            bits |= (word >> 12) << (4 * c)
        half[0] = bits & 255
        half[1] = bits >> 8
        return half_to_float(half, 0)
    if fmt == TQ2_0:
        for h in range(2):  # element 128h + 32l + m: bits 2l of byte 32h + m
            for m in range(32):
                byte = int(raw[off + 32 * h + m])
                for lv in range(4):
                    q[128 * h + 32 * lv + m] = ((byte >> (2 * lv)) & 3) - 1
        sc[:] = 1
        return half_to_float(raw, off + 64)
    # TQ1_0: trit n of a byte is ((uint8)(byte * 3**n) * 3) >> 8
    for m in range(32):  # elements m + 32n
        byte = int(raw[off + m])
        for n in range(5):
            q[m + 32 * n] = ((((byte * POW3[n]) & 255) * 3) >> 8) - 1
    for m in range(16):  # elements 160 + m + 16n
        byte = int(raw[off + 32 + m])
        for n in range(5):
            q[160 + m + 16 * n] = ((((byte * POW3[n]) & 255) * 3) >> 8) - 1
    for j in range(4):  # elements 240 + j + 4n
        byte = int(raw[off + 48 + j])
        for n in range(4):
            q[240 + j + 4 * n] = ((((byte * POW3[n]) & 255) * 3) >> 8) - 1
    sc[:] = 1
    return half_to_float(raw, off + 52)
