"""What the K-quant weight formats share: ggml's scale search and its 6-bit scale packing.

``make_qkx2_quants`` fits ``x ~ scale * L - the_min`` per sub-block (Q2_K, Q4_K, Q5_K),
``make_qx_quants`` (Q6_K) and ``make_q3_quants`` (Q3_K) fit ``x ~ scale * L`` per group of 16;
``pack_scales_k4`` / ``scale_min_k4`` write and read the twelve bytes in which Q4_K and Q5_K
keep eight 6-bit scales and eight 6-bit mins; ``quantize_k4`` / ``dequantize_k4`` are the
parts of those two formats that differ only in the bits per value.

The searches work on sub-blocks laid out *element-major*, ``(n, n_sub)``: ggml's float32 sums
run over the ``n`` elements of one sub-block in index order, so each sum here is a loop of
``n`` vector additions across all sub-blocks at once, which is both exact and fast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from qllama.quants.base import Fields, IntegerForm
from qllama.quants.rounding import F32, c_sum, first_absmax, fp16, fp16_bytes, nearest_int

_SEARCH_ELEMENTS = 1 << 17  # elements searched at a time


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
    sum_w = c_sum(w, from_zero=False)
    sum_x = c_sum(w * x, from_zero=False)
    # C scans `min = max = x[0]; if (x[i] < min) min = x[i]; ...`: a NaN never replaces the
    # running value, but a NaN x[0] stays. Filling NaNs with x[0] gives both.
    xs = np.where(np.isnan(x), x[0], x)
    mx = np.max(xs, axis=0)
    mn = np.min(xs, axis=0)  # the sign of a zero min never reaches the bytes
    mn = np.where(mn > 0, F32(0), mn)
    flat = mx == mn

    with np.errstate(all="ignore"):
        iscale = F32(nmax) / np.where(flat, F32(1), mx - mn)
        scale = F32(1) / iscale
        lq = np.clip(nearest_int(iscale * (x - mn)), 0, nmax)
        lf = lq.astype(F32)
        best = c_sum(w * err(scale * lf + mn - x))
        for step in range(nstep + 1):
            # `min` is a running variable in ggml: an accepted step moves it, and every later
            # step measures x - min and max - min from the new value.
            num = F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)
            laux = np.clip(nearest_int((num / (mx - mn)) * (x - mn)), 0, nmax)
            la = laux.astype(F32)
            wl = w * la
            sum_l = c_sum(wl)
            sum_l2 = c_sum(wl * la)
            sum_xl = c_sum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            clamp = this_min > 0
            this_min = np.where(clamp, F32(0), this_min)
            this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
            cur = c_sum(w * err(this_scale * la + this_min - x))
            take = (det > 0) & (cur < best) & ~flat
            lq = np.where(take, laux, lq)
            best = np.where(take, cur, best)
            scale = np.where(take, this_scale, scale)
            mn = np.where(take, this_min, mn)

    lq = np.where(flat, 0, lq)
    scale = np.where(flat, F32(0), scale)
    return lq.astype(np.uint8), scale.astype(F32), (-mn).astype(F32)


# ggml-quants.c GROUP_MAX_EPS: a group whose largest |x| is below this quantizes to zero
GROUP_MAX_EPS = F32(1e-15)


def make_qx_quants(
    xt: np.ndarray, nmax: int, weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """ggml ``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)`` for many groups at once.

    ``xt`` is ``(n, groups)`` float32, one group per column: element-major, so each step of
    ggml's sequential loop over a group's n elements is one contiguous row. Returns ``L``
    ``(n, groups)`` uint8 in ``[0, 2*nmax)`` and the signed scales ``(groups,)`` float32.

    The symmetric scale search: start from iscale = -nmax/max (max = the signed value of
    largest magnitude), then try 18 nearby iscales and keep the one with the best weighted
    least-squares fit: weights x**2, or ``weights`` (laid out as ``xt``; the importance
    matrix's ``qw``).
    """
    xt = np.asarray(xt, dtype=F32)
    mx = first_absmax(xt, axis=0)[0]
    zero = np.abs(mx) < GROUP_MAX_EPS
    mx = np.where(zero, F32(1), mx)  # the zero groups' results are overwritten below
    w = xt * xt if weights is None else np.asarray(weights, dtype=F32)
    wx = w * xt

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # C: sumlx += w*x[i]*l; suml2 += w*l*l, f32 in index order
        lq = np.clip(nearest_int(iscale * xt), -nmax, nmax - 1).astype(F32)
        return c_sum(wx * lq), c_sum(w * lq * lq)

    best_iscale = F32(-nmax) / mx
    sumlx, suml2 = fit(best_iscale)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            iscale = -(F32(nmax) + F32(0.1) * F32(step)) / mx
            sumlx, suml2 = fit(iscale)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            new_scale = sumlx / suml2
            best_iscale = np.where(better, iscale, best_iscale)
            scale = np.where(better, new_scale, scale)
            best = np.where(better, new_scale * sumlx, best)
    # L of the accepted iscale is the same expression ggml evaluates when it accepts it
    lq = np.clip(nearest_int(best_iscale * xt), -nmax, nmax - 1) + nmax
    lq = np.where(zero, 0, lq).astype(np.uint8)
    return lq, np.where(zero, F32(0), scale).astype(F32)


def make_q3_quants(xt: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml ``make_q3_quants(n, nmax, x, L, do_rmse=true)`` for many groups at once.

    ``xt`` is ``(n, groups)`` float32, element-major (one group per column). Returns ``L``
    ``(n, groups)`` uint8 in ``[0, 2*nmax)`` (0 for an all-zero group, not nmax) and the
    scales ``(groups,)`` float32.

    After the plain iscale = -nmax/max rounding, ggml re-optimises each element in turn (up
    to 5 passes; weights x**2), accepting a new level when it improves sumlx**2/suml2, and
    stops a group after a pass that changed nothing. The passes stay sequential over the n
    elements because every accepted change moves the running sums the next element sees;
    groups advance in lockstep, and a group that has stopped is masked out.
    """
    xt = np.asarray(xt, dtype=F32)
    n = xt.shape[0]
    mx = first_absmax(xt, axis=0)[0]
    zero = np.abs(mx) < GROUP_MAX_EPS
    iscale = F32(-nmax) / np.where(zero, F32(1), mx)
    lq = np.clip(nearest_int(iscale * xt), -nmax, nmax - 1).astype(F32)
    w = xt * xt
    wx = w * xt
    sumlx = c_sum(wx * lq)  # C: sumlx += w*x[i]*l; suml2 += w*l*l
    suml2 = c_sum(w * lq * lq)

    # Only the still-active groups are gathered for a pass. Those whose max is positive stop
    # after the first: every w*x*l term has the sign of -max, so slx > 0 never holds.
    active = np.flatnonzero(~zero)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for _ in range(5):
            if active.size == 0:
                break
            x_a, w_a, wx_a, l_a = xt[:, active], w[:, active], wx[:, active], lq[:, active]
            slx_a, sl2_a = sumlx[active], suml2[active]
            changed = np.zeros(active.size, dtype=bool)
            for i in range(n):
                li = l_a[i]
                slx = slx_a - wx_a[i] * li  # the sums without element i
                sl2 = sl2_a - w_a[i] * li * li
                new_l = np.clip(nearest_int(x_a[i] * sl2 / slx), -nmax, nmax - 1).astype(F32)
                tried = (slx > 0) & (new_l != li)
                slx = slx + wx_a[i] * new_l
                sl2 = sl2 + w_a[i] * new_l * new_l
                take = tried & (sl2 > 0) & (slx * slx * sl2_a > slx_a * slx_a * sl2)
                l_a[i] = np.where(take, new_l, li)
                slx_a = np.where(take, slx, slx_a)
                sl2_a = np.where(take, sl2, sl2_a)
                changed |= take
            lq[:, active], sumlx[active], suml2[active] = l_a, slx_a, sl2_a
            active = active[changed]
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    lq = np.where(zero, 0, lq + nmax).astype(np.uint8)
    return lq, np.where(zero, F32(0), scale).astype(F32)


def make_qp_quants(xt: np.ndarray, wt: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml ``make_qp_quants(n, nmax, x, L, quant_weights)`` for many groups at once: the
    unsigned fit ``x ~ scale * L`` of non-negative values (the sub-block scales and mins of
    Q2_K, Q4_K and Q5_K with an importance matrix; IQ2_XXS seeds its search with it).

    ``xt``, ``wt``: ``(n, groups)`` float32, element-major. Returns ``L`` ``(n, groups)``
    uint8 (at most ``nmax``; a negative level wraps as ggml's uint8 store does) and the
    scales ``(groups,)``: 0 where the group's max is below 1e-15.

    Nine iscales ``(nmax + 0.1 is) / max`` are tried on the weighted squared error (the first
    one unclamped, as in C), then up to 5 passes of coordinate descent move one level at a
    time while ``sumlx**2 / suml2`` grows; a group stops after a pass that changed nothing.
    """
    xt = np.asarray(xt, dtype=F32)
    wt = np.asarray(wt, dtype=F32)
    n = xt.shape[0]
    # C: max = MAX(max, x[i]) from 0 (a NaN x[i] replaces the running max)
    mx = np.zeros(xt.shape[1], dtype=F32)
    for row in xt:
        mx = np.where(mx > row, mx, row)
    zero = mx < GROUP_MAX_EPS
    mx = np.where(zero, F32(1), mx)

    def mse(scale: np.ndarray, lq: np.ndarray) -> np.ndarray:
        diff = xt - scale * lq.astype(F32)
        return c_sum(wt * diff * diff)  # C: w*diff*diff

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / mx
        first = nearest_int(iscale * xt) & 0xFF  # stored into uint8 L, unclamped
        best = mse(F32(1) / iscale, first)
        for step in (*range(-4, 0), *range(1, 5)):
            iscale_is = (F32(0.1) * F32(step) + F32(nmax)) / mx
            err = mse(F32(1) / iscale_is, np.minimum(nmax, nearest_int(iscale_is * xt)))
            better = err < best
            best = np.where(better, err, best)
            iscale = np.where(better, iscale_is, iscale)
        lq = np.minimum(nmax, nearest_int(iscale * xt))
        wx = wt * xt
        sumlx = c_sum(wx * lq.astype(F32))  # C: w*x[i]*l, w*l*l with the int l
        suml2 = c_sum(wt * lq.astype(F32) * lq.astype(F32))
        lq = (lq & 0xFF).astype(np.int64)  # L is uint8 from here on
        active = np.flatnonzero(~zero)
        for _ in range(5):
            if active.size == 0:
                break
            x_a, w_a, wx_a, l_a = xt[:, active], wt[:, active], wx[:, active], lq[:, active]
            slx_a, sl2_a = sumlx[active], suml2[active]
            changed = np.zeros(active.size, dtype=bool)
            for i in range(n):
                li = l_a[i].astype(F32)
                slx = slx_a - wx_a[i] * li
                sl2 = sl2_a - w_a[i] * li * li
                new_l = np.minimum(nmax, nearest_int(x_a[i] * sl2 / slx)).astype(np.int64)
                tried = (slx > 0) & (sl2 > 0) & (new_l != l_a[i])
                nf = new_l.astype(F32)
                slx = slx + wx_a[i] * nf
                sl2 = sl2 + w_a[i] * nf * nf
                take = tried & (slx * slx * sl2_a > slx_a * slx_a * sl2)
                l_a[i] = np.where(take, new_l & 0xFF, l_a[i])
                slx_a = np.where(take, slx, slx_a)
                sl2_a = np.where(take, sl2, sl2_a)
                changed |= take
            lq[:, active], sumlx[active], suml2[active] = l_a, slx_a, sl2_a
            active = active[changed]
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    lq = np.where(zero, 0, lq).astype(np.uint8)
    return lq, np.where(zero, F32(0), scale).astype(F32)


@np.errstate(over="ignore", invalid="ignore", divide="ignore")
def quantize_groups_16(
    x: np.ndarray,
    search: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]],
    nmax: int,
    finish: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
) -> np.ndarray:
    """Q3_K / Q6_K: run a symmetric search (:func:`make_q3_quants`, :func:`make_qx_quants`) on
    the sixteen 16-element groups of each ``(n_blocks, 256)`` block, then
    ``finish(x, L, scales)`` (``(n_blocks, 16, 16)`` twice, ``(n_blocks, 16)``) -> bytes.

    C overflows silently (huge inputs give an inf fp16 d, then inf/NaN steps ggml takes too),
    so numpy's warnings are off for both.
    """
    nb = x.shape[0]
    xs = x.reshape(nb, 16, 16)
    lq, scales = search(np.ascontiguousarray(xs.reshape(-1, 16).T), nmax)
    return finish(xs, lq.T.reshape(nb, 16, 16), scales.reshape(nb, 16))


def super_scale(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per super-block: ``max(0, values)`` over axis 1 and its quantization to ``levels``.

    Returns ``q`` (int32, ``nearest_int(levels / max * values)``, 0 when max is 0; the caller
    narrows it as ggml's store does) and ``d`` (``(n, 1)`` float32, ``fp16(max / levels)``
    read back).
    """
    # ggml's scan starts at 0 and keeps strict maxima, so NaNs and negatives never count
    top = np.max(np.where(values > 0, values, F32(0)), axis=1, keepdims=True)
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
    lq: np.ndarray,
    *,
    lo: int,
    hi: int,
    dm: np.ndarray | None = None,
) -> np.ndarray:
    """ggml's last pass over the stored scales: ``L = clamp(nearest_int((x + dm) / dd), lo, hi)
    - lo`` (``dm`` only for the formats with a min: Q2_K, Q4_K, Q5_K).

    ``x``: ``(n_blocks, n_sub, n)``; ``dd``, ``dm``: ``(n_blocks, n_sub)`` float32 (stored
    super-scale times the integer sub-scale); ``lq``: the search's L, same shape as ``x``.
    Sub-blocks with ``dd == 0`` keep ``lq``: ggml skips them, leaving the search's values.

    Known divergence, NaN payloads only: where ``x`` is a NaN with payload bits and ``dm`` is
    NaN too (an inf fp16 dmin times a zero min), ggml's x86 build keeps ``x``'s NaN for the
    first 28 elements of each 32-element loop and ``dm``'s for the last 4 (its vectorised
    loop and scalar tail order the addition differently); here ``x``'s NaN always wins.
    """
    keep = dd == 0
    den = np.where(keep, F32(1), dd)[..., None]
    num = x if dm is None else x + dm[..., None]
    q = np.clip(nearest_int(num / den), lo, hi) - lo
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
    av_x = np.sqrt(c_sum(np.moveaxis(sub * sub, -1, 0)) / F32(32))
    w = av_x[..., None] + np.abs(sub)
    lq, scales, mins = search_sub_blocks(
        x, w.reshape(nb, 256), 32, nmax=nmax, rmin=rmin, rdelta=0.1, nstep=nstep, use_mad=False
    )
    ls, lm, d, dmin = quantize_scales_k4(scales, mins)
    lq = requantize(sub, d * ls.astype(F32), lq, lo=0, hi=nmax, dm=dmin * lm.astype(F32))
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


def integer_form_k4(fields: Fields, q: np.ndarray, *, bound: int) -> IntegerForm:
    """Q4_K / Q5_K as their dot products see them: ``q`` ``(n, 8, 32)`` and the fields."""
    sc, m = scale_min_k4(fields["scales"], xp=np)
    return IntegerForm(
        q=q.reshape(-1, 256).astype(np.int8),
        d=fields["d"],
        scales=sc,
        mins=m,
        dmin=fields["dmin"],
        bound=bound,
        lanes=8,
    )


def dequantize_k4(fields: Fields, q: Any, *, xp: Any) -> Any:
    """Q4_K / Q5_K values from the header fields and ``q`` ``(n, 8, 32)``: ``(n, 256)`` float32.

    ggml's order of operations: ``(d * sc) * q - (dmin * m)``.
    """
    n = q.shape[0]
    sc, m = scale_min_k4(fields["scales"], xp=xp)
    d = xp.reshape(fields["d"] * xp.astype(sc, xp.float32), (n, 8, 1))
    dm = xp.reshape(fields["dmin"] * xp.astype(m, xp.float32), (n, 8, 1))
    return xp.reshape(d * xp.astype(q, xp.float32) - dm, (n, 256))
