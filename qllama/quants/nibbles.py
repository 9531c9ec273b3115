"""What the legacy 32-blocks (Q4_0, Q4_1, Q5_0, Q5_1) share: nibble and fifth-bit packing,
the ``q*d + m`` of the ``_1`` types, and the two reference quantizers (symmetric for the
``_0`` types, min-offset for the ``_1`` types).

In every one of these blocks element ``j`` of the first half sits in the low nibble of
``qs[j]`` and element ``j + 16`` in its high nibble. Q5's ``qh`` is a little-endian u32 whose
bit ``e`` is the fifth bit of element ``e``, so as 4 bytes element ``e`` is bit ``e % 8`` of
byte ``e // 8``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.quants.rounding import F32, c_int32, first_absmax, safe_reciprocal

FLT_MAX = F32(np.finfo(np.float32).max)


# --- reading (array API only: these run in every namespace) -------------------------------


def split_nibbles(qs: Any, *, xp: Any) -> Any:
    """``(n, 16)`` uint8 -> ``(n, 32)`` uint8: the low nibbles, then the high nibbles."""
    return xp.concat([qs & 0x0F, qs >> 4], axis=-1)


def fifth_bits(qh: Any, *, xp: Any) -> Any:
    """``(n, 4)`` uint8 ``qh`` -> ``(n, 32)`` uint8: ``0x10`` where element e's bit is set."""
    bits = xp.stack([((qh >> k) & 1) << 4 for k in range(8)], axis=-1)  # (n, 4 bytes, 8 bits)
    return xp.reshape(bits, (qh.shape[0], 32))


def codes(fields: Any, *, xp: Any) -> Any:
    """The unsigned 4-bit (5-bit where there is a ``qh``) code of each element, ``(n, 32)``."""
    q = split_nibbles(fields["qs"], xp=xp)
    return q | fifth_bits(fields["qh"], xp=xp) if "qh" in fields else q


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


def quantize_symmetric(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 (``nmax`` 15) / Q5_0 (31): ``(n, 32)`` float32 -> f32 ``d`` and the codes.

    The signed extreme maps to code 0 exactly, so d carries the sign of -max. The code is
    ``(int8_t)(x*id + half + 0.5f)`` capped at nmax: truncation of a non-negative value, i.e.
    round half up (this x86 build does not contract it to an FMA; the test vectors agree).
    C overflows silently where a tiny d has no finite reciprocal; so do we.
    """
    half = (nmax + 1) // 2
    d = first_absmax(x, axis=1) / F32(-half)
    with np.errstate(over="ignore", invalid="ignore"):
        t = x * safe_reciprocal(d) + F32(half + 0.5)
    return d, np.minimum(c_int32(t).astype(np.int8), nmax).astype(np.uint8)


def quantize_offset(
    x: np.ndarray, nmax: int, *, capped: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 (``nmax`` 15) / Q5_1 (31): ``(n, 32)`` float32 -> f32 ``d``, ``min`` and the codes.

    Quantized against the f32 min and d, not the stored fp16 ones: ``(x - min)*id + 0.5f``
    truncated into a C integer. Q4_1 (``capped``) stores ``MIN(15, (int8_t)t)``; Q5_1 stores
    ``(uint8_t)t`` unclamped, keeping the low byte. Infinities and overflow make NaNs
    silently in C, and here.
    """
    mn, mx = min_max(x)
    with np.errstate(over="ignore", invalid="ignore"):
        d = (mx - mn) / F32(nmax)
        t = c_int32((x - mn) * safe_reciprocal(d) + F32(0.5))
    q = np.minimum(t.astype(np.int8), nmax).astype(np.uint8) if capped else t.astype(np.uint8)
    return d, mn, q


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
