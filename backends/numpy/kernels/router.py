"""Compiled (numba) form of the router's ops of ggml's CPU arithmetic: ``soft_max`` and
``sum_rows`` as :mod:`qllama.backends.numpy.router` states them in numpy, the same bits in one
call a layer instead of some forty numpy dispatches (a MoE decode step's router cost more
than its experts' products); and :func:`route`, a layer's whole routing (the softmax, the top
k, the weights) in one call.

Per lane, ``ggml_v_expf`` of the AVX2 build (2^n built into the exponent bits, a scale split
in two past |n| > 126) or of the AVX-512 one (``scalef``: libm's ``ldexpf``, one rounding); the
block's horizontal sum in the build's tree; libm's ``expf`` for the scalar loop; the sums in
double, in order. Integer lanes wrap as the SIMD instructions do: they are computed in 64 bits
and cut to 32.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from qllama.backends.numpy.kernels.flash import as_bits, fma32, from_bits
from qllama.backends.numpy.router import (
    C1,
    C2,
    C3,
    C4,
    C5,
    LN2_HI,
    LN2_LO,
    LOG2E,
    ONE_BITS,
    SHIFTER,
)
from qllama.jit import INLINE, JIT

F32 = np.float32
U32 = np.uint32
LOW32 = 0xFFFFFFFF
ONE, ZERO, INF = F32(1.0), F32(0.0), F32(np.inf)


@njit(**INLINE)
def _poly(b: float, last: float) -> float:
    """(((C1 b + C2) u + (C3 b + C4)) u + last), u = b^2, each multiply-add fused."""
    u = F32(b * b)
    return fma32(fma32(fma32(C1, b, C2), u, fma32(C3, b, C4)), u, last)


@njit(**INLINE)
def v_expf(x: float, width: int) -> float:
    """One lane of ggml_v_expf, of the AVX2 build (``width`` 8) or the AVX-512 one (16)."""
    z = fma32(x, LOG2E, SHIFTER)
    n = F32(z - SHIFTER)
    b = fma32(-n, LN2_LO, fma32(-n, LN2_HI, x))
    if width == 16:
        if abs(n) > 192:  # ordered: a NaN n keeps the polynomial's NaN
            return ZERO if n <= 0 else INF
        scale = int(n) if abs(n) <= 192 else 0  # a whole number; not NaN's int
        return F32(math.ldexp(_poly(b, fma32(C5, b, ONE)), scale))
    e = (np.int64(as_bits(z)) << 23) & LOW32  # slli_epi32
    j = _poly(b, F32(C5 * b))
    if not abs(n) > 126:
        k = from_bits(U32((e + ONE_BITS) & LOW32))
        return fma32(j, k, k)
    g = 0x82000000 if n <= 0 else 0
    s1 = from_bits(U32((g + 0x7F000000) & LOW32))
    if abs(n) > 192:
        return F32(s1 * s1)
    s2 = from_bits(U32((e - g) & LOW32))
    return F32(fma32(s2, j, s2) * s1)


@njit(**INLINE)
def _lane(e: np.ndarray, a: int, i: int, width: int) -> np.float32:
    """Lane ``i`` of the block at ``e[a]`` as 8 float32 lanes: itself (AVX2), or itself plus
    lane ``i + 8`` (AVX-512: GCC's ``_mm512_reduce_add_ps`` adds the 256-bit halves first)."""
    return e[a + i] if width == 8 else F32(e[a + 8 + i] + e[a + i])


@njit(**INLINE)
def _block_sum(e: np.ndarray, a: int, width: int) -> np.float32:
    """The build's horizontal float32 sum of ``e[a : a + width]``: its 8 lanes (:func:`_lane`)
    folded as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))."""
    q0 = F32(_lane(e, a, 0, width) + _lane(e, a, 4, width))
    q1 = F32(_lane(e, a, 1, width) + _lane(e, a, 5, width))
    q2 = F32(_lane(e, a, 2, width) + _lane(e, a, 6, width))
    q3 = F32(_lane(e, a, 3, width) + _lane(e, a, 7, width))
    return F32(F32(q0 + q2) + F32(q1 + q3))


@njit(**JIT)
def soft_max(x: np.ndarray, simd: bool, width: int, out: np.ndarray) -> None:
    """ggml's soft_max of each float32 row of ``x`` (T, n) into ``out`` (T, n): the SIMD
    blocks of a ``width``-lane build where ``simd``, the rest (or all) by the scalar loop."""
    T, n = x.shape
    blocks = n // width * width if simd else 0
    for t in range(T):
        m = x[t, 0]
        for i in range(1, n):  # numpy's max: a NaN wins
            v = x[t, i]
            if v > m or v != v:
                m = v
        e = out[t]
        total = 0.0
        for a in range(0, blocks, width):
            for i in range(a, a + width):
                e[i] = v_expf(F32(x[t, i] - m), width)
            total += np.float64(_block_sum(e, a, width))
        for i in range(blocks, n):
            e[i] = F32(math.exp(F32(x[t, i] - m)))  # libm's expf
            total += np.float64(e[i])
        s = F32(1.0 / total)
        for i in range(n):
            e[i] = F32(e[i] * s)


@njit(**JIT)
def sum_rows(x: np.ndarray, out: np.ndarray) -> None:
    """ggml's sum_rows of float32 rows ``x`` (T, n) into ``out`` (T, 1): in order, in double."""
    for t in range(x.shape[0]):
        total = 0.0
        for i in range(x.shape[1]):
            total += np.float64(x[t, i])
        out[t, 0] = F32(total)


@njit(**JIT)
def route(
    x: np.ndarray,
    k: int,
    select_on_softmax: bool,
    norm: bool,
    scale: float,
    min_sum: float,
    ranked_past: int,
    simd: bool,
    width: int,
    selected: np.ndarray,
    weights: np.ndarray,
) -> bool:
    """build_moe_ffn's routing of float32 router logits ``x`` (T, n), the model's steps in one
    call (``qllama.runtime.model``: ``router_gate``, ``select_experts``, ``expert_weights``):
    each row's k experts into ``selected`` (T, k), the largest gated value first, equal values
    by ascending index (the gated values: :func:`soft_max` of the row where
    ``select_on_softmax``, else the logits), and their weights into ``weights`` (T, k): the
    gated values of the selected (else a :func:`soft_max` over the k selected logits),
    divided by their sum (:func:`sum_rows`'s, at least ``min_sum``) where ``norm``, times
    ``scale`` unless it is 0 or 1. Returns False, its outputs unfinished, where a row holds
    a NaN or, past ``ranked_past`` experts, its first k + 1 ranked values meet a tie (there
    ggml's sort orders equal values its own way: the model ranks that row itself)."""
    T, n = x.shape
    gated = np.empty_like(x)
    if select_on_softmax:
        soft_max(x, simd, width, gated)
    else:
        gated[:] = x
    taken = np.zeros(n, np.bool_)
    for t in range(T):
        row = gated[t]
        for i in range(n):
            if row[i] != row[i]:
                return False
            taken[i] = False
        last = -1
        for s in range(min(k + 1, n)):  # the (k+1)th only to see whether it ties the kth
            best = -1
            for i in range(n):
                if not taken[i] and (best < 0 or row[i] > row[best]):
                    best = i
            if n > ranked_past and last >= 0 and row[best] == row[last]:
                return False
            taken[best] = True
            last = best
            if s < k:
                selected[t, s] = best
                weights[t, s] = row[best]
    if not select_on_softmax:
        soft_max(weights.copy(), simd, width, weights)
    if norm:
        sums = np.empty((T, 1), F32)
        sum_rows(weights, sums)
        for t in range(T):
            total = sums[t, 0]
            if total < min_sum:
                total = F32(min_sum)
            for s in range(k):
                weights[t, s] = F32(weights[t, s] / total)
    if scale != 0.0 and scale != 1.0:
        factor = F32(scale)
        for t in range(T):
            for s in range(k):
                weights[t, s] = F32(weights[t, s] * factor)
    return True
