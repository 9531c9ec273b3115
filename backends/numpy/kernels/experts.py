"""ggml's ``mul_mat_id`` on the CPU, compiled: a mixture of experts' products in one call.

The call takes the rows of the activations ``x`` (R, K), each token's row once (up and gate:
R = T) or each (token, slot)'s (down: R = T*k), and the pairs (token, slot) grouped by the
expert they chose, as ggml buckets them: pair ``j`` of expert ``e`` (``bounds[e] <= j <
bounds[e+1]``) multiplies row ``src[j]`` of ``x`` by expert ``e`` and writes row ``dst[j]`` of
the output (P, n). Several expert tensors of one input and selection (up and gate) go in one
call: ``offs`` holds each tensor's experts in turn (expert ``e`` of tensor ``i`` at
``offs[i * n_expert + e]``), and tensor ``i`` writes rows ``i*P .. (i+1)*P`` of the output. Each
row of ``x`` is quantized once to the experts' ``vec_dot_type`` (ggml quantizes ``src1`` once
per call, before any expert), then each selected expert's weight rows are read from the file's
map, split over the threads, and meet only the rows routed to them; an expert no pair chose is
never read, nor are its rows looped over.

The products per (row, weight row) are those of the decoding kernels
(:mod:`qllama.backends.numpy.kernels.gemv`: the 32-block formats, IQ4_NL and MXFP4 four rows a
step, the K-quants and IQ4_XS a row a step): the same integers and float32 operations in the
same order as ggml's generic C, so each pair's numbers are those of its row alone times its
expert (``tests/test_moe.py`` checks them bit for bit against the backend's ``matmul``).
"""

from __future__ import annotations

from typing import Any

from numba import njit, prange

from qllama.backends.numpy.kernels.gemv import (
    BLOCKS32,
    IQ4_XS_SIZE,
    Q8_0_CENTRE,
    SIZES,
    _chunk,
    _four_rows,
    _kquant_dot,
    iq4xs_row,
    legacy_rows,
    q8_activations,
    q8k_activations,
    q8k_plain,
)
from qllama.backends.numpy.kernels.simd import (
    IQ4_NL,
    IQ4_XS,
    KQUANTS,
    MXFP4,
    Q2_K,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
)
from qllama.jit import INLINE, JIT, named_kernel


@njit(**JIT)
def group_pairs(flat, n_expert, order, bounds, by_token, counts, k):
    """:func:`qllama.backends.base.group_pairs` of the flat expert ids ``flat`` (T*k,) of a
    selection (T, k), compiled: a counting sort, stable as ggml buckets the pairs. Writes
    ``order`` (T*k,), ``bounds`` (n_expert + 1,), each grouped pair's token ``by_token`` (T*k,)
    and the pairs an expert ``counts`` (n_expert,); returns the most pairs one expert has, or
    -1 (nothing written to trust) where an id lies outside ``[0, n_expert)``."""
    counts[:] = 0
    for j in range(flat.shape[0]):
        e = flat[j]
        if e < 0 or e >= n_expert:
            return -1
        counts[e] += 1
    bounds[0] = 0
    most = 0
    for e in range(n_expert):
        bounds[e + 1] = bounds[e] + counts[e]
        most = max(most, counts[e])
    fill = bounds[:-1].copy()
    for j in range(flat.shape[0]):
        e = flat[j]
        order[fill[e]] = j
        by_token[fill[e]] = j // k
        fill[e] += 1
    return most


@njit(**INLINE)
def mmid_legacy(buf, offs, n, x, src, dst, bounds, simd, threads, out, fmt):
    """The 32-block formats, IQ4_NL and MXFP4: ``out[dst[j]*n:][:n] = x[src[j]] @ W_e.T`` for every
    pair ``j`` of every expert ``e`` (its ``n`` rows at byte ``offs[e]`` of ``buf``; of each
    tensor, its own output rows, as the module says); each thread takes a share of every
    selected expert's rows, four at a time."""
    k = x.shape[1]
    nb = k // 32
    rb = nb * SIZES[fmt]
    with_m = fmt == Q4_1 or fmt == Q5_1
    centre = 8 if fmt == Q4_0 else 16 if fmt == Q5_0 else 128 if fmt in (IQ4_NL, MXFP4) else 0
    centre = Q8_0_CENTRE if fmt == Q8_0 else centre
    qx, dx, sx, cx = q8_activations(x, simd, with_m, centre)  # every row once
    groups = n // 4
    n_expert = bounds.shape[0] - 1
    per_tensor = out.shape[0] // (n * (offs.shape[0] // n_expert))  # P: output rows a tensor
    for c in prange(threads):
        g0, g1 = _chunk(groups, threads, c)
        for i in range(offs.shape[0]):
            e = i % n_expert  # the expert; i // n_expert, its tensor
            if bounds[e] == bounds[e + 1]:
                continue  # no pair chose it: not even a loop over its rows
            at = i // n_expert * per_tensor
            for r in range(4 * g0, 4 * g1, 4):
                for j in range(bounds[e], bounds[e + 1]):
                    t = src[j]
                    w = offs[i] + r * rb
                    o = (at + dst[j]) * n + r
                    _four_rows(buf, w, rb, nb, qx, t * k, cx[t], dx[t], sx[t], out, o, fmt)
            if c == threads - 1:
                for r in range(4 * groups, n):
                    for j in range(bounds[e], bounds[e + 1]):
                        t = src[j]
                        w = offs[i] + r * rb
                        legacy_rows(
                            buf,
                            w,
                            rb,
                            nb,
                            qx,
                            t * k,
                            cx[t],
                            dx[t],
                            sx[t],
                            out,
                            (at + dst[j]) * n + r,
                            fmt,
                            1,
                        )


def _row_by_row(activations: Any, row: Any) -> Any:
    """The driver of the formats computed a weight row at a time (the K-quants, IQ4_XS): as
    :func:`mmid_legacy`, each thread takes a share of every selected expert's rows, a row at
    a time. The format's part, inlined: ``activations(x, fmt)`` quantizes every row of ``x``
    once, to a tuple ``acts`` (the bytes of a weight row first, then what ``row`` reads);
    ``row(buf, w, acts, t, out, o, fmt)`` writes the product of the weight row at byte ``w``
    with row ``t`` of ``x`` to ``out[o]``.

    numba resolves the closure's kernels when it compiles the format's driver
    (:func:`_kernel`), which inlines this one; that driver alone is cached, keyed by its own
    closure's ints (:func:`qllama.jit.named_kernel`). :func:`mmid_legacy` keeps a nest of its
    own: fed through this one (a step of four rows, then the rest), Q4_0 and Q5_1 decoded 2-3%
    slower (one thread, CPU time), the machine code laid out otherwise."""

    @njit(**INLINE)
    def mmid(buf, offs, n, x, src, dst, bounds, simd, threads, out, fmt):
        acts = activations(x, fmt)  # every row once
        rb = acts[0]
        n_expert = bounds.shape[0] - 1
        per_tensor = out.shape[0] // (n * (offs.shape[0] // n_expert))
        for c in prange(threads):
            r0, r1 = _chunk(n, threads, c)
            for i in range(offs.shape[0]):
                e = i % n_expert
                if bounds[e] == bounds[e + 1]:
                    continue  # no pair chose it
                at = i // n_expert * per_tensor
                for r in range(r0, r1):
                    w = offs[i] + r * rb
                    for j in range(bounds[e], bounds[e + 1]):
                        row(buf, w, acts, src[j], out, (at + dst[j]) * n + r, fmt)

    return mmid


@njit(**INLINE)
def _kquant_activations(x, fmt):
    """Q8_K rows, each 64 codes in :data:`~qllama.backends.numpy.kernels.gemv.LANE_ORDER`,
    with the block sums the format's mins take (Q2_K's per 16, the others' per 32)."""
    xl, dx, bs16, bs32 = q8k_activations(x)
    k = x.shape[1]
    per = k // 16 if fmt == Q2_K else k // 32
    return k // 256 * SIZES[fmt], xl, dx, bs16 if fmt == Q2_K else bs32, per, k


@njit(**INLINE)
def _kquant_row(buf, w, acts, t, out, o, fmt):
    _, xl, dx, bs, per, k = acts
    out[o] = _kquant_dot(buf, w, k // 256, xl, t * k, bs, t * per, dx[t], fmt)


@njit(**INLINE)
def _iq4xs_activations(x, fmt):
    """Q8_K rows, codes in order, with 128 times each 32 codes' sum."""
    xq, dx, cx = q8k_plain(x)
    k = x.shape[1]
    return k // 256 * IQ4_XS_SIZE, xq, dx, cx, k


@njit(**INLINE)
def _iq4xs_row(buf, w, acts, t, out, o, fmt):
    _, xq, dx, cx, k = acts
    nb = k // 256
    iq4xs_row(buf, w, nb, xq, t * k, cx, t * k // 32, dx, t * nb, out, o)


mmid_kquant = _row_by_row(_kquant_activations, _kquant_row)
mmid_iq4xs = _row_by_row(_iq4xs_activations, _iq4xs_row)


def _kernel(fmt: int, parallel: bool) -> Any:
    """The driver for one format, the format a constant (every branch on it folded away)."""
    legacy, kquant = fmt in BLOCKS32, fmt in KQUANTS

    def kernel(buf, offs, n, x, src, dst, bounds, simd, threads, out):
        if legacy:
            mmid_legacy(buf, offs, n, x, src, dst, bounds, simd, threads, out, fmt)
        elif kquant:
            mmid_kquant(buf, offs, n, x, src, dst, bounds, simd, threads, out, fmt)
        else:
            mmid_iq4xs(buf, offs, n, x, src, dst, bounds, simd, threads, out, fmt)

    return named_kernel(kernel, "mmid", fmt, parallel)


# format id -> (parallel, serial) compiled kernels:
# ``kernel(buf, offs, n, x, src, dst, bounds, simd, threads, out)``
KERNELS = {fmt: (_kernel(fmt, True), _kernel(fmt, False)) for fmt in (*BLOCKS32, *KQUANTS, IQ4_XS)}


def kernel(fmt: int, *, serial: bool) -> Any | None:
    """The compiled ``mul_mat_id`` for experts of format ``fmt`` (a GGML type id), or None
    where there is none (the other formats: one ``matmul`` per selected expert)."""
    pair = KERNELS.get(fmt)
    return None if pair is None else pair[1 if serial else 0]
