"""What the K-quant weight formats share: ggml's scale search and its 6-bit scale packing.

``make_qkx2_quants`` fits ``x ~ scale * L - the_min`` per sub-block (Q2_K, Q4_K, Q5_K);
``pack_scales_k4`` / ``scale_min_k4`` write and read the twelve bytes in which Q4_K and Q5_K
keep eight 6-bit scales and eight 6-bit mins; ``quantize_k4`` / ``dequantize_k4`` are the
parts of those two formats that differ only in the bits per value.

The search works on sub-blocks laid out *element-major*, ``(n, n_sub)``: ggml's float32 sums
run over the ``n`` elements of one sub-block in index order, so each sum here is a loop of
``n`` vector additions across all sub-blocks at once, which is both exact and fast.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.quants.base import Fields
from qllama.quants.rounding import F32, fp16, fp16_bytes, seq_sum

_MAGIC = F32(12582912.0)  # 1.5 * 2**23
_SEARCH_ELEMENTS = 1 << 17  # elements searched at a time


def nearest_int(x: np.ndarray) -> np.ndarray:
    """ggml ``nearest_int`` bit for bit: add 1.5 * 2**23 and read the low mantissa bits.

    Round half to even where ggml asserts it is valid (|x| <= 4194303). Unlike ``np.rint`` it
    also reproduces what ggml's release build returns outside that range and for inf / NaN
    (a degenerate search step divides by zero), so those steps are rejected as in C.
    """
    v = np.asarray(x, dtype=F32) + _MAGIC
    return (v.view(np.int32) & 0x007FFFFF) - 0x00400000


def _loop_sum(a: np.ndarray, *, from_zero: bool = True) -> np.ndarray:
    """Float32 sum over axis 0 in index order, as a C ``+=`` loop.

    ``from_zero`` is ``acc = 0; acc += a[i]`` (differs from starting at ``a[0]`` only in the
    sign of an all-zero sum); otherwise ``acc = a[0]; acc += a[i], i >= 1``.
    """
    acc = a[0] + F32(0) if from_zero else a[0].copy()
    for row in a[1:]:
        acc += row
    return acc


def make_qkx2_quants(
    x: np.ndarray,
    w: np.ndarray,
    *,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml ``make_qkx2_quants`` for many sub-blocks at once.

    ``x``, ``w``: ``(n, n_sub)`` float32, element-major. Returns ``L`` (``(n, n_sub)`` uint8,
    in [0, nmax]), ``scale`` and ``the_min`` (``(n_sub,)`` float32, ``x ~ scale * L - the_min``).
    """
    x = np.asarray(x, dtype=F32)
    w = np.asarray(w, dtype=F32)
    err = np.abs if use_mad else np.square
    sum_w = _loop_sum(w, from_zero=False)
    sum_x = _loop_sum(w * x, from_zero=False)
    mx = np.max(x, axis=0)
    mn = np.min(x, axis=0)  # the sign of a zero min never reaches the bytes
    mn = np.where(mn > 0, F32(0), mn)
    flat = mx == mn

    with np.errstate(all="ignore"):
        iscale = F32(nmax) / np.where(flat, F32(1), mx - mn)
        scale = F32(1) / iscale
        lq = np.clip(nearest_int(iscale * (x - mn)), 0, nmax)
        lf = lq.astype(F32)
        best = _loop_sum(w * err(scale * lf + mn - x))
        for step in range(nstep + 1):
            # `min` is a running variable in ggml: an accepted step moves it, and every later
            # step measures x - min and max - min from the new value.
            num = F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)
            laux = np.clip(nearest_int((num / (mx - mn)) * (x - mn)), 0, nmax)
            la = laux.astype(F32)
            wl = w * la
            sum_l = _loop_sum(wl)
            sum_l2 = _loop_sum(wl * la)
            sum_xl = _loop_sum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            clamp = this_min > 0
            this_min = np.where(clamp, F32(0), this_min)
            this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
            cur = _loop_sum(w * err(this_scale * la + this_min - x))
            take = (det > 0) & (cur < best) & ~flat
            lq = np.where(take, laux, lq)
            best = np.where(take, cur, best)
            scale = np.where(take, this_scale, scale)
            mn = np.where(take, this_min, mn)

    lq = np.where(flat, 0, lq)
    scale = np.where(flat, F32(0), scale)
    return lq.astype(np.uint8), scale.astype(F32), (-mn).astype(F32)


def super_scale(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per super-block: ``max(0, values)`` over axis 1 and its quantization to ``levels``.

    Returns ``q`` (int32, ``nearest_int(levels / max * values)``, 0 when max is 0; the caller
    narrows it as ggml's store does) and ``d`` (``(n, 1)`` float32, ``fp16(max / levels)``
    read back).
    """
    top = np.max(values, axis=1, keepdims=True)
    top = np.where(top > 0, top, F32(0))  # ggml's scan starts at 0 and keeps strict maxima
    with np.errstate(divide="ignore"):
        inv = np.where(top > 0, F32(levels) / top, F32(0)).astype(F32)
    q = nearest_int(inv * values)
    return q, fp16(top / F32(levels))


def quantize_scales_k4(
    scales: np.ndarray, mins: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: ``(n, 8)`` float scales and mins -> 6-bit ``ls``, ``lm`` and fp16 d, dmin.

    ggml stores ``nearest_int`` into a uint8 before clamping to 63, so a negative scale
    wraps to 255 and clamps to 63; the ``& 0xFF`` keeps that.
    """
    qs, d = super_scale(scales, 63)
    qm, dmin = super_scale(mins, 63)
    ls = np.minimum(qs & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(qm & 0xFF, 63).astype(np.uint8)
    return ls, lm, d, dmin


def pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """``(n, 8)`` 6-bit scales and mins -> ``(n, 12)`` bytes, as :func:`scale_min_k4` reads them."""
    lo_s, hi_s = ls[:, :4], ls[:, 4:]
    lo_m, hi_m = lm[:, :4], lm[:, 4:]
    return np.concatenate(
        [
            lo_s | ((hi_s >> 4) << 6),
            lo_m | ((hi_m >> 4) << 6),
            (hi_s & 0x0F) | ((hi_m & 0x0F) << 4),
        ],
        axis=1,
    ).astype(np.uint8)


def scale_min_k4(scales: Any, *, xp: Any) -> tuple[Any, Any]:
    """ggml ``get_scale_min_k4``: ``(n, 12)`` uint8 -> 6-bit scales, mins, ``(n, 8)`` uint8 each.

    Scales A..H and mins a..h (bit 7 on the left)::

        byte  0 EEAAAAAA    4 eeaaaaaa    8 eeeeEEEE
              1 FFBBBBBB    5 ffbbbbbb    9 ffffFFFF
              2 GGCCCCCC    6 ggcccccc   10 ggggGGGG
              3 HHDDDDDD    7 hhdddddd   11 hhhhHHHH

    Sub-blocks 0-3 keep their six bits whole in bytes 0-7; sub-blocks 4-7 put their low four
    bits in bytes 8-11 and their top two in the spare top bits of bytes 0-7.
    """
    s_lo = scales[:, 0:4]
    m_lo = scales[:, 4:8]
    hi = scales[:, 8:12]
    sc = xp.concat([s_lo & 63, (hi & 15) | ((s_lo >> 6) << 4)], axis=1)
    mn = xp.concat([m_lo & 63, (hi >> 4) | ((m_lo >> 6) << 4)], axis=1)
    return sc, mn


def requantize(
    x: np.ndarray,
    dd: np.ndarray,
    dm: np.ndarray,
    lq: np.ndarray,
    nmax: int,
) -> np.ndarray:
    """ggml's last pass: ``L = clamp(nearest_int((x + dm) / dd), 0, nmax)`` from stored scales.

    ``x``: ``(n_blocks, n_sub, n)``; ``dd``, ``dm``: ``(n_blocks, n_sub)`` float32 (stored
    super-scale times the 4/6-bit sub-scale); ``lq``: the search's L, same shape as ``x``.
    Sub-blocks with ``dd == 0`` keep ``lq``: ggml skips them, leaving the search's values.
    """
    keep = dd == 0
    den = np.where(keep, F32(1), dd)[..., None]
    q = np.clip(nearest_int((x + dm[..., None]) / den), 0, nmax)
    return np.where(keep[..., None], lq, q).astype(np.uint8)


def search_sub_blocks(
    x: np.ndarray, w: np.ndarray, n: int, **params: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run :func:`make_qkx2_quants` on ``(n_blocks, 256)`` ``x`` split into sub-blocks of ``n``.

    Returns ``L`` ``(n_blocks, 256 // n, n)`` uint8 and ``scales``, ``mins``
    ``(n_blocks, 256 // n)`` float32.
    """
    nb, k = x.shape
    n_sub = k // n
    lq = np.empty((nb, n_sub, n), dtype=np.uint8)
    scales = np.empty((nb, n_sub), dtype=F32)
    mins = np.empty((nb, n_sub), dtype=F32)
    # The search makes a few dozen passes over its temporaries: keeping them in L2 is about
    # 2.5x faster than one pass over a whole 4M-element chunk.
    step = max(1, _SEARCH_ELEMENTS // k)
    for s in range(0, nb, step):
        part = slice(s, s + step)
        rows = x[part].shape[0] * n_sub

        def element_major(a: np.ndarray, rows: int = rows) -> np.ndarray:
            return np.ascontiguousarray(a.reshape(rows, n).T)

        lq_t, scale, the_min = make_qkx2_quants(
            element_major(x[part]), element_major(w[part]), **params
        )
        lq[part] = lq_t.T.reshape(-1, n_sub, n)
        scales[part] = scale.reshape(-1, n_sub)
        mins[part] = the_min.reshape(-1, n_sub)
    return lq, scales, mins


def quantize_k4(
    x: np.ndarray, *, nmax: int, rmin: float, nstep: int
) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K quantizer up to the packing of values: ``(n_blocks, 256)`` float32 ->
    the 16 header bytes (d, dmin, scales[12]) and L, ``(n_blocks, 8, 32)`` uint8 in [0, nmax].
    """
    nb = x.shape[0]
    sub = x.reshape(nb, 8, 32)
    # weights: RMS of the sub-block plus |x|
    av_x = np.sqrt(seq_sum(sub * sub) / F32(32))
    w = av_x[..., None] + np.abs(sub)
    lq, scales, mins = search_sub_blocks(
        x, w.reshape(nb, 256), 32, nmax=nmax, rmin=rmin, rdelta=0.1, nstep=nstep, use_mad=False
    )
    ls, lm, d, dmin = quantize_scales_k4(scales, mins)
    lq = requantize(sub, d * ls.astype(F32), dmin * lm.astype(F32), lq, nmax)
    header = np.concatenate([fp16_bytes(d), fp16_bytes(dmin), pack_scales_k4(ls, lm)], axis=1)
    return header, lq


def pack_nibbles_k4(lq: np.ndarray) -> np.ndarray:
    """``(n, 8, 32)`` values below 16 -> ``(n, 128)`` bytes, as :func:`nibbles_k4` reads them."""
    pairs = lq.reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def nibbles_k4(qs: Any, *, xp: Any) -> Any:
    """``(n, 128)`` uint8 -> ``(n, 8, 32)`` 4-bit values: byte ``32c + l`` holds element
    ``l`` of sub-block ``2c`` in its low nibble and of sub-block ``2c + 1`` in its high one."""
    q = xp.reshape(qs, (qs.shape[0], 4, 1, 32))
    return xp.reshape(xp.concat([q & 15, q >> 4], axis=2), (qs.shape[0], 8, 32))


def dequantize_k4(fields: Fields, q: Any, *, xp: Any) -> Any:
    """Q4_K / Q5_K values from the header fields and ``q`` ``(n, 8, 32)``: ``(n, 256)`` float32.

    ggml's order of operations: ``(d * sc) * q - (dmin * m)``.
    """
    n = q.shape[0]
    sc, m = scale_min_k4(fields["scales"], xp=xp)
    d = xp.reshape(fields["d"] * xp.astype(sc, xp.float32), (n, 8, 1))
    dm = xp.reshape(fields["dmin"] * xp.astype(m, xp.float32), (n, 8, 1))
    return xp.reshape(d * xp.astype(q, xp.float32) - dm, (n, 256))
