"""What the legacy 32-blocks (Q4_0, Q4_1, Q5_0, Q5_1) share: nibble and fifth-bit packing,
the ``q*d + m`` of the ``_1`` types, and the scans and float-to-int casts of their reference
quantizers.

In every one of these blocks element ``j`` of the first half sits in the low nibble of
``qs[j]`` and element ``j + 16`` in its high nibble. Q5's ``qh`` is a little-endian u32 whose
bit ``e`` is the fifth bit of element ``e``, so as 4 bytes element ``e`` is bit ``e % 8`` of
byte ``e // 8``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.quants.rounding import F32

FLT_MAX = F32(np.finfo(np.float32).max)
_INT32_MIN = np.int32(np.iinfo(np.int32).min)


# --- reading (array API only: these run in every namespace) -------------------------------


def split_nibbles(qs: Any, *, xp: Any) -> Any:
    """``(n, 16)`` uint8 -> ``(n, 32)`` uint8: the low nibbles, then the high nibbles."""
    return xp.concat([qs & 0x0F, qs >> 4], axis=-1)


def fifth_bits(qh: Any, *, xp: Any) -> Any:
    """``(n, 4)`` uint8 ``qh`` -> ``(n, 32)`` uint8: ``0x10`` where element e's bit is set."""
    bits = xp.stack([((qh >> k) & 1) << 4 for k in range(8)], axis=-1)  # (n, 4 bytes, 8 bits)
    return xp.reshape(bits, (qh.shape[0], 32))


def scale_and_offset(q: Any, d: Any, m: Any, *, xp: Any) -> Any:
    """``q*d + m`` in float32, two roundings and no FMA, as ``dequantize_row_q4_1``/``q5_1``.

    When ``q*d`` and ``m`` are both NaN, x86 ``addss`` returns the first operand's NaN, but
    numpy, torch and jax kernels each pick their own; choosing ``q*d`` explicitly keeps the
    bits identical in every namespace and equal to ggml's.
    """
    qd = xp.astype(q, xp.float32) * d
    return xp.where(xp.isnan(qd), qd, qd + m)


# --- writing (numpy) -----------------------------------------------------------------------


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """``(n, 32)`` uint8 -> ``(n, 16)``: ``q[j] | q[j + 16] << 4``, unmasked as ggml writes it."""
    return q[:, :16] | (q[:, 16:] << 4)


def pack_fifth_bits(q: np.ndarray) -> np.ndarray:
    """``(n, 32)`` uint8 5-bit values -> ``(n, 4)`` uint8 ``qh`` (bit 4 of element e at bit e)."""
    return np.packbits((q >> 4) & 1, axis=1, bitorder="little")


def c_int32(t: np.ndarray) -> np.ndarray:
    """C's float -> int cast on x86 (``cvttss2si``/``cvttps2dq``): truncate toward zero.

    NaN and values outside int32 give INT32_MIN, the "integer indefinite" these instructions
    return; ggml reaches that only when a block's scale is so small that ``1/d`` overflows.
    """
    ok = (t >= F32(-(2.0**31))) & (t < F32(2.0**31))  # False for NaN
    return np.where(ok, np.where(ok, t, F32(0)).astype(np.int32), _INT32_MIN)


def signed_absmax(x: np.ndarray) -> np.ndarray:
    """Q4_0/Q5_0's scan: the first value of strictly largest |x|, ``+0.0`` if none is > 0.

    ``amax < fabsf(v)`` is false for NaN, so NaNs are skipped; the start value is +0.0, so an
    all-zero block gives +0.0 even if its zeros are negative (and d = -0.0).
    """
    a = np.abs(x)
    a = np.where(np.isnan(a), F32(0), a)
    idx = np.argmax(a, axis=1)[:, None]  # first occurrence, as the strict < keeps the first
    best = np.take_along_axis(x, idx, axis=1)
    return np.where(np.take_along_axis(a, idx, axis=1) > 0, best, F32(0)).astype(F32)


def min_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_1/Q5_1's scan from ``min = FLT_MAX, max = -FLT_MAX`` with strict comparisons.

    NaN (and +-inf on the side that cannot beat the start value) never replaces it, and among
    equal values (0.0 and -0.0) the first wins: ``argmin``/``argmax`` keep the first too.
    """
    lo = np.where(x < FLT_MAX, x, FLT_MAX)
    hi = np.where(x > -FLT_MAX, x, -FLT_MAX)
    mn = np.take_along_axis(lo, np.argmin(lo, axis=1)[:, None], axis=1)
    mx = np.take_along_axis(hi, np.argmax(hi, axis=1)[:, None], axis=1)
    return mn, mx
