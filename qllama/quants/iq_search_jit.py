"""The grid quantizers' searches, compiled (numba): the numpy oracles' results, faster.

Each function here is the loop of a numpy path, run where numba is installed
(:func:`qllama.quants.iq_grids.compiled`) with the same float32 operations in the same order
(no fast-math, so no FMA contraction), so the same bytes:

* :func:`nearest`: :meth:`qllama.quants.iq_grids.Grid.nearest`, ggml's
  ``iq2_find_best_neighbour`` and its siblings: ``d2`` from 0 in coordinate order,
  ``(w*diff)*diff``, the first strictly smallest kept;
* :func:`grid_trials`: the trial scales and the refit of
  :class:`qllama.quants.iq_search.GridSearch` (IQ2_XXS .. IQ3_S), a sub-block at a time;
* :func:`split_s`, :func:`split_m`: IQ1_S's and IQ1_M's exhaustive split
  (:mod:`qllama.quants.iq1_search`);
* :func:`iq4_scales`: IQ4_NL's and IQ4_XS's scale search (:mod:`qllama.quants.iq4_search`),
  which every IQ file type also runs for the tensors whose rows are not a multiple of 256.

``tests/test_quants_iq_grid.py`` and ``tests/test_quants_new_types.py`` check both paths
against ggml's bytes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from qllama.jit import JIT

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)


@njit(**JIT)
def nearest(start, count, flat, table, variant, u, x, w, scale):
    """For each group ``g``: the grid index, among ``flat[start[u[g]]:][:count[u[g]]]``, of
    the smallest ``sum_i (w[g,i]*diff)*diff``, ``diff = scale[g]*table[variant[g], i, j] -
    x[g, i]``; the first of equal ones; -1 where none is below FLT_MAX (ggml's start value:
    it aborts there). ``(m,)`` int32."""
    m, dims = x.shape
    out = np.empty(m, np.int32)
    for g in range(m):
        s0 = start[u[g]]
        v = variant[g]
        sc = scale[g]
        best = FLT_MAX
        pick = -1
        for c in range(count[u[g]]):
            j = flat[s0 + c]
            d2 = F32(0)
            for i in range(dims):
                diff = sc * table[v, i, j] - x[g, i]
                d2 += (w[g, i] * diff) * diff
            if d2 < best:
                best = d2
                pick = j
        out[g] = pick
    return out


# --- IQ1_S / IQ1_M: the exhaustive split (qllama/quants/iq1_search.py) -------------------------


@njit(**JIT)
def _sort_order(x, order):
    """Indices of ``x`` in ascending order, ties in index order (a stable insertion sort,
    as :func:`~qllama.quants.iq1_search.sorted_order`)."""
    n = x.shape[0]
    for i in range(n):
        order[i] = i
    for i in range(1, n):
        j = i
        v = order[i]
        while j > 0 and x[order[j - 1]] > x[v]:
            order[j] = order[j - 1]
            j -= 1
        order[j] = v


@njit(**JIT)
def split_s(x, w, xp, xm):
    """:func:`~qllama.quants.iq1_search.split_s`'s scan for ``(m, n)`` sub-blocks: the sorted
    order ``(m, n)``, the kept candidate ``(m,)`` (split ``k // 2``, delta ``k % 2``; -1 for
    none) and its scale ``qx/q2`` ``(m,)`` (0 for none). Candidates as the numpy path scores
    them: prefix sums from 0, ``a*v0 + b*v1 + c*v2``, ``(wa*v0)*v0 + ...``."""
    m, n = x.shape
    order = np.empty((m, n), np.int64)
    kept = np.full(m, -1, np.int64)
    scale = np.zeros(m, np.float32)
    sx = np.empty(n + 1, np.float32)
    sw = np.empty(n + 1, np.float32)
    for r in range(m):
        o = order[r]
        _sort_order(x[r], o)
        sx[0] = F32(0)
        sw[0] = F32(0)
        for j in range(n):
            wj = w[r, o[j]]
            sx[j + 1] = sx[j] + wj * x[r, o[j]]
            sw[j + 1] = sw[j] + wj
        best = -FLT_MAX
        k = 0
        for i1 in range(n + 1):
            for i2 in range(i1, n + 1):
                a, b, c = sx[i1] - sx[0], sx[i2] - sx[i1], sx[n] - sx[i2]
                wa, wb, wc = sw[i1] - sw[0], sw[i2] - sw[i1], sw[n] - sw[i2]
                for v in range(2):
                    t = xp if v == 0 else xm
                    qx = a * t[0] + b * t[1] + c * t[2]
                    q2 = (wa * t[0]) * t[0] + (wb * t[1]) * t[1] + (wc * t[2]) * t[2]
                    if q2 > 0 and qx * qx > best * q2:
                        best = (qx / q2) * qx
                        kept[r] = k
                        scale[r] = qx / q2
                    k += 1
    return order, kept, scale


@njit(**JIT)
def split_m(x, w, xp, xm, cp, cm):
    """:func:`~qllama.quants.iq1_search.split_m`'s scan for ``(m, n)`` sub-blocks: the sorted
    order, the kept candidate (split ``k // 4``, deltas ``k % 4``; -1 for none) and its
    scale. Per half ``h``, prefix sums of that half's sorted values (the others adding 0)."""
    m, n = x.shape
    order = np.empty((m, n), np.int64)
    kept = np.full(m, -1, np.int64)
    scale = np.zeros(m, np.float32)
    px = np.empty((2, n + 1), np.float32)
    pw = np.empty((2, n + 1), np.float32)
    qx = np.empty((2, 2), np.float32)
    q2 = np.empty((2, 2), np.float32)
    for r in range(m):
        o = order[r]
        _sort_order(x[r], o)
        for h in range(2):
            px[h, 0] = F32(0)
            pw[h, 0] = F32(0)
            for j in range(n):
                mine = (o[j] >= n // 2) == (h == 1)
                wj = w[r, o[j]]
                px[h, j + 1] = px[h, j] + (wj * x[r, o[j]] if mine else F32(0))
                pw[h, j + 1] = pw[h, j] + (wj if mine else F32(0))
        best = -FLT_MAX
        k = 0
        for i1 in range(n + 1):
            for i2 in range(i1, n + 1):
                for h in range(2):
                    s = px[h, i1] + px[h, i2]
                    qx[h, 0] = px[h, n] * xp[2] - s
                    qx[h, 1] = px[h, n] * xm[2] - s
                    q2[h, 0] = (pw[h, n] * xp[2]) * xp[2] + pw[h, i1] * cp[0] + pw[h, i2] * cp[1]
                    q2[h, 1] = (pw[h, n] * xm[2]) * xm[2] + pw[h, i1] * cm[0] + pw[h, i2] * cm[1]
                for c in range(4):
                    a, b = c // 2, c % 2
                    sqx = qx[0, a] + qx[1, b]
                    sq2 = q2[0, a] + q2[1, b]
                    if sq2 > 0 and sqx * sqx > best * sq2:
                        best = (sqx / sq2) * sqx
                        kept[r] = k
                        scale[r] = sqx / sq2
                    k += 1
    return order, kept, scale


# --- IQ4_NL / IQ4_XS: the scale search (qllama/quants/iq4_search.py) ---------------------------


@njit(**JIT)
def _iq4_fit(x, w, col, iscale, below, levels, lq):
    """Levels of block ``col`` of ``(32, n)`` ``x`` at ``iscale`` into ``lq`` (ggml's
    ``best_index_int8`` by the midpoint table ``below``); returns ``sum(w*q*x)``,
    ``sum(w*q*q)`` from 0 in index order."""
    sumqx = F32(0)
    sumq2 = F32(0)
    for j in range(x.shape[0]):
        v = F32(2) * (iscale * x[j, col])
        if np.isnan(v):
            i = 15
        else:
            f = np.floor(v)
            f = min(max(f, F32(-256)), F32(256))
            i = below[int(f) + 256]
        lq[j] = i
        q = levels[i]
        wq = w[j, col] * q
        sumqx += wq * x[j, col]
        sumq2 += wq * q
    return sumqx, sumq2


@njit(**JIT)
def iq4_scales(x, w, mx, ntry, below, levels, k0):
    """:func:`~qllama.quants.iq4_search.search_scales`'s loop for ``(32, n)`` blocks ``x``,
    weights ``w`` and their signed largest values ``mx`` (1 for a zero block): the scale of
    each block ``(n,)`` and the levels of the first pass ``(32, n)`` uint8."""
    nb = x.shape[1]
    d_out = np.empty(nb, np.float32)
    first = np.empty((x.shape[0], nb), np.uint8)
    lq = np.empty(x.shape[0], np.uint8)
    for col in range(nb):
        d0 = (-mx[col] if ntry > 0 else mx[col]) / k0
        sumqx, sumq2 = _iq4_fit(x, w, col, F32(1) / d0, below, levels, lq)
        first[:, col] = lq
        d = sumqx / sumq2 if sumq2 > 0 else F32(0)
        best = d * sumqx
        for itry in range(-ntry, ntry + 1):
            sumqx, sumq2 = _iq4_fit(x, w, col, F32(itry + int(k0)) / mx[col], below, levels, lq)
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                d = sumqx / sumq2
                best = d * sumqx
        d_out[col] = d
    return d_out, first


# --- IQ2_XXS .. IQ3_S: the trial scales of GridSearch (qllama/quants/iq_search.py) -------------

_MAGIC = F32(12582912.0)  # 1.5 * 2**23: ggml's nearest_int


@njit(**JIT)
def _group_levels(x, c, g, dims, inv, kmax, bits, fbuf, ibuf, lv):
    """Levels ``clamp(nearest_int(0.5*(inv*x - 1)), 0, kmax - 1)`` of group ``g`` of row
    ``c`` of ``x`` into ``lv[g*dims:]``; returns the group's packed index ``u``."""
    u = 0
    for i in range(dims):
        e = g * dims + i
        fbuf[0] = F32(0.5) * (inv * x[c, e] - F32(1)) + _MAGIC
        v = (ibuf[0] & 0x007FFFFF) - 0x00400000  # ggml's nearest_int, from the float's bits
        v = min(max(v, 0), kmax - 1)
        lv[e] = v
        u |= v << (bits * i)
    return u


@njit(**JIT)
def _neighbour(x, waux, c, g, dims, u, scale, start, count, flat, ptable, points, lv):
    """The off-grid group ``g`` of row ``c`` onto its best listed neighbour under ``scale``
    (as :func:`nearest`); its levels into ``lv``. False where none beats FLT_MAX."""
    s0 = start[u]
    best = FLT_MAX
    pick = -1
    for k in range(count[u]):
        j = flat[s0 + k]
        d2 = F32(0)
        for i in range(dims):
            e = g * dims + i
            diff = scale * ptable[i, j] - x[c, e]
            d2 += (waux[c, e] * diff) * diff
        if d2 < best:
            best = d2
            pick = j
    if pick < 0:
        return False
    for i in range(dims):
        lv[g * dims + i] = points[pick, i]
    return True


@njit(**JIT)
def _fit(wx, w, c, lv):
    """``sum(w*x*q)``, ``sum(w*q*q)`` with ``q = 2l + 1``: float32 from 0, in index order."""
    sumqx = F32(0)
    sumq2 = F32(0)
    for e in range(lv.shape[0]):
        q = F32(2 * lv[e] + 1)
        sumqx += wx[c, e] * q
        sumq2 += (w[c, e] * q) * q
    return sumqx, sumq2


@njit(**JIT)
def grid_trials(
    x, w, denom, scale, deltas, top, kmax, dims, bits, flags, kmap, start, count, flat, ptable,
    points,
):  # fmt: skip
    """:meth:`~qllama.quants.iq_search.GridSearch._trials` for ``(m, sub)`` live sub-blocks
    ``x`` (folded values), weights ``w``, trial denominators ``denom`` and first scales
    ``scale``; ``deltas`` the trials' ``is*step``, ``flags`` (start_on_grid,
    refit_if_off_grid, refit_all). Returns the levels ``(m, sub)`` int32, the scales, and
    False where a neighbour search found none below FLT_MAX."""
    m, sub = x.shape
    groups = sub // dims
    start_on_grid, refit_if_off_grid, refit_all = flags[0], flags[1], flags[2]
    waux = np.sqrt(w)
    wx = w * x
    out = np.zeros((m, sub), np.int32)
    scales = scale.copy()
    trial = np.empty(sub, np.int32)
    off = np.empty(groups, np.bool_)
    on_grid = np.empty(groups, np.bool_)
    fbuf = np.empty(1, np.float32)
    ibuf = fbuf.view(np.int32)
    ok = True
    for c in range(m):
        best = F32(0)
        sc = scales[c]
        kept = out[c]
        on_grid[:] = start_on_grid
        for s in range(deltas.shape[0]):
            inv = (top + deltas[s]) / denom[c]
            at = F32(1) / inv
            for g in range(groups):
                u = _group_levels(x, c, g, dims, inv, kmax, bits, fbuf, ibuf, trial)
                off[g] = kmap[u] < 0
                if off[g]:
                    ok &= _neighbour(
                        x, waux, c, g, dims, u, at, start, count, flat, ptable, points, trial
                    )
            sumqx, sumq2 = _fit(wx, w, c, trial)
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                new = sumqx / sumq2
                sc = new
                best = new * sumqx
                kept[:] = trial
                for g in range(groups):
                    on_grid[g] = not off[g]
        redo = sc > 0
        if refit_if_off_grid:
            redo = redo and not on_grid.all()
        if redo:
            inv = F32(1) / sc
            for g in range(groups):
                if refit_all or not on_grid[g]:
                    u = _group_levels(x, c, g, dims, inv, kmax, bits, fbuf, ibuf, trial)
                    if kmap[u] < 0:
                        ok &= _neighbour(
                            x, waux, c, g, dims, u, sc, start, count, flat, ptable, points, trial
                        )
                else:
                    for i in range(dims):
                        trial[g * dims + i] = kept[g * dims + i]
            sumqx, sumq2 = _fit(wx, w, c, trial)
            if sumq2 > 0:
                sc = sumqx / sumq2
            kept[:] = trial
        scales[c] = sc
    return out, scales, ok
