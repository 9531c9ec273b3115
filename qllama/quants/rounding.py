"""ggml's scalar arithmetic, reproduced in numpy float32: one definition of each primitive.

ggml's quantizers are C loops in float32. To give the same bytes, sums run in index order
(:func:`c_sum`), products keep C's left-to-right grouping, roundings and casts are the
instructions the x86 build uses (:func:`nearest_int`, :func:`round_away`, :func:`c_int32`),
max scans keep C's tie and NaN behaviour, half-precision scales are written with ggml's
own conversion (:func:`fp16_bits`), libm's float functions are libm's (:func:`libm`) and a
fused multiply-add rounds once (:func:`fma`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

import numpy as np

F32 = np.float32

_MAGIC = F32(12582912.0)  # 1.5 * 2**23
_INT32_MIN = np.int32(np.iinfo(np.int32).min)


# --- libm and fused multiply-add ----------------------------------------------------------------


@functools.cache
def libm(name: str) -> Callable[[float], float]:
    """libm's float function ``name`` (``expf``, ``tanhf``), as the compiled kernel calls it."""
    path = ctypes.util.find_library("m")
    lib = ctypes.CDLL(path) if path else ctypes.CDLL(None)
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn


def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``a*b + c`` rounded once (numpy, elementwise). The product is exact in
    float64; the float64 sum ``s`` and its error ``e`` (two-sum) hold the exact result, and
    rounding ``s`` to float32 is the right answer unless ``s`` lies exactly halfway between
    two floats, where ``e`` says which side the exact value is on."""
    a64, b64, c64 = (np.asarray(z, dtype=F32).astype(np.float64) for z in (a, b, c))
    p = a64 * b64
    s = p + c64
    bb = s - p
    e = (p - (s - bb)) + (c64 - bb)
    r = s.astype(F32)
    r64 = r.astype(np.float64)
    other = np.nextafter(r, np.where(s > r64, F32(np.inf), F32(-np.inf))).astype(F32)
    o64 = other.astype(np.float64)
    tie = (s != r64) & ((r64 + o64) * 0.5 == s)
    toward_other = np.sign(e) == np.sign(o64 - r64)
    return np.where(tie & (e != 0) & toward_other, other, r).astype(F32)


# --- rounding and casts ------------------------------------------------------------------------


def nearest_int(x: np.ndarray) -> np.ndarray:
    """ggml ``nearest_int`` bit for bit: add 1.5 * 2**23, keep the low 23 bits, minus 2**22.

    Round half to even where ggml asserts it is valid, |x| <= 4194303. Unlike ``np.rint``
    it also gives what ggml's release build returns outside that range: +-inf -> -2**22,
    NaN -> 0, huge values wrap. Degenerate search steps and overflowing scales reach those.
    """
    v = np.add(x, _MAGIC, dtype=F32).view(np.int32)
    v &= np.int32(0x007FFFFF)  # in place: the K-quant searches call this on every step
    v -= np.int32(0x00400000)
    return v


def round_away(x: np.ndarray) -> np.ndarray:
    """C ``roundf``: round half away from zero, as float32 (NaN and inf stay as they are)."""
    x = np.asarray(x, dtype=F32)
    a = np.abs(x)
    fl = np.floor(a)
    # 2*(a - fl) is exact, so its floor is 1 exactly when the fraction is >= 0.5
    with np.errstate(invalid="ignore"):  # inf - inf: the NaN it makes is replaced below
        r = fl + np.floor(2 * (a - fl))
    return np.copysign(np.where(np.isinf(a), a, r), x).astype(F32)


def c_int32(t: np.ndarray) -> np.ndarray:
    """C's float -> int cast on x86 (``cvttss2si``/``cvttps2dq``): truncate toward zero.

    NaN and values outside int32 give INT32_MIN, the "integer indefinite" these instructions
    return (``cvtps2dq`` after a round, as the AVX2 quantizers use, gives the same). A store
    into a narrower C integer then keeps the low bits: ``.astype(np.int8)`` of the result.
    """
    ok = (t >= F32(-(2.0**31))) & (t < F32(2.0**31))  # False for NaN
    return np.where(ok, np.where(ok, t, F32(0)).astype(np.int32), _INT32_MIN)


# --- half precision ----------------------------------------------------------------------------


def fp16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bits of ``ggml_compute_fp32_to_fp16``: nearest even, overflow to inf,
    and every NaN becomes the quiet NaN 0x7e00 with its sign (numpy keeps payload bits)."""
    x = np.asarray(x, dtype=F32)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is the IEEE answer
        bits = x.astype("<f2").view(np.uint16)
    sign = (x.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)
    return np.where(np.isnan(x), sign | np.uint16(0x7E00), bits)


def fp16_bytes(x: np.ndarray) -> np.ndarray:
    """float32 ``(n, 1)`` -> the ``(n, 2)`` little-endian bytes ggml stores for it."""
    return fp16_bits(x).astype("<u2").reshape(-1, 1).view(np.uint8)


def fp16(x: np.ndarray) -> np.ndarray:
    """Round to half as ggml stores it and widen back, as its dot products read the scale."""
    return fp16_bits(x).view("<f2").astype(F32)


def read_fp16(raw: np.ndarray) -> np.ndarray:
    """``(n, 2)`` uint8 -> ``(n, 1)`` float32 (f16 -> f32 is exact)."""
    return np.ascontiguousarray(raw).view("<f2").astype(F32)


def read_fp32(raw: np.ndarray) -> np.ndarray:
    """``(n, 4)`` uint8 -> ``(n, 1)`` float32."""
    return np.ascontiguousarray(raw).view("<f4").astype(F32)


def safe_reciprocal(d: np.ndarray) -> np.ndarray:
    """``d ? 1/d : 0`` in float32 (a subnormal ``d`` gives inf, as in C)."""
    d = np.asarray(d, dtype=F32)
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0)).astype(F32)


# --- sums and scans ----------------------------------------------------------------------------


def c_sum(a: np.ndarray, *, from_zero: bool = True) -> np.ndarray:
    """C's float32 ``for`` loop sum over axis 0, vectorised over the other axes.

    ``from_zero``: ``s = 0; s += a[i]`` (0 + a[0] turns an all-negative-zero sum into +0.0);
    otherwise ``s = a[0]; s += a[i], i >= 1``. Each step is one contiguous add, so callers
    lay the summed axis first (element-major); ``np.sum`` would add pairwise instead.
    """
    acc = a[0] + F32(0) if from_zero else a[0].copy()
    for row in a[1:]:
        acc += row
    return acc


def first_absmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """ggml's ``if (fabsf(v) > amax) { amax = fabsf(v); max = v; }`` scan from amax = 0.

    The signed value of the first strictly largest |x| along ``axis`` (kept as a length-1
    axis); NaNs never win, and the result is +0.0 when nothing is > 0 (even for -0.0s).
    """
    a = np.abs(x)
    a = np.where(np.isnan(a), F32(0), a)
    idx = np.expand_dims(np.argmax(a, axis=axis), axis)  # argmax keeps the first, as `>` does
    found = np.take_along_axis(a, idx, axis=axis) > 0
    return np.where(found, np.take_along_axis(x, idx, axis=axis), F32(0)).astype(F32)


def running_absmax(x: np.ndarray) -> np.ndarray:
    """``amax = MAX(amax, fabsf(v))`` over axis 1 in index order from 0 (``_ref`` Q8_0/Q8_1).

    ``MAX(a, b)`` is ``a > b ? a : b``, so a NaN element *replaces* the running max and the
    next element replaces the NaN: the result is the max after the last NaN, or NaN when the
    last element is one. Returns ``(n, 1)``.
    """
    a = np.abs(x)
    nan = np.isnan(a)
    n = a.shape[1]
    last_nan = np.where(nan.any(axis=1), n - 1 - np.argmax(nan[:, ::-1], axis=1), -1)[:, None]
    after = np.arange(n) > last_nan
    amax = np.max(np.where(after, a, F32(0)), axis=1, keepdims=True)
    return np.where(last_nan == n - 1, a[:, -1:], amax)


def _maxps(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """x86 ``maxps(p, q)`` = C ``p > q ? p : q``: the second operand wins on NaN."""
    return np.where(p > q, p, q)


def avx2_absmax(x: np.ndarray) -> np.ndarray:
    """The max |x| of a 32-block as ggml's AVX2 Q8_0/Q8_1 kernels reduce it: four 8-lane
    ``maxps`` in order, then a fixed lane tree. ``(n, 32)`` -> ``(n, 1)``; NaN placement
    decides whether a NaN survives, exactly as in the kernel."""
    r = np.abs(x).reshape(-1, 4, 8)
    m = _maxps(_maxps(_maxps(r[:, 0], r[:, 1]), r[:, 2]), r[:, 3])
    m4 = _maxps(m[:, 4:], m[:, :4])
    m2 = _maxps(m4[:, :2], m4[:, 2:])
    return _maxps(m2[:, :1], m2[:, 1:])
