"""ggml's CPU ops of a mixture's router, bit for bit: ``soft_max`` of a row
(``ops.cpp ggml_compute_forward_soft_max_f32``, ``vec.cpp ggml_vec_soft_max_f32``) and
``sum_rows`` (``ops.cpp ggml_compute_forward_sum_rows_f32``, ``vec.h ggml_vec_sum_f32``), as
llama.cpp's ``build_moe_ffn`` uses them: the router's softmax, gpt-oss's softmax over the k
selected logits, and the sum the k weights are normalised by.

soft_max, per row of n values (no scale, no mask)::

    max = the largest value
    SIMD blocks of w lanes: e = ggml_v_expf(x - max), the block summed in float32 by the
        build's horizontal sum, added to a double sum
    the rest, one at a time: e = expf(x - max) (libm), added to the double sum
    out = e * (float)(1.0 / sum)

The SIMD build is data (:data:`SIMD`): ``w = 8``, AVX2 (``__AVX2__ && __FMA__``): its
``ggml_v_expf`` builds 2^n into the exponent bits (``k``, and a scale split in two past
|n| > 126), returns ``fma(j, k, k)``, and the block is summed by the tree
((e0+e4)+(e2+e6)) + ((e1+e5)+(e3+e7)); ``w = 16``, AVX-512 (``__AVX512F__ && __AVX512DQ__``):
its ``ggml_v_expf`` ends the polynomial with ``+ 1`` and scales by ``_mm512_scalef_ps(j, n)``
(j 2^n rounded once, subnormal results included: :func:`numpy.ldexp`, which is exact where
the result is normal and rounds once where it is not), and GCC's ``_mm512_reduce_add_ps``
sums the block: the 256-bit halves added (e_i + e_{i+8}), then their 128-bit halves
(t_i + t_{i+4}), then lanes 0+2 and 1+3, then those two. Both send |n| > 192 to 0 or inf.
``simd=False`` is ggml's scalar loop alone (the reference C code, what
``activation_rounding="ref"`` stands for). Rows shorter than the build's width are the
scalar loop in both builds (the tiny test models' 4 experts).

sum_rows: each row's values added in order into a double (``ggml_float``), cast to float
at the end. numpy's float64 ``sum`` is pairwise from 8 values on, so the loop is written out.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import numpy as np

from qllama.quants.rounding import fma, libm

F32, I32 = np.float32, np.int32

# ggml_v_expf's constants (vec.h), shared with the compiled form (kernels/router.py)
SHIFTER = F32(float.fromhex("0x1.8p23"))
LOG2E = F32(float.fromhex("0x1.715476p0"))
LN2_HI, LN2_LO = F32(float.fromhex("0x1.62E4p-1")), F32(float.fromhex("0x1.7F7D1Cp-20"))
C1, C2, C3, C4, C5 = (
    F32(float.fromhex("0x1.0E4020p-7")),
    F32(float.fromhex("0x1.573E2Ep-5")),
    F32(float.fromhex("0x1.555E66p-3")),
    F32(float.fromhex("0x1.FFFDB6p-2")),
    F32(float.fromhex("0x1.FFFFECp-1")),
)
ONE_BITS = F32(1.0).view(I32)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, F32).view(I32)


def _float(i: np.ndarray) -> np.ndarray:
    return np.asarray(i, I32).view(F32)


def _reduce(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The range reduction both builds share: z (the shifted 2^n), n = round(x log2 e) and the
    remainder b = x - n ln 2, in two fused parts."""
    z = fma(x, np.full_like(x, LOG2E), np.full_like(x, SHIFTER))
    n = (z - SHIFTER).astype(F32)
    b = fma(-n, np.full_like(x, LN2_HI), x)
    return z, n, fma(-n, np.full_like(x, LN2_LO), b)


def _poly(b: np.ndarray, last: np.ndarray) -> np.ndarray:
    """(((C1 b + C2) u + (C3 b + C4)) u + last), u = b^2, each multiply-add fused."""
    u = (b * b).astype(F32)
    c = [np.full_like(b, v) for v in (C1, C2, C3, C4)]
    return fma(fma(fma(c[0], b, c[1]), u, fma(c[2], b, c[3])), u, last)


def v_expf_avx2(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf, AVX2 (vec.h), per lane: 2^n times a polynomial of the remainder b,
    with its own handling of |n| > 126 (a scale split in two) and |n| > 192 (0 or inf)."""
    x = np.asarray(x, F32)
    z, n, b = _reduce(x)
    with np.errstate(over="ignore", invalid="ignore"):  # the lanes of another branch
        e = (_bits(z).astype(np.int64) << 23).astype(np.uint32).view(I32)  # slli_epi32: wraps
        k = _float((e.astype(np.int64) + ONE_BITS).astype(np.uint32).view(I32))
        j = _poly(b, (C5 * b).astype(F32))
        plain = fma(j, k, k)
        g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0)).astype(np.int64)
        s1 = _float((g + 0x7F000000).astype(np.uint32).view(I32))
        s2 = _float((e.astype(np.int64) - g).astype(np.uint32).view(I32))
        far = (s1 * s1).astype(F32)
        split = (fma(s2, j, s2) * s1).astype(F32)
    big, huge = np.abs(n) > 126, np.abs(n) > 192
    return np.where(huge, far, np.where(big, split, plain)).astype(F32)


def v_expf_avx512(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf, AVX-512 (vec.h), per lane: ``scalef(j, n)`` = j 2^n rounded once, the
    polynomial j ending in ``C5 b + 1``; |n| > 192 gives 0 (n <= 0) or inf."""
    x = np.asarray(x, F32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # the lanes of |n| > 192
        _, n, b = _reduce(x)
        j = _poly(b, fma(np.full_like(x, C5), b, np.ones_like(x)))
        scale = np.where(np.abs(n) <= 192, n, 0).astype(I32)  # a whole number; NaN: j is NaN
        res = np.ldexp(j, scale).astype(F32)
    far = np.where(n <= 0, F32(0), F32(np.inf))
    return np.where(np.abs(n) > 192, far, res).astype(F32)  # ordered: NaN keeps res


def _sum_avx2(e: np.ndarray) -> np.ndarray:
    """The AVX2 horizontal sum of blocks (..., 8) in float32: (...,)."""
    q = (e[..., :4] + e[..., 4:]).astype(F32)  # (e0+e4, e1+e5, e2+e6, e3+e7)
    h = (q[..., :2] + q[..., 2:]).astype(F32)  # (q0+q2, q1+q3)
    return (h[..., 0] + h[..., 1]).astype(F32)


def _sum_avx512(e: np.ndarray) -> np.ndarray:
    """GCC's ``_mm512_reduce_add_ps`` of blocks (..., 16) in float32: (...,)."""
    t = (e[..., 8:] + e[..., :8]).astype(F32)  # (..., 8) the 256-bit halves
    q = (t[..., 4:] + t[..., :4]).astype(F32)  # (..., 4) the 128-bit halves
    h = (q[..., :2] + q[..., 2:]).astype(F32)  # (..., 2) with lanes (2, 3, 0, 1)
    return (h[..., 0] + h[..., 1]).astype(F32)


# A llama.cpp build's float SIMD width: its ggml_v_expf and the horizontal sum of a block
SIMD: dict[int, tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]] = {
    8: (v_expf_avx2, _sum_avx2),
    16: (v_expf_avx512, _sum_avx512),
}


def host_width() -> int:
    """The float SIMD width of a llama.cpp built natively on this CPU: 16 where it has
    AVX-512F and AVX-512DQ (ggml's ``__AVX512F__ && __AVX512DQ__`` blocks), else 8 (AVX2;
    also where numpy does not say)."""
    have: dict[str, bool] = {}
    for module in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):  # 2.x, 1.x
        try:
            have = importlib.import_module(module).__cpu_features__
            break
        except (ImportError, AttributeError):
            continue
    return 16 if have.get("AVX512F") and have.get("AVX512DQ") else 8


def soft_max(x: np.ndarray, *, simd: bool, width: int = 8) -> np.ndarray:
    """ggml's soft_max over the last axis of float32 rows x (T, n): (T, n), the SIMD blocks of
    the build of float width ``width`` (:data:`SIMD`) where ``simd``, else the scalar loop."""
    x = np.asarray(x, F32)
    T, n = x.shape
    exp, block_sum = SIMD[width]
    d = (x - x.max(axis=-1, keepdims=True)).astype(F32)  # (T, n)
    blocks = n // width * width if simd else 0
    head = exp(d[:, :blocks])  # (T, blocks)
    tail = np.vectorize(libm("expf"), otypes=[F32])(d[:, blocks:])  # (T, n - blocks)
    total = np.zeros(T, np.float64)
    for a in range(0, blocks, width):  # in order: the double sum is not associative
        total += block_sum(head[:, a : a + width]).astype(np.float64)
    for i in range(n - blocks):
        total += tail[:, i].astype(np.float64)
    e = np.concatenate([head, tail], axis=1)  # (T, n)
    return (e * (1.0 / total).astype(F32)[:, None]).astype(F32)


def sum_rows(x: np.ndarray) -> np.ndarray:
    """ggml's sum_rows of float32 rows x (T, n): (T, 1), each row added in order in double."""
    x = np.asarray(x, F32)
    total = np.zeros(x.shape[0], np.float64)
    for i in range(x.shape[1]):  # in order: numpy's own float64 sum is pairwise
        total += x[:, i].astype(np.float64)
    return total.astype(F32)[:, None]
