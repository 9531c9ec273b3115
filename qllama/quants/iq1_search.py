"""What ggml's 1-bit quantizers (IQ1_S, IQ1_M) share: the exhaustive three-level split of
a sub-block, and the move of its groups of 8 onto the IQ1 grid.

Each sub-block (32 values for IQ1_S, 16 for IQ1_M) is fitted as ``scale * (l - 1 + delta)``
with levels ``l`` in {0, 1, 2} and ``delta = +-1/8``. Sorted by value, the best levels
split the sub-block at two points ``i1 <= i2``; ggml (``quantize_row_iq1_s_impl``,
``quantize_row_iq1_m_impl``) tries every split and both deltas (IQ1_M: a delta for each
half), scoring them from prefix sums, keeps the best in a fixed order, then puts each group
of 8 on the grid (off-grid ones: the best listed neighbour) and refits the scale.

Sub-blocks are processed all at once; the candidates are scored for all sub-blocks as
arrays, and the "keep the first best" scan runs over the candidates in ggml's order.
"""

from __future__ import annotations

import numpy as np

from qllama.quants import iq_grids
from qllama.quants.iq_grids import FLT_MAX, IQ1S
from qllama.quants.rounding import F32, c_sum

DELTA = F32(0.125)  # IQ1S_DELTA, IQ1M_DELTA
X_P = np.array([-1 + DELTA, DELTA, 1 + DELTA], dtype=F32)  # the level values, delta +1/8
X_M = np.array([-1 - DELTA, -DELTA, 1 - DELTA], dtype=F32)  # delta -1/8
# IQ1_M's q2 terms: the differences of the squared level values, float32 as C's
C_P = np.array([X_P[0] * X_P[0] - X_P[1] * X_P[1], X_P[1] * X_P[1] - X_P[2] * X_P[2]], F32)
C_M = np.array([X_M[0] * X_M[0] - X_M[1] * X_M[1], X_M[1] * X_M[1] - X_M[2] * X_M[2]], F32)
_CHUNK = 1 << 12  # sub-blocks scored at a time


def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The splits ``i1 <= i2`` of ``n`` sorted values, in ggml's loop order."""
    i1, i2 = np.triu_indices(n + 1)
    return i1, i2


def _prefix(a: np.ndarray) -> np.ndarray:
    """``(n, m)`` element-major -> ``(n + 1, m)`` running sums from 0, float32 in order."""
    out = np.zeros((a.shape[0] + 1, a.shape[1]), dtype=F32)
    for j in range(a.shape[0]):
        out[j + 1] = out[j] + a[j]
    return out


def _first_best(qx: np.ndarray, q2: np.ndarray) -> np.ndarray:
    """ggml's scan ``if (q2 > 0 && qx*qx > best*q2) {scale = qx/q2; best = scale*qx; ...}``
    from ``best = -FLT_MAX`` over candidates ``(k, m)`` in order: the kept index ``(m,)``
    (-1 where none was kept)."""
    best = np.full(qx.shape[1], -FLT_MAX, dtype=F32)
    kept = np.full(qx.shape[1], -1, dtype=np.int64)
    with np.errstate(all="ignore"):
        for k in range(qx.shape[0]):
            a, b = qx[k], q2[k]
            take = (b > 0) & (a * a > best * b)
            best = np.where(take, (a / b) * a, best)
            kept = np.where(take, k, kept)
    return kept


def sorted_order(x: np.ndarray) -> np.ndarray:
    """``(m, n)`` -> each sub-block's values in ascending order, ties in index order: glibc's
    ``qsort`` (a merge sort for arrays this small, so stable) with ggml's value comparator."""
    return np.argsort(x, axis=1, kind="stable")


def levels_from_split(order: np.ndarray, i1: np.ndarray, i2: np.ndarray) -> np.ndarray:
    """Level 0 for the ``i1`` smallest values, 1 up to ``i2``, 2 above: ``(m, n)`` int."""
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(order.shape[1]), axis=1)
    return (rank >= i1[:, None]).astype(np.int64) + (rank >= i2[:, None])


def split_s(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ1_S's split of live 32-value sub-blocks ``(m, 32)``: levels ``(m, 32)``, the signed
    scale ``(m,)`` and the delta's sign ``(m,)`` (+1, -1; 0 where no split was kept)."""
    n = x.shape[1]
    i1, i2 = _pairs(n)
    if iq_grids.compiled():  # the same scan, compiled
        from qllama.quants import iq_search_jit

        order, kept, sc = iq_search_jit.split_s(x, w, X_P, X_M)
        k = np.maximum(kept, 0)
        shift = np.where(kept >= 0, 1 - 2 * (k % 2), 0)
        return levels_from_split(order, i1[k // 2], i2[k // 2]), sc, shift
    levels = np.zeros(x.shape, dtype=np.int64)
    scale = np.zeros(x.shape[0], dtype=F32)
    shift = np.zeros(x.shape[0], dtype=np.int64)
    for s in range(0, x.shape[0], _CHUNK):
        part = slice(s, s + _CHUNK)
        order = sorted_order(x[part])
        xs = np.take_along_axis(x[part], order, axis=1).T
        ws = np.take_along_axis(w[part], order, axis=1).T
        sx, sw = _prefix(ws * xs), _prefix(ws)
        a, b, c = sx[i1] - sx[0], sx[i2] - sx[i1], sx[n] - sx[i2]
        wa, wb, wc = sw[i1] - sw[0], sw[i2] - sw[i1], sw[n] - sw[i2]
        qx, q2 = [], []
        for v in (X_P, X_M):
            qx.append(a * v[0] + b * v[1] + c * v[2])
            q2.append((wa * v[0]) * v[0] + (wb * v[1]) * v[1] + (wc * v[2]) * v[2])
        # candidates in ggml's order: each split with x_p, then with x_m
        qx_all = np.stack(qx, axis=1).reshape(-1, order.shape[0])
        q2_all = np.stack(q2, axis=1).reshape(-1, order.shape[0])
        kept = _first_best(qx_all, q2_all)
        ok = kept >= 0
        k = np.where(ok, kept, 0)
        cols = np.arange(order.shape[0])
        with np.errstate(all="ignore"):
            sc = np.where(ok, qx_all[k, cols] / q2_all[k, cols], F32(0))
        levels[part] = levels_from_split(order, i1[k // 2], i2[k // 2])
        scale[part] = sc
        shift[part] = np.where(ok, 1 - 2 * (k % 2), 0)
    return levels, scale, shift


def split_m(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ1_M's split of live 16-value sub-blocks ``(m, 16)``: levels ``(m, 16)``, the signed
    scale ``(m,)`` and the deltas' combination ``(m,)``: 0 (+,+), 1 (+,-), 2 (-,+), 3 (-,-)
    for the two halves of 8 (-1 where no split was kept).

    ggml scores it per half from prefix sums kept per half: with ``v`` the level values,
    ``sum(q*x) = T*v[2] - (P[i1] + P[i2])`` and
    ``sum(q*q) = W*v[2]*v[2] + Wp[i1]*(v[0]^2 - v[1]^2) + Wp[i2]*(v[1]^2 - v[2]^2)``.
    """
    n = x.shape[1]
    i1, i2 = _pairs(n)
    if iq_grids.compiled():  # the same scan, compiled
        from qllama.quants import iq_search_jit

        order, kept, sc = iq_search_jit.split_m(x, w, X_P, X_M, C_P, C_M)
        k = np.maximum(kept, 0)
        combo = np.where(kept >= 0, k % 4, -1)
        return levels_from_split(order, i1[k // 4], i2[k // 4]), sc, combo
    levels = np.zeros(x.shape, dtype=np.int64)
    scale = np.zeros(x.shape[0], dtype=F32)
    combo = np.full(x.shape[0], -1, dtype=np.int64)
    cp, cm = C_P, C_M
    for s in range(0, x.shape[0], _CHUNK):
        part = slice(s, s + _CHUNK)
        order = sorted_order(x[part])
        xs = np.take_along_axis(x[part], order, axis=1).T
        ws = np.take_along_axis(w[part], order, axis=1).T
        half = (order >= n // 2).T  # (n, m): which half each sorted value is in
        qx, q2 = {}, {}
        for h in (0, 1):
            mine = half == bool(h)
            px = _prefix(np.where(mine, ws * xs, F32(0)))
            pw = _prefix(np.where(mine, ws, F32(0)))
            # C: px[h][j+1] = px[h][j] + w*x only for this half's values, else a copy: adding
            # the zeros above gives the same floats
            sx = px[i1] + px[i2]
            qx[h, 0] = px[n] * X_P[2] - sx
            qx[h, 1] = px[n] * X_M[2] - sx
            q2[h, 0] = (pw[n] * X_P[2]) * X_P[2] + pw[i1] * cp[0] + pw[i2] * cp[1]
            q2[h, 1] = (pw[n] * X_M[2]) * X_M[2] + pw[i1] * cm[0] + pw[i2] * cm[1]
        # candidates in ggml's order: each split, then the combinations 0..3
        qx_all = np.stack([qx[0, a] + qx[1, b] for a, b in ((0, 0), (0, 1), (1, 0), (1, 1))], 1)
        q2_all = np.stack([q2[0, a] + q2[1, b] for a, b in ((0, 0), (0, 1), (1, 0), (1, 1))], 1)
        m = order.shape[0]
        qx_all, q2_all = qx_all.reshape(-1, m), q2_all.reshape(-1, m)
        kept = _first_best(qx_all, q2_all)
        ok = kept >= 0
        k = np.where(ok, kept, 0)
        cols = np.arange(m)
        with np.errstate(all="ignore"):
            sc = np.where(ok, qx_all[k, cols] / q2_all[k, cols], F32(0))
        levels[part] = levels_from_split(order, i1[k // 4], i2[k // 4])
        scale[part] = sc
        combo[part] = np.where(ok, k % 4, -1)
    return levels, scale, combo


def onto_grid(
    levels: np.ndarray, x: np.ndarray, w: np.ndarray, scale: np.ndarray, minus: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Put each group of 8 of sub-blocks ``(m, n)`` on the IQ1 grid, then refit the scale.

    ``levels`` ``(m, n)`` from the split (already mirrored so that ``scale >= 0``);
    ``minus`` ``(m, n // 8)``: whether each group's delta is -1/8 (level values X_M, else
    X_P). Off-grid groups take ggml's ``iq1_find_best_neighbour2`` (signed ``x``, plain
    weights ``w``). Where a group was off the grid the scale becomes
    ``sum(w*q*x) / sum(w*q*q)`` when both are positive. Returns the grid index of each group
    ``(m, n // 8)`` and the scales.
    """
    m, n = x.shape
    groups = n // 8
    u = IQ1S.pack(levels.reshape(m, groups, 8))  # (m, groups)
    index = IQ1S.kmap[u].astype(np.int64)
    off = index < 0
    if off.any():
        r, g = np.nonzero(off)
        xg = x.reshape(m, groups, 8)[r, g]
        wg = w.reshape(m, groups, 8)[r, g]
        variants = np.stack([X_P, X_M])
        index[r, g] = IQ1S.nearest(
            u[r, g], xg, wg, scale[r], variants, minus[r, g].astype(np.int64)
        )
        redo = np.flatnonzero(off.any(axis=1))
        grid_lv = IQ1S.points[index[redo]]  # (k, groups, 8)
        q = variants[minus[redo][..., None].astype(np.int64), grid_lv].reshape(-1, n)
        wq = w[redo] * q
        sumqx = c_sum(np.ascontiguousarray((wq * x[redo]).T))
        sumq2 = c_sum(np.ascontiguousarray((wq * q).T))
        with np.errstate(all="ignore"):
            refit = (sumqx > 0) & (sumq2 > 0)
            scale = scale.copy()
            scale[redo] = np.where(refit, sumqx / sumq2, scale[redo])
    return index, scale
