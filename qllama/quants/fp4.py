"""What MXFP4 and NVFP4 share: E2M1 values (stored doubled, as ggml's ``kvalues_mxfp4``), the
nearest-value search, and the two scale encodings (E8M0 powers of two, UE4M3 minifloats).

ggml keeps every E2M1 value doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives) so that they
are small integers for its integer dot products; both scale decoders return half the scale to
make up for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

import numpy as np

from qllama.quants.rounding import F32, c_int32

# kvalues_mxfp4 (ggml-common.h): index 8 is -0, which the quantizer never picks
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
_LEVELS = KVALUES.astype(F32)


def _e8m0_half_table() -> np.ndarray:
    """``ggml_e8m0_to_fp32_half(e)`` for every byte: ``2**(e - 128)``, built from its bits
    (e < 2 are the subnormals 2**-128, 2**-127)."""
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23)
    return bits.astype(np.uint32).view(F32)


def _ue4m3_half_table() -> np.ndarray:
    """``ggml_ue4m3_to_fp32(u)`` for every byte: half the UE4M3 value (4 exponent bits,
    bias 7, 3 mantissa bits; bit 7 ignored; 0x00 and 0x7F decode to 0). Exact in float64."""
    u = np.arange(256)
    exp, man = (u >> 3) & 15, u & 7
    raw = np.where(exp == 0, man * 2.0**-9, (1 + man / 8) * 2.0 ** (exp - 7))
    raw[(u == 0) | (u == 0x7F)] = 0
    return (raw * 0.5).astype(F32)


E8M0_HALF = _e8m0_half_table()
UE4M3_HALF = _ue4m3_half_table()


def best_index(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """ggml ``best_index_mxfp4(x, d)`` elementwise: the first index of the smallest
    ``|kvalues[i] * d - x|`` (strict ``<``: ties keep the smaller magnitude, +0 over -0; a
    NaN x gives 0). ``d`` broadcasts against ``x``."""
    x = np.asarray(x, dtype=F32)
    best = np.abs(_LEVELS[0] * d - x)
    idx = np.zeros(x.shape, dtype=np.uint8)
    with np.errstate(invalid="ignore"):
        for i in range(1, 16):
            err = np.abs(_LEVELS[i] * d - x)
            better = err < best
            idx = np.where(better, np.uint8(i), idx)
            best = np.where(better, err, best)
    return idx


def _libm_log2f() -> Callable[[float], float] | None:
    """The C library's ``log2f``, which ggml calls; None where it cannot be loaded."""
    name = ctypes.util.find_library("m")
    try:
        libm = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        fn = libm.log2f
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_float]
    return fn


_LOG2F = _libm_log2f()


def floor_log2f(a: np.ndarray) -> np.ndarray:
    """``floorf(log2f(a))`` for positive float32 ``a``, as float32.

    That is the binary exponent of ``a``, except just below a power of two, where ``log2f``
    rounds up to the next integer (``a = 2**64 * (1 - 2**-24)`` gives 64, not 63). Only
    those near-misses are passed to the C library's own ``log2f`` (one call each); without a
    C library, float64 ``log2`` rounded to float32 stands in for it.
    """
    a = np.asarray(a, dtype=F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        _, ex = np.frexp(a)  # a = m * 2**ex, 0.5 <= m < 1: floor(log2 a) = ex - 1
        out = (ex - 1).astype(F32)
        exact = np.log2(a.astype(np.float64))
    near = np.flatnonzero(np.isfinite(exact) & (exact > ex - 2.0**-10))
    for i in near:
        v = F32(a.flat[i])
        r = _LOG2F(float(v)) if _LOG2F is not None else float(F32(np.log2(np.float64(v))))
        out.flat[i] = np.floor(F32(r))
    out[np.isinf(a)] = np.inf
    return out


def e8m0_exponent(amax: np.ndarray) -> np.ndarray:
    """MXFP4's scale byte: ``(uint8)(floorf(log2f(amax)) - 2 + 127)``, 0 for ``amax == 0``.

    The cast keeps the low byte of x86's float -> int conversion, so a tiny ``amax`` wraps
    (2**-140 gives 243) and an infinite one gives 0, as ggml's build does.
    """
    amax = np.asarray(amax, dtype=F32)
    pos = amax > 0
    e = floor_log2f(np.where(pos, amax, F32(1))) - F32(2) + F32(127)
    return np.where(pos, c_int32(e) & 0xFF, 0).astype(np.uint8)


def ue4m3_code(x: np.ndarray) -> np.ndarray:
    """``ggml_fp32_to_ue4m3(x)`` elementwise (uint8).

    Not positive (or NaN) -> 0; capped at 448; below UE4M3's normal range the subnormal
    ``(int)(x * 512 + 0.5)`` capped at 7 (0 below 1); else the top three mantissa bits
    rounded up on the fourth (a carry bumps the exponent). Exponents of 15 and up give
    0x7E, so 256 <= x <= 448, and anything rounding up to 248 or more, all give 0x7E.
    """
    x = np.asarray(x, dtype=F32)
    with np.errstate(invalid="ignore"):
        pos = x > 0
        x = np.where(x > F32(448), F32(448), x)
    bits = np.where(pos, x, F32(1)).view(np.uint32).astype(np.int64)
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    man = ((bits >> 20) & 7) + ((bits >> 19) & 1)
    carry = man > 7
    exp = np.where(carry, exp + 1, exp)
    man = np.where(carry, 0, man)
    normal = np.where(exp >= 15, 0x7E, (exp << 3) | man)
    with np.errstate(invalid="ignore", over="ignore"):
        sub = np.minimum(c_int32(np.where(pos, x, F32(0)) * F32(512) + F32(0.5)), 7)
    sub = np.where(sub < 1, 0, sub)
    first_exp = ((bits >> 23) & 0xFF) - 127 + 7  # before the carry: C tests it first
    code = np.where(first_exp <= 0, sub, np.where(first_exp >= 15, 0x7E, normal))
    return np.where(pos, code, 0).astype(np.uint8)


def nonnan_absmax(x: np.ndarray, axis: int) -> np.ndarray:
    """``if (amax < fabsf(v)) amax = fabsf(v)`` from 0: the largest |x|, NaNs never winning."""
    a = np.abs(x)
    return np.max(np.where(np.isnan(a), F32(0), a), axis=axis, keepdims=True)
