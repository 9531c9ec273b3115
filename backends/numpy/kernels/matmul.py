"""Compiled matmuls (numba) for the CPU arithmetic: the oracle's numbers, bit for bit, fast.

:mod:`qllama.backends.numpy.dispatch` states what ggml's CPU computes and computes it plainly;
the compiled kernels compute exactly the same float32 values (checked bit for bit in
``tests/test_cpu_kernels.py``) from the file's bytes, keeping nothing of a weight between
calls. This module says which kernel computes a format:

* the 32-block formats (Q4_0 .. Q8_0) and the K-quants: the streaming kernels
  (:func:`streaming`), :mod:`qllama.backends.numpy.kernels.gemv` for few tokens and
  :mod:`qllama.backends.numpy.kernels.gemm` for many, which keep a whole row's accumulators in
  registers and take several weights that share an input in one call;
* IQ4_NL, MXFP4 and IQ4_XS: the streaming kernels of :mod:`qllama.backends.numpy.kernels.gemv`
  for few tokens, the loops below for many; TQ1_0 and TQ2_0 likewise, their few tokens in
  :mod:`qllama.backends.numpy.kernels.ternary`;
* NVFP4, Q1_0 and Q2_0: the streaming kernels of :mod:`qllama.backends.numpy.kernels.small`,
  whatever the number of tokens;
* the IQ grid formats (IQ2_XXS .. IQ3_S, IQ1_S, IQ1_M): the streaming kernels of
  :mod:`qllama.backends.numpy.kernels.grid`, at every token count;
* the IQ and table formats: the kernels below, ``kernel(fmt, serial=...)(raw, rows, x, simd,
  threads)``.

Below, one call quantizes the activation rows (:mod:`qllama.backends.numpy.kernels.quantize`), then
per weight row decodes each block in registers (:mod:`qllama.backends.numpy.kernels.simd`) and takes
its exact integer sums with the tokens' blocks, unsigned by signed (``vpdpbusd``), and combines the
float32 terms in the order of ggml's generic C, per block in block order.

The IQ grid formats (IQ2_XXS .. IQ3_S, IQ1_S, IQ1_M, which the backend streams instead: the
kernels below compute them for tests and measures) and the ternary ones (TQ1_0, TQ2_0; few
tokens: the streaming kernels of :mod:`qllama.backends.numpy.kernels.ternary`)
decode each super-block once into its signed integers and sub-block scales
(:mod:`qllama.backends.numpy.kernels.superblocks`), then take plain integer sums with each
token (:func:`_matmul_iq`): ``(d*y.d) * bsum`` per block in block order (IQ1: ``bsum/8``),
IQ2's ``0.125 * sumf`` and IQ3_XXS's ``0.25 * sumf`` at the end, as ggml's generic C.

IQ4_NL, MXFP4 and IQ4_XS (the formats whose 4-bit codes index a table of levels) run many
tokens in the 32-block loops: each block's levels plus 128 (``decode_levels``) by the
activations, minus 128 times the activations' block sum; IQ4_XS's activations are Q8_K
(its 256-block ``d`` shared by the eight 32-blocks, the block sums from its ``bsums``) and
each of its 32-blocks adds ``((d*y.d)*(ls - 32))*isum``, as ggml's generic C does.

Few tokens (decoding): rows in groups of 4, each row's blocks 16 at a time against one
token. Many tokens (prefill, teacher forcing): each weight block is decoded once and meets
16 tokens at a time held in the vector lanes (``token_dots``), so that a block costs a few
instructions per 16 tokens. Rows are split over numba's threads; each format has its own
compiled kernel, parallel and serial (the serial one for small matmuls and one thread).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from qllama.backends.numpy.kernels import gemm, gemv, grid, small, superblocks, ternary
from qllama.backends.numpy.kernels.quantize import TOKEN_TILE, q8_row, q8k_row
from qllama.backends.numpy.kernels.simd import (
    IQ4_NL,
    IQ4_XS,
    KQUANTS,
    LEGACY,
    MXFP4,
    TABLE_FORMATS,
    bits_float,
    decode_levels,
    dots,
    half_to_float,
    lanes8,
    token_dots,
    token_wdots,
)
from qllama.ggml_types import GGMLType
from qllama.jit import INLINE, JIT, named_kernel

F32 = np.float32
IQ = superblocks.FORMATS  # IQ grids and ternary: one integer sum a 256-block (superblocks.py)


@njit(**INLINE)
def _type_size(fmt: int) -> int:
    """Bytes per block of a table format's id."""
    sizes_t = (IQ4_NL, 18, MXFP4, 17, IQ4_XS, 136)
    for i in range(0, 6, 2):
        if sizes_t[i] == fmt:
            return sizes_t[i + 1]
    return 0


# --- the table formats, in 32-blocks: IQ4_NL, MXFP4, IQ4_XS -----------------------------------

# the stored codes (levels plus 128) are 128 above the signed ones
CENTRE = 128


@njit(**INLINE)
def _decode_stored(raw, off, b, q, qo, fmt):
    """32-block ``b``'s levels plus 128 (unsigned) into ``q[qo:qo+32]`` (``off`` is IQ4_XS's
    super-block)."""
    if fmt == IQ4_NL:
        decode_levels(raw, off + 2, q, qo, IQ4_NL)
    elif fmt == MXFP4:
        decode_levels(raw, off + 1, q, qo, MXFP4)
    elif fmt == IQ4_XS:
        decode_levels(raw, off + 8 + 16 * (b % 8), q, qo, IQ4_XS)


@njit(**INLINE)
def _block_offset(fmt, ts, nb, row, b):
    """Byte offset of 32-block ``b`` of weight row ``row`` (``nb`` 32-blocks a row); for
    IQ4_XS the offset of the super-block it lies in."""
    if fmt == IQ4_XS:
        return (row * (nb // 8) + b // 8) * 136
    return (row * nb + b) * ts


@njit(**INLINE)
def _e8m0_half(e):
    """MXFP4's scale byte -> ``2**(e - 128)`` (ggml_e8m0_to_fp32_half, from its bits)."""
    bits = (0x00200000 << e) if e < 2 else (e - 1) << 23
    return bits_float(np.int32(bits))


@njit(**INLINE)
def _block_header(raw, off, b, fmt):
    """The float terms of 32-block ``b`` at ``off``: its scale ``d`` and IQ4_XS's factor
    ``ls - 32`` (else 1)."""
    if fmt == MXFP4:
        d = _e8m0_half(raw[off])
    else:
        d = half_to_float(raw, off)
    post = F32(1)
    if fmt == IQ4_XS:
        j = b % 8
        high = ((np.int32(raw[off + 2]) | (np.int32(raw[off + 3]) << 8)) >> (2 * j)) & 3
        low = (np.int32(raw[off + 4 + j // 2]) >> (4 * (j % 2))) & 15
        post = F32((low | (high << 4)) - 32)
    return d, post


@njit(**INLINE)
def _matmul_table(raw, fmt, rows, x, simd, threads):
    """``x @ W.T`` in ggml's CPU arithmetic for a weight of a table format ``fmt`` (file
    bytes ``raw``, ``rows`` rows): quantize ``x`` (T, K) to Q8_0 (IQ4_XS: Q8_K), then per
    row the generic vec_dot, block terms added in block order. Returns (T, rows) float32.

    The integer sums are taken unsigned by signed (what ``vpdpbusd`` multiplies): the levels
    plus 128 by the activations, minus 128 times the activations' block sum. The same
    integers as ``integer_form``'s.
    """
    tokens, k = x.shape
    nb = k // 32
    ts = _type_size(fmt)
    qx = np.empty(tokens * k, np.int8)
    dx = np.empty((tokens, nb), np.float32)
    sx = np.zeros((tokens, nb), np.float32)  # Q8_1's s, which q8_row writes only with has_m
    flat = x.reshape(-1)
    xsum = np.zeros((nb, tokens), np.int32)
    if fmt == IQ4_XS:
        # Q8_K: one d per 256, shared by its eight 32-blocks; the 32-sums from its bsums
        dk = np.empty((tokens, nb // 8), np.float32)
        bsums = np.empty((tokens, k // 16), np.int32)
        for t in prange(tokens):
            q8k_row(flat, t, k, qx, dk, bsums)
        for t in range(tokens):
            for b in range(nb):
                dx[t, b] = dk[t, b // 8]
                xsum[b, t] = bsums[t, 2 * b] + bsums[t, 2 * b + 1]
    else:
        for t in prange(tokens):
            q8_row(flat, t, k, simd, False, qx, dx, sx)
        # the activations' block sums, for the correction
        for t in range(tokens):
            for b in range(nb):
                acc = 0
                for j in range(32):
                    acc += qx[t * k + b * 32 + j]
                xsum[b, t] = acc
    out = np.empty((tokens, rows), np.float32)
    chunks = max(1, min(rows, threads))
    if tokens < TOKEN_TILE:
        for c in prange(chunks):
            r0, r1 = c * rows // chunks, (c + 1) * rows // chunks
            _table_rows(raw, fmt, ts, r0, r1, qx, xsum, dx, out)
    else:
        # the activations of each block four by four per token, 16 tokens a vector
        # (``token_dots``); the last tile padded with zeros
        tpad = (tokens + 15) // 16 * 16
        xv = np.zeros(nb * 8 * tpad * 4, np.uint8)
        for t in prange(tokens):
            for b in range(nb):
                for g in range(8):
                    o = ((b * 8 + g) * tpad + t) * 4
                    for c in range(4):
                        xv[o + c] = np.uint8(qx[t * k + b * 32 + 4 * g + c])
        dxt = np.ascontiguousarray(dx.T)
        parts = _parts(rows, threads)
        for c in prange(parts):
            r0, r1 = _part(rows, parts, c)
            _table_tiles(raw, fmt, ts, r0, r1, xv, tpad, xsum, dxt, out)
    return out


@njit(**JIT)
def _block_sums(u, uo, us, s, so, ss, nb, isum):
    """``isum[b]`` for ``b < nb``: the unsigned-by-signed sums of runs ``u[uo + b*us:]`` and
    ``s[so + b*ss:]``, 16 at a time, then 8, 4, 2, 1."""
    b = 0
    while b + 16 <= nb:
        dots(u, uo + b * us, us, s, so + b * ss, ss, isum[b:], 16)
        b += 16
    if b + 8 <= nb:
        dots(u, uo + b * us, us, s, so + b * ss, ss, isum[b:], 8)
        b += 8
    if b + 4 <= nb:
        dots(u, uo + b * us, us, s, so + b * ss, ss, isum[b:], 4)
        b += 4
    if b + 2 <= nb:
        dots(u, uo + b * us, us, s, so + b * ss, ss, isum[b:], 2)
        b += 2
    if b < nb:
        dots(u, uo + b * us, us, s, so + b * ss, ss, isum[b:], 1)


@njit(**JIT)
def _table_rows(raw, fmt, ts, r0, r1, qx, xsum, dx, out):
    """Few tokens: per group of 4 rows (consecutive blocks in the file), decode the blocks,
    their integer sums with each token's blocks, the float32 terms (elementwise,
    vectorized), then each row's sum of its terms in block order (4 rows interleaved, so
    that the dependent additions of one row overlap another's)."""
    tokens, nb = dx.shape
    k = nb * 32
    q = np.empty(4 * k, np.uint8)
    dw = np.empty(4 * nb, np.float32)
    pw = np.ones(4 * nb, np.float32)
    isum = np.empty(4 * nb, np.int32)
    term = np.zeros(4 * nb, np.float32)
    for r in range(r0, r1, 4):
        g = min(4, r1 - r)  # rows in this group
        n = g * nb  # blocks in this group
        for b in range(n):
            off = _block_offset(fmt, ts, nb, r + b // nb, b % nb)
            dw[b], pw[b] = _block_header(raw, off, b % nb, fmt)
            _decode_stored(raw, off, b % nb, q, b * 32, fmt)
        for t in range(tokens):
            for i in range(g):
                _block_sums(q, i * k, 32, qx, t * k, 32, nb, isum[i * nb :])
            yd = dx[t]
            for i in range(g):
                for b in range(nb):
                    j = i * nb + b
                    isum[j] -= CENTRE * xsum[b, t]
                    if fmt == IQ4_XS:
                        term[j] = ((dw[j] * yd[b]) * pw[j]) * np.float32(isum[j])
                    else:
                        term[j] = (dw[j] * yd[b]) * np.float32(isum[j])
            a0 = a1 = a2 = a3 = F32(0)
            for b in range(nb):
                a0 += term[b]
                a1 += term[nb + b]
                a2 += term[2 * nb + b]
                a3 += term[3 * nb + b]
            out[t, r] = a0
            if g > 1:
                out[t, r + 1] = a1
            if g > 2:
                out[t, r + 2] = a2
            if g > 3:
                out[t, r + 3] = a3


@njit(**JIT)
def _table_tiles(raw, fmt, ts, r0, r1, xv, tpad, xsum, dxt, out):
    """Many tokens: per group of 4 rows and per block (decoded once), the integer sums of 16
    tokens at a time (``token_dots``; the 4 rows in turn, while the tokens' 512 bytes are
    in L1), then the terms added to each row's running sums (elementwise, vectorized).
    Rows are staged 16 at a time and stored token by token (a cache line each)."""
    nb, tokens = dxt.shape
    q = np.empty(4 * 32, np.uint8)
    isum = np.empty((4, tpad), np.int32)
    d = np.empty(4, np.float32)
    p = np.ones(4, np.float32)
    gs = tpad * 4
    stage = np.empty((16, tokens), np.float32)
    for r in range(r0, r1, 4):
        g = min(4, r1 - r)
        at = (r - r0) % 16
        acc = stage[at : at + g]
        acc[:] = 0
        for b in range(nb):
            for i in range(g):
                off = _block_offset(fmt, ts, nb, r + i, b)
                d[i], p[i] = _block_header(raw, off, b, fmt)
                _decode_stored(raw, off, b, q, 32 * i, fmt)
            for t0 in range(0, tpad, 16):
                xo = b * 8 * gs + 4 * t0
                for i in range(g):
                    token_dots(q, 32 * i, xv, xo, gs, isum[i, t0:], 0)
            yd = dxt[b]
            xs = xsum[b]
            for i in range(g):
                di, pi, si, ai = d[i], p[i], isum[i], acc[i]
                # the signed integer sums (see _matmul_table), then ggml's float terms
                if fmt == IQ4_XS:
                    for t in range(tokens):
                        ai[t] += ((di * yd[t]) * pi) * np.float32(si[t] - CENTRE * xs[t])
                else:
                    for t in range(tokens):
                        ai[t] += (di * yd[t]) * np.float32(si[t] - CENTRE * xs[t])
        if at + g == 16 or r + g == r1:
            _unstage(stage, at + g, out, r + g - (at + g))


@njit(**INLINE)
def _unstage(stage, n, out, r):
    """``out[:, r:r+n] = stage[:n].T``: each token's ``n`` values are one run of a line."""
    for t in range(out.shape[0]):
        for i in range(n):
            out[t, r + i] = stage[i, t]


@njit(**INLINE)
def _parts(rows: int, threads: int) -> int:
    """How many pieces a many-token matmul's rows are cut into: one per thread."""
    return max(1, min(threads, rows // 4))


@njit(**INLINE)
def _part(rows: int, parts: int, c: int) -> tuple[int, int]:
    """Rows of piece ``c``: boundaries on multiples of 4 (the row groups of the kernels)."""
    r0 = c * rows // parts // 4 * 4
    r1 = rows if c == parts - 1 else (c + 1) * rows // parts // 4 * 4
    return r0, r1


# --- Q8_K activations in lanes (the IQ grid formats) -------------------------------------------


@njit(**INLINE)
def _q8k_activations(x):
    """The rows of ``x`` (T, K) as Q8_K, token by token over the threads: int8 codes (T*K,),
    float32 d (T, K/256), the sums of each 16 (T, K/16)."""
    tokens, k = x.shape
    xq = np.empty(tokens * k, np.int8)
    dx = np.empty((tokens, k // 256), np.float32)
    bsums = np.empty((tokens, k // 16), np.int32)
    flat = x.reshape(-1)
    for t in prange(tokens):
        q8k_row(flat, t, k, xq, dx, bsums)
    return xq, dx, bsums


@njit(**INLINE)
def _lane_tiles(xq, tokens, k):
    """Token tiles of Q8_K codes ``xq`` (T*K,): the activations of each 256-block regrouped
    by lane (element 8i + l in lane l), a lane's 32 values in 16 pairs, each pair of 16 tokens
    side by side (``token_wdots``); the last tile padded with zeros. Returns (xw, tpad)."""
    tpad = (tokens + 15) // 16 * 16
    xw = np.zeros(k * tpad, np.int16)
    for t in prange(tokens):
        for b in range(k // 256):
            for lane in range(8):
                for i in range(32):
                    g = (b * 8 + lane) * 16 + i // 2
                    xw[(g * tpad + t) * 2 + i % 2] = xq[t * k + b * 256 + 8 * i + lane]
    return xw, tpad


@njit(**INLINE)
def _lane_weights(q, sc, sub, w):
    """A decoded 256-block's codes times their sub-block scales (int16), regrouped by ggml's
    8 lanes (element ``e`` to lane ``e % 8``): ``w[32 * lane + i]`` is element ``8 * i + lane``."""
    for lane in range(8):
        for i in range(32):
            e = 8 * i + lane
            w[32 * lane + i] = sc[e // sub] * q[e]


@njit(**INLINE)
def _lane_dots(w, lane, xw, b, gs, tpad, isum):
    """One lane's integer sums of block ``b`` with every token, 16 tokens a call
    (``token_wdots``), into ``isum``."""
    xo = (b * 8 + lane) * 16 * gs
    for t0 in range(0, tpad, 16):
        token_wdots(w, 32 * lane, xw, xo + 2 * t0, gs, isum[t0:])


# --- the 256-block formats of one integer sum a block: IQ grids, ternary ------------------


@njit(**INLINE)
def _matmul_iq(raw, fmt, rows, x, simd, threads):
    """``x @ W.T`` in ggml's CPU arithmetic for the formats of
    :mod:`~qllama.backends.numpy.kernels.superblocks`: Q8_K activations, per block
    ``bsum = sum_sub scale * sum(q * y.qs)`` (exact integers) and
    ``sumf += (d*y.d) * (bsum * isum_scale)`` in block order; rows end with
    ``row_scale * sumf`` (IQ2: 0.125, IQ3_XXS: 0.25). The integer sums are taken as the
    K-quants' are (8 lanes, ``lanes8`` for few tokens, token tiles for many) and the lanes
    added: the same integer."""
    tokens, k = x.shape
    xq, dx, _ = _q8k_activations(x)
    out = np.empty((tokens, rows), np.float32)
    if tokens < TOKEN_TILE:
        chunks = max(1, min(rows, threads))
        for c in prange(chunks):
            r0, r1 = c * rows // chunks, (c + 1) * rows // chunks
            _iq_rows(raw, fmt, r0, r1, xq, dx, out)
        return out
    xw, tpad = _lane_tiles(xq, tokens, k)
    dxt = np.ascontiguousarray(dx.T)
    parts = _parts(rows, threads)
    for c in prange(parts):
        r0, r1 = _part(rows, parts, c)
        _iq_tiles(raw, fmt, r0, r1, xw, tpad, dxt, out)
    return out


@njit(**JIT)
def _iq_rows(raw, fmt, r0, r1, xq, dx, out):
    """Few tokens: per row and token, each super-block decoded, its 8 lane sums
    (``lanes8``) added into ``bsum``."""
    tokens, nb = dx.shape
    k = nb * 256
    ts = superblocks.type_size(fmt)
    half = np.empty(2, np.uint8)
    q = np.empty(256, np.int8)
    sc = np.empty(16, np.int32)
    aux = np.empty(8, np.int32)
    acc = np.empty(tokens, np.float32)
    final = superblocks.row_scale(fmt)
    unit = superblocks.isum_scale(fmt)
    for r in range(r0, r1):
        acc[:] = 0
        for b in range(nb):
            d = superblocks.decode(raw, (r * nb + b) * ts, fmt, q, sc, half)
            for t in range(tokens):
                lanes8(q, xq, t * k + b * 256, sc, aux, 16)
                bsum = 0
                for i in range(8):
                    bsum += aux[i]
                acc[t] += (d * dx[t, b]) * (np.float32(bsum) * unit)
        for t in range(tokens):
            out[t, r] = final * acc[t]


@njit(**JIT)
def _iq_tiles(raw, fmt, r0, r1, xw, tpad, dxt, out):
    """Many tokens: per super-block (decoded once, scales folded into int16 weights
    regrouped by lane: |w| <= 62 * 31), each lane's sums for 16 tokens at a time
    (``token_wdots``), the lanes added; rows staged as in :func:`_table_tiles`."""
    nb, tokens = dxt.shape
    ts = superblocks.type_size(fmt)
    half = np.empty(2, np.uint8)
    gs = tpad * 2  # int16 elements between a lane's pairs
    q = np.empty(256, np.int8)
    sc = np.empty(16, np.int32)
    w = np.empty(256, np.int16)
    isum = np.empty(tpad, np.int32)
    total = np.empty(tokens, np.int32)
    stage = np.empty((16, tokens), np.float32)
    final = superblocks.row_scale(fmt)
    unit = superblocks.isum_scale(fmt)
    for r in range(r0, r1):
        at = (r - r0) % 16
        acc = stage[at]
        acc[:] = 0
        for b in range(nb):
            d = superblocks.decode(raw, (r * nb + b) * ts, fmt, q, sc, half)
            _lane_weights(q, sc, 16, w)
            yd = dxt[b]
            total[:] = 0
            for lane in range(8):
                _lane_dots(w, lane, xw, b, gs, tpad, isum)
                for t in range(tokens):
                    total[t] += isum[t]
            for t in range(tokens):
                acc[t] += (d * yd[t]) * (np.float32(total[t]) * unit)
        for t in range(tokens):
            acc[t] = final * acc[t]
        if at == 15 or r + 1 == r1:
            _unstage(stage, at + 1, out, r - at)


# One kernel per weight format, the format a constant and every branch on it folded away:
# a branch at run time costs more than it seems (LLVM merges the formats' stores into one
# place, then decodes every format to select one: 5x slower on K-quant headers).
def _table_kernel(fmt: int, parallel: bool) -> Any:
    def kernel(raw, rows, x, simd, threads):
        return _matmul_table(raw, fmt, rows, x, simd, threads)

    return named_kernel(kernel, "matmul", fmt, parallel)


def _iq_kernel(fmt: int, parallel: bool) -> Any:
    def kernel(raw, rows, x, simd, threads):
        return _matmul_iq(raw, fmt, rows, x, simd, threads)

    return named_kernel(kernel, "matmul", fmt, parallel)


# Each format parallel over weight rows (numba's threads) and serial: a parallel region has
# every thread meet at its end, which costs more than a small matmul on one thread, and
# much more when the machine is busy and a thread is waiting for a core.
KERNELS = {fmt: (_table_kernel(fmt, True), _table_kernel(fmt, False)) for fmt in TABLE_FORMATS}
KERNELS.update({fmt: (_iq_kernel(fmt, True), _iq_kernel(fmt, False)) for fmt in IQ})


# Fewer tokens than this: each weight row streamed once per token (kernels/gemv.py,
# kernels/ternary.py, kernels/small.py, kernels/grid.py); as many or more: tiles of 16 tokens per
# decoded block (kernels/gemm.py) or, for the formats without, the loops below. Measured
# crossovers on 2048 x 8192 weights, 2 threads: 4 tokens for the 32-blocks, 6 to 12 for the
# K-quants. IQ4_NL and IQ4_XS have no token tiles of gemm.py: as many tokens or more go to their
# loops below. MXFP4 (gate and down of a 1B shape, 1 thread, CPU time): its streaming kernel
# 5.1 / 10.0 / 19.3 ms at 4 / 8 / 16 tokens, its loops 10.0 / 16.4 / 12.6 (token tiles from 16).
# IQ4_NL alike (a 4096 x 2048 weight, 2 threads, best of 30): streaming 0.59 / 1.17 / 1.80 /
# 2.36 ms at 4 / 8 / 12 / 16 tokens, its loops 1.09 / 2.00 / 2.72 / 1.27; from 16 the loops
# (1.97 against 2.52 ms at 17 tokens, 3.19 against 7.07 at 48).
# The ternary formats: streaming 11 / 44 ms (TQ2_0) and 23 / 89 (TQ1_0) at 16 / 64 tokens, their
# loops 54 / 101 and 57 / 105. NVFP4, Q1_0, Q2_0 stream at any count (the loops they had here
# decoded each block for each token: Q1_0 at 64 tokens took 1054 ms, streaming 111). The IQ grid
# formats stream at every count too (a row decoded once per 16 tokens), measured faster than
# their tile loops below from 16 to 256 tokens (8192 x 2048 IQ2_XXS and IQ1_M, one thread, CPU
# time: 3.1x at 16, 1.7x at 64, 1.2-1.3x at 256).
STREAM_ALWAYS = 1 << 62
GEMM_TOKENS = {**{fmt: 4 for fmt in LEGACY}, **{fmt: 8 for fmt in KQUANTS}, IQ4_XS: 8}
GEMM_TOKENS |= {IQ4_NL: TOKEN_TILE, MXFP4: TOKEN_TILE}
GEMM_TOKENS |= {fmt: 64 for fmt in ternary.FORMATS} | {fmt: STREAM_ALWAYS for fmt in small.FORMATS}
GEMM_TOKENS |= {fmt: STREAM_ALWAYS for fmt in grid.FORMATS}
DECODING = gemv.KERNELS | ternary.KERNELS | small.KERNELS | grid.KERNELS


def streaming(fmt: int, tokens: int, *, serial: bool) -> Any | None:
    """The streaming matmul for ``tokens`` tokens of weights of format ``fmt``, or None
    where the format has none (use :func:`kernel`):
    ``kernel(buf, offs, rows, x, simd, threads, out, outs_at)`` computes ``x @ W_i.T`` for the
    weights at bytes ``offs[i]`` of ``buf`` (``rows[i]`` rows each) into ``out[outs_at[i]:]``,
    row-major (T, rows[i])."""
    if fmt not in GEMM_TOKENS:
        return None
    kernels = gemm.KERNELS if tokens >= GEMM_TOKENS[fmt] else DECODING
    return kernels[fmt][1 if serial else 0] if fmt in kernels else None


Q8_0 = int(GGMLType.Q8_0)
_SCAN_BLOCKS = 1 << 16  # Q8_0 blocks a step of computes_exactly's scan (2 MB)


def computes_exactly(fmt: int, raw: np.ndarray) -> bool:
    """Whether the kernels give the oracle's bits for a weight of format ``fmt`` and bytes
    ``raw``: always, but for a Q8_0 weight with a code of -128 on hosts whose decode loop
    signs the codes (AVX2 without VNNI: :func:`qllama.backends.numpy.kernels.llvm_ir.signed_dot4`).
    llama.cpp's quantizer never writes -128 (its codes are ``round(x / d)`` with ``d`` the
    block's largest magnitude over 127); a file that has one goes to the oracle. The scan
    takes about 0.2 s a GB, once per weight."""
    if fmt != Q8_0 or not gemv.Q8_SIGNED:
        return True
    blocks = raw.reshape(-1, GGMLType.Q8_0.block.type_size)  # (n_blocks, 2 + 32): d, codes
    for b in range(0, blocks.shape[0], _SCAN_BLOCKS):
        if (blocks[b : b + _SCAN_BLOCKS, 2:] == 0x80).any():
            return False
    return True


def kernel(fmt: int, *, serial: bool) -> Any:
    """The compiled matmul for weights of format ``fmt`` (a GGML type id):
    ``kernel(raw, rows, x, simd, threads) -> (T, rows) float32``."""
    return KERNELS[fmt][1 if serial else 0]
