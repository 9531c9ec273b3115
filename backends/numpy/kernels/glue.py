"""Compiled (numba) forms of the model's glue: RMSNorm, RoPE, SwiGLU, attention's softmax and a
mixture's weighted sum of its slots.

Each gives the bits of the model's array-API form on numpy (qllama.runtime.model and
qllama.runtime.scores) in one call instead of a handful of numpy dispatches, which is most of
what a small model's decode step costs outside the products. Two pieces of numpy are stated
here so that the numbers stay the same:

- **numpy's float32 sum** (``add.reduce`` along a contiguous axis, what ``mean`` and ``sum``
  call): pairwise, blocks of at most 128 elements summed in 8 interleaved accumulators,
  ``((r0+r1)+(r2+r3)) + ((r4+r5)+(r6+r7))``, then the remainder one by one; a longer run is
  split in two at a multiple of 8 near its middle (numpy's ``pairwise_sum``).
- **numpy's float32 exp** on x86 with AVX2+FMA or AVX-512 (``simd_exp_FLOAT``): the argument
  reduced by k = rint(x log2 e) with a two-part ln 2 (FMAs), a rational approximation P5/Q2 of
  the rest (FMAs, one division), scaled by 2^k; inf from 88.7228, 0 from -103.972. That is
  not libm's expf (the two differ on a third of all inputs); elsewhere numpy calls libm, and
  :func:`qllama.backends.numpy.dispatch.glue_exact` then finds the kernels' exp different and
  the model keeps its array-API forms.

Everything else is elementwise float32 arithmetic in the array-API forms' order (numba does
not contract ``a*b + c`` into an FMA without fastmath, and none is asked for here).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from qllama.backends.numpy.kernels.flash import fma32
from qllama.jit import INLINE, JIT

F32 = np.float32
PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE

# numpy's constants for its float32 exp (npy_simd_data.h, npy_math.h), rounded to float32
EXP_MAX = F32(88.72283935546875)
EXP_MIN = F32(-103.97208404541015625)
LOG2E = F32(1.442695040888963407359924681001892137)
RINT_MAGIC = F32(12582912.0)  # 1.5 * 2^23: adding it rounds to an integer
LN2_HIGH = F32(-6.93145752e-1)  # -ln 2 in two parts (Cody and Waite)
LN2_LOW = F32(-1.42860677e-6)
P0, P1, P2 = (
    F32(9.999999999980870924916e-01),
    F32(7.257664613233124478488e-01),
    F32(2.473615434895520810817e-01),
)
P3, P4, P5 = (
    F32(5.114512081637298353406e-02),
    F32(6.757896990527504603057e-03),
    F32(5.082762527590693718096e-04),
)
Q0, Q1, Q2 = F32(1.0), F32(-2.742335390411667452936e-01), F32(2.159509375685829852307e-02)
ONE = F32(1.0)
ZERO = F32(0.0)
INF = F32(np.inf)
# scores.NEGLIGIBLE as a float32, as numpy compares a float32 array with it
NEGLIGIBLE = F32(-76.24869)


@intrinsic
def _pow2(typingctx: object, k: object) -> object:
    """2^k as a float32 for an int32 ``k`` in [-126, 127]: the exponent field written."""
    sig = types.float32(types.int32)

    def codegen(context: object, builder: ir.IRBuilder, signature: object, args: list) -> object:
        i32 = ir.IntType(32)
        field = builder.shl(builder.add(args[0], ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(field, ir.FloatType())

    return sig, codegen


@njit(**INLINE)
def np_expf(x: float) -> float:
    """numpy's float32 exp of ``x`` (a float32) on x86 AVX2+FMA / AVX-512 hosts. Written
    without branches, so that a loop of it vectorizes."""
    nan, over, under = x != x, x >= EXP_MAX, x <= EXP_MIN
    x0 = ZERO if nan or over or under else x  # numpy zeroes these lanes before the polynomial
    k = (x0 * LOG2E + RINT_MAGIC) - RINT_MAGIC  # rint(x log2 e), in [-150, 128]
    r = fma32(k, LN2_LOW, fma32(k, LN2_HIGH, x0))
    num = fma32(fma32(fma32(fma32(fma32(P5, r, P4), r, P3), r, P2), r, P1), r, P0)
    den = fma32(fma32(Q2, r, Q1), r, Q0)
    # poly * 2^k with one rounding (AVX-512's scalef): 2^a exactly, then 2^b rounds once where
    # the result is subnormal; a and b in [-75, 64], so both powers are normal floats
    ki = np.int32(k)
    a = ki >> np.int32(1)
    y = (num / den) * _pow2(a) * _pow2(ki - a)
    y = INF if over else y
    y = ZERO if under else y
    return x if nan else y


@njit(**JIT)
def exp_all(x: np.ndarray) -> np.ndarray:
    """:func:`np_expf` of each element of ``x`` (1-D float32)."""
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = np_expf(x[i])
    return out


@njit(**INLINE)
def _term(a: np.ndarray, i: int, square: bool) -> float:
    v = a[i]
    return v * v if square else v


@njit(**JIT)
def _block_sum(a: np.ndarray, off: int, n: int, square: bool) -> np.float32:
    """numpy's pairwise sum of ``a[off:off+n]`` (or of its squares), ``n <= 128``."""
    if n < 8:
        res = ZERO
        for i in range(n):
            res += _term(a, off + i, square)
        return res
    r0, r1 = _term(a, off, square), _term(a, off + 1, square)
    r2, r3 = _term(a, off + 2, square), _term(a, off + 3, square)
    r4, r5 = _term(a, off + 4, square), _term(a, off + 5, square)
    r6, r7 = _term(a, off + 6, square), _term(a, off + 7, square)
    i = 8
    while i < n - n % 8:
        b = off + i
        r0 += _term(a, b, square)
        r1 += _term(a, b + 1, square)
        r2 += _term(a, b + 2, square)
        r3 += _term(a, b + 3, square)
        r4 += _term(a, b + 4, square)
        r5 += _term(a, b + 5, square)
        r6 += _term(a, b + 6, square)
        r7 += _term(a, b + 7, square)
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += _term(a, off + i, square)
        i += 1
    return res


@njit(**JIT)
def pairwise_sum(a: np.ndarray, off: int, n: int, square: bool) -> float:
    """numpy's float32 ``add.reduce`` of ``a[off:off+n]`` (1-D, or of its squares): a run of
    more than 128 is split at ``n/2`` less its remainder mod 8 and its halves' sums added.
    The recursion runs on a stack of its own (numba's disk cache breaks recursive functions)."""
    if n <= PAIRWISE_BLOCK:
        return _block_sum(a, off, n, square)
    depth = 64  # each split halves n: far more levels than any array has
    offs, ns, stage = np.empty(depth, np.int64), np.empty(depth, np.int64), np.empty(depth, np.int8)
    sums = np.empty(depth, np.float32)
    top, held = 0, 0  # frames on the stack; partial sums held
    offs[0], ns[0], stage[0] = off, n, 0
    while top >= 0:
        o, m = offs[top], ns[top]
        if m <= PAIRWISE_BLOCK:
            sums[held] = _block_sum(a, o, m, square)
            held += 1
            top -= 1
            continue
        half = m // 2
        half -= half % 8
        if stage[top] == 2:  # both halves summed: left + right
            sums[held - 2] = sums[held - 2] + sums[held - 1]
            held -= 1
            top -= 1
            continue
        first = stage[top] == 0
        stage[top] += 1
        top += 1
        offs[top], ns[top], stage[top] = (o, half, 0) if first else (o + half, m - half, 0)
    return sums[0]


@njit(**JIT)
def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    """``out = x * (1 / sqrt(mean(x^2) + eps)) * w`` over rows of ``x`` (T, D), as the
    model's ``rms_norm`` on numpy: the mean is the pairwise float32 sum divided in float64 by
    the count (``mean`` divides by an ``intp``) and rounded to float32."""
    T, D = x.shape
    for t in range(T):
        row = x[t]
        ms = F32(np.float64(pairwise_sum(row, 0, D, True)) / np.float64(D))
        scale = ONE / np.sqrt(ms + F32(eps))
        for d in range(D):
            out[t, d] = row[d] * scale * w[d]


@njit(**JIT)
def rope_pairs(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray) -> None:
    """The model's ``rope`` (adjacent pairs) of ``x`` (T, H, D) by angles (T, D/2)."""
    T, H, D = x.shape
    for t in range(T):
        for h in range(H):
            for i in range(D // 2):
                x0, x1 = x[t, h, 2 * i], x[t, h, 2 * i + 1]
                c, s = cos[t, i], sin[t, i]
                out[t, h, 2 * i] = x0 * c - x1 * s
                out[t, h, 2 * i + 1] = x0 * s + x1 * c


@njit(**JIT)
def rope_halves(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray) -> None:
    """The model's ``rope_halves`` (the pairs i, i + D/2) of ``x`` (T, H, D) by angles (T, D/2)."""
    T, H, D = x.shape
    half = D // 2
    for t in range(T):
        for h in range(H):
            for i in range(half):
                x0, x1 = x[t, h, i], x[t, h, half + i]
                c, s = cos[t, i], sin[t, i]
                out[t, h, i] = x0 * c - x1 * s
                out[t, h, half + i] = x0 * s + x1 * c


@njit(**JIT)
def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """``silu(gate) * up`` elementwise on 1-D views, silu as the model writes it:
    ``g * (1 / (1 + exp(-g)))``."""
    for i in range(gate.shape[0]):
        g = gate[i]
        out[i] = g * (ONE / (ONE + np_expf(-g))) * up[i]


@njit(**JIT)
def slot_sum(y: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """``out[t] = y[t, 0] * w[t, 0] + y[t, 1] * w[t, 1] + ...`` for ``y`` (T, k, n) and ``w``
    (T, k): each product rounded, then added slot after slot, as the model's ``slot_sum``."""
    T, k, n = y.shape
    for t in range(T):
        for j in range(n):
            out[t, j] = y[t, 0, j] * w[t, 0]
        for s in range(1, k):
            ws = w[t, s]
            for j in range(n):
                out[t, j] = out[t, j] + y[t, s, j] * ws


@njit(**INLINE)
def _softmax_row(
    scores: np.ndarray, scale: float, mask: np.ndarray, out: np.ndarray, r: int, i: int
) -> None:
    """Row ``(r, i)`` of :func:`masked_softmax`."""
    S = scores.shape[2]
    e = np.empty(S, np.float32)
    top = -INF
    for j in range(S):
        v = scores[r, i, j] * scale + mask[i, j]
        e[j] = v
        top = max(top, v)
    for j in range(S):
        d = e[j] - top
        e[j] = ZERO if d < NEGLIGIBLE else np_expf(d)
    total = pairwise_sum(e, 0, S, False)
    for j in range(S):
        out[r, i, j] = e[j] / total


@njit(**JIT)
def masked_softmax(scores: np.ndarray, scale: float, mask: np.ndarray, out: np.ndarray) -> None:
    """``softmax(scores * scale + mask)`` over the last axis, as qllama.runtime.scores does
    it: max-subtracted, terms below NEGLIGIBLE dropped, exp divided by the pairwise sum.
    ``scores`` (R, t, S) rows of queries, ``mask`` (t, S): row ``(r, i)`` reads mask row i."""
    R, t = scores.shape[0], scores.shape[1]
    for r in range(R):
        for i in range(t):
            _softmax_row(scores, F32(scale), mask, out, r, i)


@njit(**JIT, parallel=True)
def masked_softmax_threads(
    scores: np.ndarray, scale: float, mask: np.ndarray, out: np.ndarray
) -> None:
    """:func:`masked_softmax` with its rows spread over numba's threads (a prefill tile's)."""
    R, t = scores.shape[0], scores.shape[1]
    for rt in prange(R * t):
        _softmax_row(scores, F32(scale), mask, out, rt // t, rt % t)
