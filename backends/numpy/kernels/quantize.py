"""Activation quantizers for the compiled CPU kernels: numba ports of qllama's numpy ones.

ggml's CPU quantizes each activation row to the weight's ``vec_dot_type`` before the dot
products: Q8_0 / Q8_1 (``quantize_row_q8_*_ref``, ties away from zero, or the AVX2 kernels,
ties to even, with their lane tree for the largest |x|) and Q8_K. These give the same
bytes as :func:`qllama.quants.quantize` (checked in ``tests/test_cpu_kernels.py``), NaN,
infinity, subnormal and overflow behaviour included, and are called by the kernels of
:mod:`qllama.backends.numpy.kernels.matmul` once per matmul, row by row.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from qllama.backends.numpy.kernels.simd import HALF, bits_float, float_bits, round_to_half
from qllama.jit import INLINE, JIT

F32 = np.float32
INT32_MIN = np.int32(-(2**31))
TWO31 = np.float32(2.0**31)
MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: ggml's nearest_int
QNAN_POS = np.int32(0x7FC00000)  # ggml's fp16 quiet NaN 0x7e00, widened
QNAN_NEG = np.int32(-4194304)  # 0xFFC00000
ABS_MASK = np.int32(0x7FFFFFFF)
INF_BITS = np.int32(0x7F800000)


# --- scalar primitives (ports of qllama.quants.rounding) ---------------------------------------


@njit(**INLINE)
def _fp16_bits(x):
    """ggml's ``ggml_compute_fp32_to_fp16`` (nearest even, overflow to inf, NaN to 0x7e00),
    in float32 and integer operations: for hosts without fp16 conversions."""
    w = np.int64(float_bits(x)) & 0xFFFFFFFF
    base = (abs(x) * bits_float(np.int32(0x77800000))) * bits_float(np.int32(0x08800000))
    shl1 = (w + w) & 0xFFFFFFFF
    bias = max(int(shl1 & 0xFF000000), 0x71000000)
    base = bits_float(np.int32((bias >> 1) + 0x07800000)) + base
    bits = np.int64(float_bits(base)) & 0xFFFFFFFF
    nonsign = ((bits >> 13) & 0x7C00) + (bits & 0x0FFF)
    return ((w & 0x80000000) >> 16) | (0x7E00 if shl1 > 0xFF000000 else nonsign)


@njit(**INLINE)
def _widen_fp16(h):
    """fp16 bits -> float32 (exact), in integer operations."""
    o = (h & 0x7FFF) << 13
    e = o & (0x7C00 << 13)
    o += 112 << 23
    if e == 0x7C00 << 13:
        o += 112 << 23
    elif e == 0:
        o = np.int64(
            float_bits(bits_float(np.int32(o + (1 << 23))) - bits_float(np.int32(113 << 23)))
        )
    return bits_float(np.int32(o | ((h & 0x8000) << 16)))


@njit(**INLINE)
def _half(x: float) -> float:
    """What ggml stores for a float32 scale as fp16, widened back (NaN: quiet, signed)."""
    if x != x:
        return bits_float(QNAN_NEG if float_bits(x) < 0 else QNAN_POS)
    if HALF:
        return round_to_half(x)
    return _widen_fp16(_fp16_bits(x))


@njit(**INLINE)
def _c_int32(t: float) -> np.int32:
    """x86's float -> int32 cast: truncation; NaN and out-of-range give INT32_MIN."""
    if t >= -TWO31 and t < TWO31:
        return np.int32(t)
    return INT32_MIN


@njit(**INLINE)
def _round_away(x: float) -> float:
    """C ``roundf`` in float32."""
    a = abs(x)
    if np.isinf(a):
        return x
    fl = np.floor(a)
    return np.copysign(fl + np.floor(F32(2) * (a - fl)), x)


@njit(**INLINE)
def _nearest_int(x: float) -> np.int32:
    """ggml's ``nearest_int`` bit trick."""
    return (float_bits(x + MAGIC) & np.int32(0x007FFFFF)) - np.int32(0x00400000)


@njit(**INLINE)
def _clamp8(v: np.int32) -> np.int32:
    """``v`` in [-128, 127]. Conditionals, not numba's ``min``/``max``: those are calls out
    of the loop's function, which keep LLVM from vectorizing the loop (q8k_row's loops, so
    written, took a 1536-wide row from 4.8 to 1.2 us)."""
    v = v if v < np.int32(127) else np.int32(127)
    return v if v > np.int32(-128) else np.int32(-128)


@njit(**INLINE)
def _maxps(p: float, q: float) -> float:
    return p if p > q else q


# --- activation quantizers ---------------------------------------------------------------------

# At least this many tokens: quantize and multiply with the token-tiled loops, in parallel.
TOKEN_TILE = 16


@njit(**JIT)
def _q8_block(x, o, simd, qs):
    """One 32-block of Q8_0 / Q8_1: writes ``qs[o:o+32]``; returns (f32 d, int32 sum)."""
    if simd:
        m = np.empty(8, np.float32)
        for i in range(8):
            m[i] = _maxps(
                _maxps(_maxps(abs(x[o + i]), abs(x[o + 8 + i])), abs(x[o + 16 + i])),
                abs(x[o + 24 + i]),
            )
        # the AVX2 kernel's lane tree, in its order (maxps keeps its second operand on NaN)
        m0 = _maxps(_maxps(m[4], m[0]), _maxps(m[6], m[2]))
        m1 = _maxps(_maxps(m[5], m[1]), _maxps(m[7], m[3]))
        amax = _maxps(m0, m1)
        iscale = F32(127) / amax if amax != 0 else F32(0)
        total = 0
        for j in range(32):
            v = _c_int32(np.rint(x[o + j] * iscale))
            total += v
            qs[o + j] = _clamp8(v)
        return amax / F32(127), np.int32(total)  # the int32 lane sums wrap
    amax = F32(0)
    for j in range(32):
        a = abs(x[o + j])
        amax = amax if amax > a else a  # C MAX: a NaN replaces the running max
    d = amax / F32(127)
    inv = F32(1) / d if d != 0 else F32(0)
    total = 0
    for j in range(32):
        v = np.int8(_c_int32(_round_away(x[o + j] * inv)))
        qs[o + j] = v
        total += int(v)  # a NaN's block, rare: not worth the vectorizing (q8_row's note)
    return d, np.int32(total)


@njit(**INLINE)
def _abs_bits(x: float) -> np.int32:
    """|x| as an int32 whose order is that of the non-NaN floats (NaN: above 0x7F800000)."""
    return float_bits(x) & ABS_MASK


@njit(**JIT)
def q8_row(flat, t, k, simd, with_sum, qs, d, s):
    """Token ``t`` of Q8_0 / Q8_1: its blocks' codes, stored d and (Q8_1) stored s.

    Blocks without NaN take a vectorizable path: the largest |x| from an integer max of
    the bits (any order gives it), then each element on its own, the codes summed as
    ``np.int32(v)`` (numba's ``int(v)`` of an int8 kept LLVM from vectorizing the loop: a
    1024-wide row took 3.5-3.9 us, now 1.5-1.8, one thread). The row is read through a slice
    of its own, whose indices LLVM knows are not negative: numba wraps a negative index at
    every access otherwise, which kept the loops scalar. A block with a NaN, where the order
    of ggml's scans decides the result, takes :func:`_q8_block`'s exact scans.
    """
    xs, q = flat[t * k : (t + 1) * k], qs[t * k : (t + 1) * k]  # (K,) each
    for b in range(k // 32):
        o = b * 32
        top = np.int32(0)
        for j in range(32):
            v = _abs_bits(xs[o + j])
            top = v if v > top else top
        if top > INF_BITS:
            df, total = _q8_block(xs, o, simd, q)
        else:
            amax = bits_float(np.int32(top))
            total = 0
            if simd:
                df = amax / F32(127)
                iscale = F32(127) / amax if amax != 0 else F32(0)
                for j in range(32):
                    v = _c_int32(np.rint(xs[o + j] * iscale))
                    total += v
                    q[o + j] = _clamp8(v)
                total = np.int32(total)  # the int32 lane sums wrap
            else:
                df = amax / F32(127)
                inv = F32(1) / df if df != 0 else F32(0)
                for j in range(32):
                    v = np.int8(_c_int32(_round_away(xs[o + j] * inv)))
                    q[o + j] = v
                    total += np.int32(v)
        d[t, b] = _half(df)
        if with_sum:
            s[t, b] = _half(np.float32(np.int32(total)) * df)


@njit(**JIT)
def q8k_row(flat, t, k, qs, d, bsums):
    """Token ``t`` of Q8_K: codes, the float32 d of each 256, the sums of each 16.

    ggml takes the first strictly largest |x| (NaN never wins): the integer max of the
    bits of the non-NaN |x|, then the first element that has it. Each step is a loop over
    the 256 on its own, written for LLVM to vectorize (conditionals, int32 throughout)."""
    xs, q = flat[t * k : (t + 1) * k], qs[t * k : (t + 1) * k]  # (K,) each
    for b in range(k // 256):
        o = b * 256
        top_bits = np.int32(0)
        for j in range(o, o + 256):
            v = _abs_bits(xs[j])
            v = v if v <= INF_BITS else np.int32(0)
            top_bits = v if v > top_bits else top_bits
        first = o + 256
        for j in range(o, o + 256):
            first = j if _abs_bits(xs[j]) == top_bits and j < first else first
        top = xs[first] if top_bits > 0 else F32(0)
        iscale = F32(0) if top == 0 else F32(-127) / top
        d[t, b] = F32(0) if top == 0 else F32(1) / iscale
        for j in range(o, o + 256):
            v = _nearest_int(iscale * xs[j])
            q[j] = np.int8(v if v < np.int32(127) else np.int32(127))  # wraps below -128
        for g in range(16):
            acc = np.int32(0)
            for j in range(o + 16 * g, o + 16 * g + 16):
                acc += np.int32(q[j])
            bsums[t, b * 16 + g] = acc


@njit(**JIT, parallel=True)
def quantize_q8(x, simd, with_sum):
    """Q8_0 (``with_sum`` False) or Q8_1 rows of ``x`` (T, K): int8 ``qs`` (T*K,) and the
    stored ``d`` and ``s`` (T, K/32), as float32."""
    tokens, k = x.shape
    qs = np.empty(tokens * k, np.int8)
    d = np.empty((tokens, k // 32), np.float32)
    s = np.empty((tokens, k // 32 if with_sum else 0), np.float32)
    flat = x.reshape(-1)
    if tokens >= TOKEN_TILE:
        for t in prange(tokens):
            q8_row(flat, t, k, simd, with_sum, qs, d, s)
    else:  # waking threads costs more than a few rows
        for t in range(tokens):
            q8_row(flat, t, k, simd, with_sum, qs, d, s)
    return qs, d, s


@njit(**JIT, parallel=True)
def quantize_q8_k(x):
    """Q8_K rows of ``x`` (T, K): int8 ``qs`` (T*K,), float32 ``d`` (T, K/256) and the
    sums of each 16 values, int32 (T, K/16)."""
    tokens, k = x.shape
    qs = np.empty(tokens * k, np.int8)
    d = np.empty((tokens, k // 256), np.float32)
    bsums = np.empty((tokens, k // 16), np.int32)
    flat = x.reshape(-1)
    if tokens >= TOKEN_TILE:
        for t in prange(tokens):
            q8k_row(flat, t, k, qs, d, bsums)
    else:
        for t in range(tokens):
            q8k_row(flat, t, k, qs, d, bsums)
    return qs, d, bsums
