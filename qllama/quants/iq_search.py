"""What ggml's grid quantizers share: importance weights, folded signs, the search for the
best grid points under a scale, and the coding of the scales.

IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S (``quantize_row_*_impl`` in ggml-quants.c) all
fit each sub-block of 16 or 32 values as ``scale * (2l + 1) * sign``, the levels ``l`` of
each group of 8 (4 for IQ3) forming a point of the type's grid: per sub-block they try a
fixed series of scales, round every value to a level, move each group that lands off the
grid to its best listed neighbour, keep the trial with the best weighted least-squares fit,
then refit once. :class:`GridSearch` is that procedure, its variants as data.

Everything runs on all sub-blocks at once, laid out *element-major* ``(values, sub-blocks)``:
ggml's float32 sums run over the values of one sub-block in index order, so each sum here is
a loop of vector additions across sub-blocks (:func:`~qllama.quants.rounding.c_sum`), exact
and in C's order; products keep C's left-to-right grouping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from qllama.errors import ImatrixError, WeightValueError
from qllama.quants.base import ImatrixUse, Rounding
from qllama.quants.iq_grids import Grid, _check_found, compiled
from qllama.quants.rounding import F32, c_sum, fp16_bytes, nearest_int

_CHUNK_SUBBLOCKS = 1 << 13  # sub-blocks searched at a time: the temporaries stay in cache


class ImatrixQuantizer:
    """The quantize entry points of an IQ type, whose one quantizer ``_quantize(x, qw)`` takes
    the importance of each value, or None (ggml's built-in weights; types whose
    ``imatrix_use`` is "required" refuse that, as ggml aborts)."""

    imatrix_use: ClassVar[ImatrixUse]

    @classmethod
    def _quantize(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        if rounding != "ref":
            raise ValueError(f"{cls.__name__} quantizes with rounding ('ref',), not {rounding!r}")
        if cls.imatrix_use == "required":
            raise ImatrixError(f"{cls.__name__} needs an importance matrix")
        return cls._quantize(x, None)

    @classmethod
    def quantize_blocks_weighted(cls, x: np.ndarray, qw: np.ndarray) -> np.ndarray:
        return cls._quantize(x, qw)


# --- weights and signs -------------------------------------------------------------------------


def importance(
    x: np.ndarray, qw: np.ndarray | None, *, sigma_factor: int, fallback: str, name: str
) -> np.ndarray:
    """ggml's per-value weights for ``(n_blocks, 256)`` super-blocks ``x``.

    With an importance matrix ``qw`` (same shape): ``qw * sqrt(sigma2 + x*x)``, where
    ``sigma2 = sigma_factor * sum(x*x) / 256`` over the super-block (a float32 sum in index
    order). Without: ``fallback`` is ``"x2"`` (``x*x``: IQ3_XXS, IQ3_S, IQ1_M) or
    ``"sigma"`` (``0.25*sigma2 + x*x``: IQ2_S). Non-finite values (inputs, or squares and
    products that overflow float32) are refused: ggml's searches have no defined result
    for them.
    """
    if not np.all(np.isfinite(x)):
        raise WeightValueError(f"{name} cannot quantize NaN or infinite values")
    with np.errstate(over="ignore", invalid="ignore"):
        x2 = x * x
        sumx2 = c_sum(np.ascontiguousarray(x2.T))  # (n_blocks,)
        # C: 2*sumx2/QK_K, i.e. (2*sumx2)/256
        sigma2 = ((F32(sigma_factor) * sumx2) / F32(256))[:, None]
        if qw is not None:
            w = qw * np.sqrt(sigma2 + x2)
        elif fallback == "sigma":
            w = F32(0.25) * sigma2 + x2
        else:
            w = x2
    with np.errstate(over="ignore"):
        wx_finite = np.all(np.isfinite(w * x))
    if not (np.all(np.isfinite(w)) and wx_finite):
        raise WeightValueError(
            f"{name}: values too large to quantize (their squares or weights overflow float32)"
        )
    return w.astype(F32)


def fold_signs(x: np.ndarray, w: np.ndarray, *, parity: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(n, 256)`` values and weights -> the magnitudes the search fits and one sign byte
    per group of 8 (bit i set: value i is stored negative), ``(n, 256)`` and ``(n, 32)``.

    ``parity`` (IQ2_XXS, IQ2_XS, IQ3_XXS, which store 7 sign bits and imply the 8th): a
    group with an odd number of negatives gets the sign of its value of smallest ``w*x*x``
    (the first such) flipped, and that value is fitted as ``-|x|``.
    """
    n = x.shape[0]
    xg = x.reshape(-1, 8)
    neg = xg < 0
    xval = np.where(xg >= 0, xg, -xg)  # C's `x >= 0 ? x : -x` (keeps a -0.0)
    if parity:
        odd = np.flatnonzero(neg.sum(axis=1) % 2)
        with np.errstate(over="ignore"):  # an inf score is one C compares too
            score = (w.reshape(-1, 8)[odd] * xg[odd]) * xg[odd]
        imin = np.argmin(score, axis=1)  # first of equal minima, as C's strict <
        xval[odd, imin] = -xval[odd, imin]
        neg[odd, imin] = ~neg[odd, imin]
    signs = np.packbits(neg, axis=1, bitorder="little").reshape(n, 32)
    return xval.reshape(n, 256), signs


# --- ggml's make_qp_quants, the seed of IQ2_XXS's search ----------------------------------------


def make_qp_quants(x: np.ndarray, w: np.ndarray, nmax: int) -> np.ndarray:
    """ggml ``make_qp_quants(n, nmax, x, L, w)`` for many groups: ``x``, ``w`` ``(n, m)``
    element-major float32 -> the scales ``(m,)``.

    A scale for ``x ~ scale * L``, L in [0, nmax]: the best of 9 rounded iscales by
    weighted squared error, then up to 5 passes of coordinate descent on L. ggml keeps L in
    a ``uint8_t``, so a negative rounding (IQ2_XXS fits one value per group as ``-|x|``)
    wraps to 255 and is read back as that in the error and the descent; that is kept here.
    """
    n = x.shape[0]
    mx = np.max(x, axis=0, initial=F32(0))  # C: max = 0; max = MAX(max, x[i])
    zero = mx < F32(1e-15)  # GROUP_MAX_EPS
    mx = np.where(zero, F32(1), mx)
    wx = w * x
    with np.errstate(all="ignore"):
        iscale = F32(nmax) / mx
        lq = (nearest_int(iscale * x) & 0xFF).astype(F32)  # stored in uint8_t
        scale = F32(1) / iscale
        diff = x - scale * lq
        best_mse = c_sum((w * diff) * diff)
        for step in (-4, -3, -2, -1, 1, 2, 3, 4):
            iscale_is = (F32(0.1) * F32(step) + F32(nmax)) / mx
            scale_is = F32(1) / iscale_is
            lq = np.minimum(nmax, nearest_int(iscale_is * x)).astype(F32)
            diff = x - scale_is * lq
            mse = c_sum((w * diff) * diff)
            better = mse < best_mse
            best_mse = np.where(better, mse, best_mse)
            iscale = np.where(better, iscale_is, iscale)
        li = np.minimum(nmax, nearest_int(iscale * x))
        lf = li.astype(F32)
        sumlx = c_sum(wx * lf)
        suml2 = c_sum((w * lf) * lf)
        stored = li & 0xFF  # what L[i] holds, 0..255
        active = np.flatnonzero(~zero)
        for _ in range(5):
            if active.size == 0:
                break
            changed = np.zeros(active.size, dtype=bool)
            slx_a, sl2_a = sumlx[active], suml2[active]
            st_a = stored[:, active]
            for i in range(n):
                wi, xi, wxi = w[i, active], x[i, active], wx[i, active]
                li_f = st_a[i].astype(F32)
                slx = slx_a - wxi * li_f
                sl2 = sl2_a - (wi * li_f) * li_f
                ok = (slx > 0) & (sl2 > 0)
                new_l = np.minimum(nmax, nearest_int((xi * sl2) / slx))
                ok &= new_l != st_a[i]
                nl = new_l.astype(F32)
                slx = slx + wxi * nl
                sl2 = sl2 + (wi * nl) * nl
                take = ok & ((slx * slx) * sl2_a > (slx_a * slx_a) * sl2)
                st_a[i] = np.where(take, new_l & 0xFF, st_a[i])
                slx_a = np.where(take, slx, slx_a)
                sl2_a = np.where(take, sl2, sl2_a)
                changed |= take
            stored[:, active], sumlx[active], suml2[active] = st_a, slx_a, sl2_a
            active = active[changed]
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    return np.where(zero, F32(0), scale).astype(F32)


# --- the grid search -------------------------------------------------------------------------


@dataclass(frozen=True)
class GridSearch:
    """One grid quantizer's search, as ggml's ``quantize_row_*_impl`` runs it per sub-block.

    Trials ``is`` in ``steps``: ``id = (2*kmax - 1 + is*step) / max`` (``max`` the largest
    folded value; IQ2_XXS: three times the scale of :func:`make_qp_quants`), levels
    ``l = clamp(nearest_int(0.5*(id*x - 1)), 0, kmax - 1)``, off-grid groups moved to their
    best neighbour under the scale ``1/id``; a trial is kept if its weighted fit beats the
    best so far. Then, where the scale is positive (and, if ``refit_if_off_grid``, the kept
    trial had an off-grid group), the levels are recomputed with that scale for the off-grid
    groups or all (``refit_all``) and the scale is refitted.
    """

    grid: Grid
    sub: int  # values per scale: 16 or 32
    kmax: int  # levels the search rounds to: 3 (IQ2) or 8 (IQ3)
    steps: range  # the trial steps is
    step: float  # 0.1 (IQ2) or 0.2 (IQ3)
    eps: float  # a sub-block whose largest folded value is below this is zero (0: exactly 0)
    start_on_grid: bool  # the "kept trial's groups were on the grid" flags before any trial
    refit_if_off_grid: bool  # refit only if the kept trial had an off-grid group
    refit_all: bool  # refit recomputes every group, not only the off-grid ones
    seed_qp: bool = False  # IQ2_XXS: trials relative to make_qp_quants' scale, not the max

    @property
    def positions(self) -> np.ndarray:
        """The fitted value of each level: ``2l + 1``."""
        return (2 * np.arange(self.kmax) + 1).astype(F32)

    def run(
        self, xval: np.ndarray, w: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Search ``(n, 256)`` folded values with weights ``w``.

        Returns the grid index of each group ``(n, 256 // dims)`` int32, and per sub-block
        ``(n, 256 // sub)``: its scale (float32, >= 0), whether the scale came out negative
        (ggml then stores ``-scale`` with every sign of the sub-block flipped) and whether it
        was searched at all (a zero sub-block, which ggml leaves as zero bytes, was not: its
        scale and indices are 0).
        """
        n = xval.shape[0]
        per = 256 // self.sub
        xs = xval.reshape(-1, self.sub)
        ws = w.reshape(-1, self.sub)
        gi = np.zeros((xs.shape[0], self.sub // self.grid.dims), dtype=np.int32)
        scales = np.zeros(xs.shape[0], dtype=F32)
        flip = np.zeros(xs.shape[0], dtype=bool)
        live = np.zeros(xs.shape[0], dtype=bool)
        for s in range(0, xs.shape[0], _CHUNK_SUBBLOCKS):
            part = slice(s, s + _CHUNK_SUBBLOCKS)
            xt, wt = np.ascontiguousarray(xs[part].T), np.ascontiguousarray(ws[part].T)
            g, sc, fl, lv = self._search(xt, wt)
            gi[part], scales[part], flip[part], live[part] = g.T, sc, fl, lv
        by_sub = (n, per)
        return gi.reshape(n, -1), scales.reshape(by_sub), flip.reshape(by_sub), live.reshape(by_sub)

    def _search(
        self, x: np.ndarray, w: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Element-major ``(sub, m)`` -> grid indices ``(groups, m)``; scales, flips, live
        ``(m,)``."""
        groups = self.sub // self.grid.dims
        m = x.shape[1]
        mx = np.max(x, axis=0)
        live = mx >= F32(self.eps) if self.eps else mx != 0
        gi = np.zeros((groups, m), dtype=np.int32)
        scales = np.zeros(m, dtype=F32)
        flip = np.zeros(m, dtype=bool)
        cols = np.flatnonzero(live)
        if cols.size == 0:
            return gi, scales, flip, live
        x, w, mx = x[:, cols], w[:, cols], mx[cols]
        with np.errstate(all="ignore"):
            denom = mx
            if self.seed_qp:
                scale = make_qp_quants(x, w, self.kmax + 1)
                denom = scale * F32(self.kmax)  # ggml's eff_max; <= 0: a zero sub-block
                keep = denom > 0
                cols, x, w, denom, scale = (
                    cols[keep],
                    x[:, keep],
                    w[:, keep],
                    denom[keep],
                    scale[keep],
                )
                live[:] = False
                live[cols] = True
                if cols.size == 0:
                    return gi, scales, flip, live
            else:
                scale = mx / F32(2 * self.kmax - 1)
            lv, scale = self._trials(x, w, denom, scale)
            gi[:, cols] = self.grid.kmap[self.grid.pack(lv.reshape(groups, -1, len(cols)), axis=1)]
        assert np.all(gi >= 0), "a level pattern off the grid survived the search"
        scales[cols] = np.abs(scale)
        flip[cols] = scale < 0
        return gi, scales, flip, live

    def _trials(
        self, x: np.ndarray, w: np.ndarray, denom: np.ndarray, scale: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The trial loop and the refit for live sub-blocks: -> levels ``(sub, m)``, scales."""
        if compiled():
            return self._trials_compiled(x, w, denom, scale)
        groups = self.sub // self.grid.dims
        m = x.shape[1]
        waux = np.sqrt(w)
        wx = w * x
        best = np.zeros(m, dtype=F32)
        lv = np.zeros((self.sub, m), dtype=np.int32)
        on_grid = np.full((groups, m), self.start_on_grid)
        top = F32(2 * self.kmax - 1)
        for step in self.steps:
            inv = (top + F32(step) * F32(self.step)) / denom  # C: 2*kMaxQ-1 + is*step
            trial, off = self._levels(x, waux, inv, F32(1) / inv, None)
            sumqx, sumq2 = self._fit(wx, w, trial)
            take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            new = sumqx / sumq2
            scale = np.where(take, new, scale)
            best = np.where(take, new * sumqx, best)
            lv = np.where(take, trial, lv)
            on_grid = np.where(take, ~off, on_grid)
        redo = scale > 0
        if self.refit_if_off_grid:
            redo &= ~on_grid.all(axis=0)
        c = np.flatnonzero(redo)
        if c.size:
            select = None if self.refit_all else ~on_grid[:, c]
            sc = scale[c]
            trial, _ = self._levels(x[:, c], waux[:, c], F32(1) / sc, sc, select)
            if select is not None:
                trial = np.where(np.repeat(select, self.grid.dims, axis=0), trial, lv[:, c])
            sumqx, sumq2 = self._fit(wx[:, c], w[:, c], trial)
            scale[c] = np.where(sumq2 > 0, sumqx / sumq2, sc)
            lv[:, c] = trial
        return lv, scale

    def _trials_compiled(
        self, x: np.ndarray, w: np.ndarray, denom: np.ndarray, scale: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_trials` compiled (:func:`qllama.quants.iq_search_jit.grid_trials`), one
        sub-block at a time: the same levels and scales."""
        from qllama.quants import iq_search_jit

        g = self.grid
        start, count, flat = g._neighbours
        deltas = np.array([F32(st) * F32(self.step) for st in self.steps], dtype=F32)
        flags = np.array([self.start_on_grid, self.refit_if_off_grid, self.refit_all])
        lv, scales, ok = iq_search_jit.grid_trials(
            np.ascontiguousarray(x.T),  # (m, sub): a sub-block's values in a row
            np.ascontiguousarray(w.T),
            np.ascontiguousarray(denom, dtype=F32),
            np.ascontiguousarray(scale, dtype=F32),
            deltas,
            F32(2 * self.kmax - 1),
            self.kmax,
            g.dims,
            g.bits,
            flags,
            g.kmap,
            start,
            count,
            flat,
            np.ascontiguousarray(self.positions[g.points.T]),  # (dims, points): 2l + 1
            g.points,
        )
        _check_found(np.array([ok]))
        return np.ascontiguousarray(lv.T), scales

    def _levels(
        self,
        x: np.ndarray,
        waux: np.ndarray,
        inv: np.ndarray,
        scale: np.ndarray,
        select: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Round ``(sub, m)`` values to levels with ``inv`` (1/scale) and put each group on the
        grid (off-grid ones: the best neighbour under ``scale``, weights ``waux``). Only the
        groups in ``select`` ``(groups, m)`` are searched (all if None). Returns the levels
        ``(sub, m)`` and which groups were off the grid ``(groups, m)``."""
        dims = self.grid.dims
        groups = self.sub // dims
        lv = np.clip(nearest_int(F32(0.5) * (inv * x - F32(1))), 0, self.kmax - 1)
        lv3 = lv.reshape(groups, dims, -1)
        u = self.grid.pack(lv3, axis=1)  # (groups, m)
        off = self.grid.kmap[u] < 0
        todo = off if select is None else off & select
        if todo.any():
            g, c = np.nonzero(todo)
            xg = x.reshape(groups, dims, -1)[g, :, c]
            wg = waux.reshape(groups, dims, -1)[g, :, c]
            best = self.grid.nearest(u[g, c], xg, wg, scale[c], self.positions[None])
            lv3[g, :, c] = self.grid.points[best]
        return lv, off

    @staticmethod
    def _fit(wx: np.ndarray, w: np.ndarray, lv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``sum(w*x*q)``, ``sum(w*q*q)`` with ``q = 2l + 1``: float32, in index order."""
        q = (2 * lv + 1).astype(F32)
        return c_sum(wx * q), c_sum((w * q) * q)


# --- the super-block scale -------------------------------------------------------------------


def sign_scale_words(signs: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """IQ2_XXS / IQ3_XXS: the u32 of each 32-block, its four 7-bit sign fields at bits
    ``7l`` and its 4-bit scale at bit 28: ``(n, 32)`` sign bytes, ``(n, 8)`` codes ->
    ``(n, 32)`` little-endian bytes."""
    n = signs.shape[0]
    fields = (signs.reshape(n, 8, 4) & 127).astype(np.uint32) << (7 * np.arange(4, dtype=np.uint32))
    words = np.bitwise_or.reduce(fields, axis=2) | (codes.astype(np.uint32) << 28)
    return words.astype("<u4").view(np.uint8)


def scale_codes(
    scales: np.ndarray, *, levels: int, top: int, fudge: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's coding of the sub-block scales ``(n, n_sub)`` (all >= 0) under one fp16 ``d``.

    ``d = max_scale / levels``, stored as ``fp16(d * fudge)`` (ggml's fudge factors), and each
    sub-block's code ``clamp(nearest_int(0.5*(scale/d - 1)), 0, top)`` with ``1/d`` from the
    unfudged float32 ``d``. Returns the fp16 bytes ``(n, 2)``, the codes ``(n, n_sub)``
    uint8, and which super-blocks are all zero (ggml writes them as zero bytes).
    """
    max_scale = np.max(scales, axis=1, keepdims=True, initial=F32(0))
    zero = max_scale[:, 0] == 0
    d = max_scale / F32(levels)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = F32(1) / d
        codes = np.clip(nearest_int(F32(0.5) * (inv * scales - F32(1))), 0, top)
    codes[zero] = 0
    return fp16_bytes(d * F32(fudge)), codes.astype(np.uint8), zero


@dataclass(frozen=True)
class GridCode:
    """A grid quantizer's result for ``n`` super-blocks, ready to pack."""

    index: np.ndarray  # (n, 256 // dims) grid index of each group
    signs: np.ndarray  # (n, 32) sign byte of each group of 8 (all 8 bits; 0 where not live)
    codes: np.ndarray  # (n, 256 // sub) 4-bit scale code of each sub-block
    d: np.ndarray  # (n, 2) the fp16 super-block scale's bytes
    live: np.ndarray  # (n, 256 // sub) whether the sub-block was searched (else zero bytes)
    zero: np.ndarray  # (n,) super-blocks ggml writes as all-zero bytes


def quantize_grid(
    x: np.ndarray,
    qw: np.ndarray | None,
    search: GridSearch,
    *,
    sigma_factor: int,
    fallback: str,
    parity: bool,
    fudge: float,
    name: str,
) -> GridCode:
    """The common part of ggml's IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S quantizers on
    ``(n, 256)`` super-blocks (``qw`` the importance of each value, or None)."""
    w = importance(x, qw, sigma_factor=sigma_factor, fallback=fallback, name=name)
    xval, signs = fold_signs(x, w, parity=parity)
    index, scales, flip, live = search.run(xval, w)
    per_sub = search.sub // 8  # sign bytes per sub-block
    signs ^= np.repeat(flip, per_sub, axis=1).astype(np.uint8) * np.uint8(0xFF)
    signs[~np.repeat(live, per_sub, axis=1)] = 0
    d, codes, zero = scale_codes(scales, levels=31, top=15, fudge=fudge)
    return GridCode(index, signs, codes, d, live, zero)
