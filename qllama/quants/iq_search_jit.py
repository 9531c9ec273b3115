"""The IQ quantizers' neighbour search, compiled (numba): the numpy oracle's result, faster.

:meth:`qllama.quants.iq_grids.Grid.nearest` is where ggml's IQ quantizers spend their time
(every off-grid group of every trial scale tries its whole neighbour list); it calls
:func:`nearest` here when numba is installed. The loops are ggml's
(``iq2_find_best_neighbour`` and its siblings): float32, ``d2`` from 0 in coordinate order,
``(w*diff)*diff``, the first strictly smallest kept; no fast-math, so no FMA contraction.
``tests/test_quants_iq_grid.py`` checks it against the numpy path bit for bit.
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
