"""What IQ4_NL and IQ4_XS share: the 16 non-linear levels, ggml's nearest-level lookup and its
scale search (``quantize_row_iq4_nl_impl``), written for many blocks at once.

Each 32-block is fitted as ``x ~ d * kvalues[L]``: a first guess ``d = max / 127`` (the
element of largest magnitude on the outermost level), a least-squares refit, then ``2 ntry +
1`` trial scales ``max / (itry - 127)`` of which the best weighted fit wins. Sums run over the
32 elements in index order in float32, as the C loop adds them (:func:`c_sum` on
element-major arrays).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from array_api_compat import device as array_device

from qllama.quants import iq_grids
from qllama.quants.rounding import F32, c_sum, first_absmax, nearest_int, safe_reciprocal

# kvalues_iq4nl (ggml-common.h): the 16 levels, in increasing order
KVALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)
_LEVELS = KVALUES.astype(F32)
GROUP_MAX_EPS = F32(1e-15)  # a block whose largest |x| is below this gets scale 0


def lookup(table: np.ndarray, codes: Any, *, xp: Any) -> Any:
    """``table[codes]`` in namespace ``xp``, on the device of ``codes`` (any integer dtype)."""
    t = xp.asarray(table, device=array_device(codes))
    flat = xp.reshape(xp.astype(codes, xp.int32), (-1,))
    return xp.reshape(xp.take(t, flat, axis=0), codes.shape)


def _midpoint_table() -> np.ndarray:
    """For every integer k in [-256, 256], how many midpoints m between neighbouring levels
    have 2m <= k (the 2m are integers)."""
    twice_mid = KVALUES[:-1].astype(np.int64) + KVALUES[1:]
    k = np.arange(-256, 257)
    return (twice_mid[None, :] <= k[:, None]).sum(axis=1).astype(np.uint8)


_BELOW = _midpoint_table()


def best_index(x: np.ndarray) -> np.ndarray:
    """ggml ``best_index_int8(16, kvalues_iq4nl, x)`` elementwise: the nearest level's index.

    Below the first level 0, above the last 15; between two levels a, b the lower one only if
    ``x - a < b - x`` in float32 (exact midpoints go up); NaN gives 15 (every comparison of
    C's binary search fails).

    That is the number of midpoints m <= x: near a midpoint both differences are exact in
    float32 (|x| >= 4.5 there, so x's ulp resolves a half-gap of at most 12), and away from
    one rounding cannot reverse their order. The midpoints are multiples of 1/2, so m <= x
    exactly when 2m <= floor(2x): one table lookup.
    """
    x = np.asarray(x, dtype=F32)
    with np.errstate(invalid="ignore"):
        k = np.clip(np.floor(F32(2) * x), -256, 256)
    idx = _BELOW[k.astype(np.int32) + 256] if not np.isnan(k).any() else _with_nan(x, k)
    return idx


def _with_nan(x: np.ndarray, k: np.ndarray) -> np.ndarray:
    nan = np.isnan(x)
    idx = _BELOW[np.where(nan, F32(0), k).astype(np.int32) + 256]
    idx[nan] = 15
    return idx


def block_weights(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """The per-element weights of a ``(n, super_block)`` float32 batch: ``qw *
    sqrt(sigma2 + x**2)`` with ``sigma2 = 2 sum(x**2) / super_block`` (summed in order), or
    ``x**2`` without importances."""
    if qw is None:
        return x * x
    sigma2 = c_sum(np.ascontiguousarray((x * x).T)) * F32(2.0 / x.shape[1])
    return qw * np.sqrt(sigma2[:, None] + x * x)


def search_scales(
    xt: np.ndarray, wt: np.ndarray, ntry: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The scale search of ``quantize_row_iq4_nl_impl`` for ``(32, n)`` element-major blocks
    ``xt`` and weights ``wt``.

    Returns the signed float32 scale of each block ``(n,)`` (0 for a block whose largest |x|
    is below 1e-15), whether the block was such a zero block, and the levels of the first
    pass (what ggml keeps when ``ntry <= 0``; its trials recompute nothing else).
    """
    mx = first_absmax(xt, axis=0)[0]  # signed value of the largest |x|
    zero = np.abs(mx) < GROUP_MAX_EPS
    mx = np.where(zero, F32(1), mx)  # zero blocks' results are overwritten below
    if iq_grids.compiled():  # the same loop, compiled
        from qllama.quants import iq_search_jit

        d, first = iq_search_jit.iq4_scales(
            np.ascontiguousarray(xt, dtype=F32),
            np.ascontiguousarray(wt, dtype=F32),
            mx.astype(F32),
            ntry,
            _BELOW,
            _LEVELS,
            F32(KVALUES[0]),
        )
        return np.where(zero, F32(0), d).astype(F32), zero, first

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lq = best_index(iscale * xt)
        q = _LEVELS[lq]
        wq = wt * q
        return lq, c_sum(wq * xt), c_sum(wq * q)  # C: sumqx += w*q*x; sumq2 += w*q*q

    # C: d = ntry > 0 ? -max/values[0] : max/values[0]; the first pass uses 1/d
    d0 = (-mx if ntry > 0 else mx) / F32(KVALUES[0])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        first, sumqx, sumq2 = fit(F32(1) / d0)
        d = np.where(sumq2 > 0, sumqx / sumq2, F32(0)).astype(F32)
        best = d * sumqx
        for itry in range(-ntry, ntry + 1):
            _, sumqx, sumq2 = fit(F32(itry + int(KVALUES[0])) / mx)
            take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(take, sumqx / sumq2, d)
            best = np.where(take, d * sumqx, best)
    return np.where(zero, F32(0), d).astype(F32), zero, first


def levels_for(xt: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The levels of ``(32, n)`` blocks quantized with float32 ``scale`` ``(n,)``:
    ``best_index(x * (1/scale))``, ``1/scale`` taken as 0 for a zero scale."""
    with np.errstate(over="ignore", invalid="ignore"):
        return best_index(safe_reciprocal(scale) * xt)


def super_scale(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """IQ4_XS: ``(n, 8)`` block scales -> the super-block scale ``D = -max_scale / 32`` (float32,
    ``(n, 1)``; -0.0 for an all-zero super-block, as ggml stores it) and the 6-bit block
    scales ``l + 32``, ``l = clamp(nearest_int(scale / D), -32, 31)``."""
    big = first_absmax(scales, axis=1)
    d = -big / F32(32)
    with np.errstate(over="ignore", invalid="ignore"):
        ls = np.clip(nearest_int(safe_reciprocal(d) * scales), -32, 31)
    return d.astype(F32), ls


def pack_nibbles_32(lq: np.ndarray) -> np.ndarray:
    """``(n, 32)`` levels -> ``(n, 16)``: element ``j`` in the low nibble of byte ``j``,
    element ``j + 16`` in the high one."""
    return (lq[:, :16] | (lq[:, 16:] << 4)).astype(np.uint8)
