"""ggml's quantizers with an importance matrix, for the types that predate it
(``quantize_row_*_impl`` in ggml-quants.c): the searches and scale fits, up to the bytes
(each type's class packs them).

With importances ``qw`` (one per column) each element gets the weight
``qw * sqrt(sigma2 + x**2)``, ``sigma2`` being the mean square of the row (Q4_0, Q4_1, Q5_0,
Q5_1), of the super-block (Q2_K), or twice it (Q3_K, Q4_K, Q5_K); Q6_K uses ``qw`` as it is,
and Q8_0 ignores it. The weights then replace the reference quantizers' own in the same
searches, and the sub-block scales are fitted to a super-block scale with weights of their
own (the sums of their elements' weights), by ``make_qx_quants`` (Q3_K) or ``make_qp_quants``
(Q2_K, Q4_K, Q5_K).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from qllama.quants.kquant_search import (
    make_qkx2_quants,
    make_qp_quants,
    make_qx_quants,
    pack_scales_k4,
    requantize,
    scale_min_k4,
    search_sub_blocks,
)
from qllama.quants.rounding import F32, c_sum, fp16, fp16_bytes

QK_K = 256
# make_qkx3_quants' search, as every impl calls it; it is make_qkx2_quants' loop exactly
QKX3: dict[str, Any] = {"rmin": -0.9, "rdelta": 0.05, "nstep": 36, "use_mad": False}


def _sum_squares(x: np.ndarray) -> np.ndarray:
    """``sum(x[i]*x[i])`` over each row of ``(n, k)`` in index order, from 0."""
    return c_sum(np.ascontiguousarray((x * x).T))


def row_weights(rows: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Q4_0 .. Q5_1: ``qw * sqrt(sigma2 + x**2)``, ``sigma2 = sum(x**2) / n_per_row``."""
    sigma2 = _sum_squares(rows) / F32(rows.shape[1])
    return qw[None, :] * np.sqrt(sigma2[:, None] + rows * rows)


def super_block_weights(x: np.ndarray, qw: np.ndarray, factor: int) -> np.ndarray:
    """Q2_K (``factor`` 1), Q3_K/Q4_K/Q5_K (2): ``qw * sqrt(sigma2 + x**2)`` per ``(n, 256)``
    super-block, ``sigma2 = factor * sum(x**2) / 256``."""
    sigma2 = F32(factor) * _sum_squares(x) / F32(QK_K)  # C: factor*sumx2/QK_K (exact *1, *2)
    return qw * np.sqrt(sigma2[:, None] + x * x)


def legacy_rows(
    rows: np.ndarray,
    imatrix: np.ndarray,
    nmax: int,
    pack: Callable[..., np.ndarray],
    *,
    offset: bool,
) -> np.ndarray:
    """Q4_0 / Q5_0 (``offset`` False: :func:`symmetric_32`) and Q4_1 / Q5_1 (True:
    :func:`offset_32`) rows with weights over the whole row, packed by the type's ``pack``
    (scales, [mins,] codes) into ``(n_rows, row_bytes)``."""
    w = row_weights(rows, imatrix).reshape(-1, 32)
    fit = offset_32 if offset else symmetric_32
    return pack(*fit(rows.reshape(-1, 32), w, nmax)).reshape(rows.shape[0], -1)


def symmetric_32(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 (``nmax`` 8) / Q5_0 (16): ``make_qx_quants(32, nmax, x, L, 1, w)`` per block.
    Returns the float32 scales ``(n, 1)`` and ``L`` ``(n, 32)`` in ``[0, 2 nmax)``."""
    lq, scale = make_qx_quants(np.ascontiguousarray(x.T), nmax, np.ascontiguousarray(w.T))
    return scale.reshape(-1, 1), lq.T


def offset_32(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 (``nmax`` 15) / Q5_1 (31): ``make_qkx3_quants(32, nmax, x, w, ...)`` per block.
    Returns the float32 scale, the min (``<= 0``, what ggml stores as ``m``), ``(n, 1)``
    each, and ``L`` ``(n, 32)``."""
    lq, scale, the_min = make_qkx2_quants(
        np.ascontiguousarray(x.T),
        np.ascontiguousarray(w.T),
        nmax=nmax,
        rmin=-0.9,
        rdelta=0.05,
        nstep=36,
        use_mad=False,
    )  # QKX3
    return scale.reshape(-1, 1), (-the_min).reshape(-1, 1), lq.T


def q2_k(x: np.ndarray, qw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q2_K_impl: ``(n, 256)`` -> the packed scale bytes ``(n, 16)``, ``L``
    ``(n, 16, 16)``, and the float32 d, dmin ``(n, 1)`` before their fp16 store."""
    nb = x.shape[0]
    w = super_block_weights(x, qw, 1)
    lq, scales, mins = search_sub_blocks(x, w, 16, nmax=3, **QKX3)
    sw = c_sum(np.ascontiguousarray(w.reshape(nb * 16, 16).T)).reshape(nb, 16)
    ls, dm = make_qp_quants(np.ascontiguousarray(scales.T), np.ascontiguousarray(sw.T), 15)
    lm, mm = make_qp_quants(np.ascontiguousarray(mins.T), np.ascontiguousarray(sw.T), 15)
    packed = (ls.T | (lm.T << 4)).astype(np.uint8)  # C stores Ls | Lm << 4 into a byte
    d, dmin = fp16(dm).reshape(-1, 1), fp16(mm).reshape(-1, 1)
    dd = d * (packed & 15).astype(F32)
    dmv = dmin * (packed >> 4).astype(F32)
    lq = requantize(x.reshape(nb, 16, 16), dd, lq, lo=0, hi=3, dm=dmv)
    return packed, lq, dm.reshape(-1, 1), mm.reshape(-1, 1)


def q3_k(x: np.ndarray, qw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q3_K_impl up to the scales: ``(n, 256)`` -> ``L`` ``(n, 16, 16)`` of the
    group search, the 6-bit scales ``(n, 16)`` (offset 32) and the float32 d ``(n, 1)``."""
    nb = x.shape[0]
    w = super_block_weights(x, qw, 2)
    xt = np.ascontiguousarray(x.reshape(nb * 16, 16).T)
    wt = np.ascontiguousarray(w.reshape(nb * 16, 16).T)
    lq, scales = make_qx_quants(xt, 4, wt)
    sw = c_sum(wt)  # C: sumw += weight[l], from 0
    ls, d = make_qx_quants(
        np.ascontiguousarray(scales.reshape(nb, 16).T),
        32,
        np.ascontiguousarray(sw.reshape(nb, 16).T),
    )
    return lq.T.reshape(nb, 16, 16), ls.T.astype(np.int64), d.reshape(-1, 1)


def q6_k(x: np.ndarray, qw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q6_K_impl's group search, with ``qw`` itself as the weights: ``(n, 256)``
    -> x and ``L`` ``(n, 16, 16)`` and the group scales ``(n, 16)``."""
    nb = x.shape[0]
    xt = np.ascontiguousarray(x.reshape(nb * 16, 16).T)
    lq, scales = make_qx_quants(xt, 32, np.ascontiguousarray(qw.reshape(nb * 16, 16).T))
    return x.reshape(nb, 16, 16), lq.T.reshape(nb, 16, 16), scales.reshape(nb, 16)


def k4(x: np.ndarray, qw: np.ndarray, *, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """quantize_row_q4_K_impl (``nmax`` 15) / q5_K (31): ``(n, 256)`` -> the 16 header bytes
    (d, dmin, scales[12]) and ``L`` ``(n, 8, 32)``, as :func:`kquant_search.quantize_k4`."""
    nb = x.shape[0]
    sub = x.reshape(nb, 8, 32)
    w = super_block_weights(x, qw, 2)
    lq, scales, mins = search_sub_blocks(x, w, 32, nmax=nmax, **QKX3)
    swt = np.ascontiguousarray(
        c_sum(np.ascontiguousarray(w.reshape(nb * 8, 32).T)).reshape(nb, 8).T
    )
    ls, d_block = make_qp_quants(np.ascontiguousarray(scales.T), swt, 63)
    lm, m_block = make_qp_quants(np.ascontiguousarray(mins.T), swt, 63)
    ls, lm = ls.T, lm.T
    if nmax == 31:  # Q5_K clamps; Q4_K stores the (at most 63, or wrapped) level as it is
        ls, lm = np.minimum(63, ls), np.minimum(63, lm)
    packed = pack_scales_k4(ls, lm)
    # requantize against the scales as stored: read back from the packed bytes
    sc, m = scale_min_k4(packed, xp=np)
    d, dmin = fp16(d_block).reshape(-1, 1), fp16(m_block).reshape(-1, 1)
    lq = requantize(sub, d * sc.astype(F32), lq, lo=0, hi=nmax, dm=dmin * m.astype(F32))
    header = np.concatenate(
        [fp16_bytes(d_block.reshape(-1, 1)), fp16_bytes(m_block.reshape(-1, 1)), packed], axis=1
    )
    return header, lq
