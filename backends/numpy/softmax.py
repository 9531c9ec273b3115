"""ggml's CPU soft_max of a row, bit for bit (``ops.cpp ggml_compute_forward_soft_max_f32``,
``vec.cpp ggml_vec_soft_max_f32``), as the router of a mixture of experts uses it.

Per row of n values (no scale, no mask)::

    max = the largest value
    SIMD blocks of 8 (AVX2): e = ggml_v_expf(x - max), the block summed in float32 by the
        AVX2 tree ((e0+e4)+(e2+e6)) + ((e1+e5)+(e3+e7)), added to a double sum
    the rest, one at a time: e = expf(x - max) (libm), added to the double sum
    out = e * (float)(1.0 / sum)

``simd=False`` is ggml's scalar loop alone (the reference C code, what
``activation_rounding="ref"`` stands for); ``simd=True`` the AVX2 build's 8-lane blocks. An
AVX-512 build sums blocks of 16 with ``_mm512_reduce_add_ps`` and its own ``ggml_v_expf``: for
rows of fewer than 8 values (the tiny test models' 4 experts) the three are the same scalar
loop; past that, not emulated here (docs/architectures.md).
"""

from __future__ import annotations

import numpy as np

from qllama.quants.rounding import fma, libm

F32, I32 = np.float32, np.int32
WIDTH = 8  # AVX2's lanes

_SHIFTER = F32(float.fromhex("0x1.8p23"))
_LOG2E = F32(float.fromhex("0x1.715476p0"))
_LN2_HI, _LN2_LO = F32(float.fromhex("0x1.62E4p-1")), F32(float.fromhex("0x1.7F7D1Cp-20"))
_C1, _C2, _C3, _C4, _C5 = (
    F32(float.fromhex("0x1.0E4020p-7")),
    F32(float.fromhex("0x1.573E2Ep-5")),
    F32(float.fromhex("0x1.555E66p-3")),
    F32(float.fromhex("0x1.FFFDB6p-2")),
    F32(float.fromhex("0x1.FFFFECp-1")),
)
_ONE_BITS = F32(1.0).view(I32)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, F32).view(I32)


def _float(i: np.ndarray) -> np.ndarray:
    return np.asarray(i, I32).view(F32)


def v_expf(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf, AVX2 (vec.h), per lane: 2^n times a polynomial of the remainder b,
    with its own handling of |n| > 126 (a scale split in two) and |n| > 192 (0 or inf)."""
    x = np.asarray(x, F32)
    z = fma(x, np.full_like(x, _LOG2E), np.full_like(x, _SHIFTER))
    n = (z - _SHIFTER).astype(F32)
    b = fma(-n, np.full_like(x, _LN2_HI), x)
    b = fma(-n, np.full_like(x, _LN2_LO), b)  # the remainder x - n ln 2, in two parts
    with np.errstate(over="ignore", invalid="ignore"):  # the lanes of another branch
        e = (_bits(z).astype(np.int64) << 23).astype(np.uint32).view(I32)  # slli_epi32: wraps
        k = _float((e.astype(np.int64) + _ONE_BITS).astype(np.uint32).view(I32))
        u = (b * b).astype(F32)
        j = fma(fma(fma(np.full_like(x, _C1), b, np.full_like(x, _C2)), u,
                    fma(np.full_like(x, _C3), b, np.full_like(x, _C4))), u,
                (_C5 * b).astype(F32))  # fmt: skip
        plain = fma(j, k, k)
        g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0)).astype(np.int64)
        s1 = _float((g + 0x7F000000).astype(np.uint32).view(I32))
        s2 = _float((e.astype(np.int64) - g).astype(np.uint32).view(I32))
        far = (s1 * s1).astype(F32)
        split = (fma(s2, j, s2) * s1).astype(F32)
    big, huge = np.abs(n) > 126, np.abs(n) > 192
    return np.where(huge, far, np.where(big, split, plain)).astype(F32)


def _tree(e: np.ndarray) -> np.ndarray:
    """The AVX2 horizontal sum of blocks (..., 8) in float32: (..., )."""
    q = (e[..., :4] + e[..., 4:]).astype(F32)  # (e0+e4, e1+e5, e2+e6, e3+e7)
    h = (q[..., :2] + q[..., 2:]).astype(F32)  # (q0+q2, q1+q3)
    return (h[..., 0] + h[..., 1]).astype(F32)


def soft_max(x: np.ndarray, *, simd: bool) -> np.ndarray:
    """ggml's soft_max over the last axis of float32 rows x (T, n): (T, n)."""
    x = np.asarray(x, F32)
    T, n = x.shape
    d = (x - x.max(axis=-1, keepdims=True)).astype(F32)  # (T, n)
    blocks = n // WIDTH * WIDTH if simd else 0
    head = v_expf(d[:, :blocks])  # (T, blocks)
    tail = np.vectorize(libm("expf"), otypes=[F32])(d[:, blocks:])  # (T, n - blocks)
    total = np.zeros(T, np.float64)
    for a in range(0, blocks, WIDTH):  # in order: the double sum is not associative
        total += _tree(head[:, a : a + WIDTH]).astype(np.float64)
    for i in range(n - blocks):
        total += tail[:, i].astype(np.float64)
    e = np.concatenate([head, tail], axis=1)  # (T, n)
    return (e * (1.0 / total).astype(F32)[:, None]).astype(F32)
