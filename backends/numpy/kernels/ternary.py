"""Decoding kernels of the ternary formats (TQ1_0, TQ2_0): a few tokens against every weight
row, each row's super-blocks decoded in vector registers as its bytes arrive.

A row's dot product with one token is one loop in LLVM IR (:func:`ternary_row`), as the
streaming kernels of :mod:`qllama.backends.numpy.kernels.gemv` state theirs. Per 256-block:

* **TQ2_0**: element ``128h + 32l + m`` is bits ``2l`` of byte ``32h + m``; the four shifts
  of its 64 bytes (one vector) are the codes ``c`` (0..3, the weight ``c - 1``) of 64
  elements each, multiplied by the Q8_K activations (laid out once per token in that order,
  :data:`TQ2_ORDER`) four products a lane (``vpdpbusd``);
* **TQ1_0**: trit ``n`` of a byte is ``((uint8)(byte * 3**n) * 3) >> 8`` (0..2, the weight
  plus one). Its 52 bytes of ``qs`` and ``qh`` are loaded as one vector and each of the 5
  trits taken of all of them at once: ``byte * 3**n`` as byte additions (the last times 3),
  then ``(q * 3) >> 8`` as two comparisons (``q >= 86``, ``q >= 171``). The activations are
  laid out once per token in that order (:data:`TQ1_ORDER`, zeros where no element is), so
  that each trit's 64 codes meet their 64 activations in one ``vpdpbusd``.

The sum of the codes by the activations, minus the activations' sum over the block (the
``- 1`` of every weight), is ggml's exact integer ``sumi``; the row's sum adds
``(float)sumi * (d * y.d)`` block after block, as ggml's generic C (four blocks a step:
their integer sums reduced together, their terms computed as one vector, then added in
order). The same integers and
float32 operations in the same order as :func:`qllama.backends.numpy.oracle.vec_dot`:
``tests/test_cpu_kernels.py`` checks them bit for bit. Rows are split over numba's threads.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from qllama.backends.numpy.kernels.gemv import PREFETCH, _chunk, q8k_rows
from qllama.backends.numpy.kernels.llvm_ir import (
    F32,
    I8,
    I16,
    I32,
    blocks_loop,
    byte_ptr,
    data_ptr,
    fsum_in_order,
    halves,
    i64,
    load,
    prefetch,
    shuffle,
    small_dot4,
    splat,
    store,
    vec,
)
from qllama.backends.numpy.kernels.simd import _literal, _reduce_together, tune
from qllama.ggml_types import GGMLType
from qllama.jit import INLINE, named_kernel

TQ1_0, TQ2_0 = int(GGMLType.TQ1_0), int(GGMLType.TQ2_0)
FORMATS = (TQ1_0, TQ2_0)
TYPE_SIZE = {TQ1_0: 54, TQ2_0: 66}  # qs (48 / 64 bytes), TQ1_0's qh (4), fp16 d
D_AT = {TQ1_0: 52, TQ2_0: 64}
# activation bytes a 256-block takes: TQ1_0's 5 trits of 64 lanes, TQ2_0's 4 shifts of 64
X_SPAN = {TQ1_0: 320, TQ2_0: 256}


def _tq1_order() -> np.ndarray:
    """The element of each of TQ1_0's 5 x 64 trit lanes (-1: none): lane ``i`` of trit ``n``
    is byte ``i`` of the vector ``qs[0:48], qh[0:4]`` and 12 unused bytes. ``qs[m]``, m < 32:
    elements ``m + 32n``; ``qs[32 + m]``: ``160 + m + 16n``; ``qh[j]``: ``240 + j + 4n``,
    n < 4."""
    order = np.full((5, 64), -1, np.int64)
    for n in range(5):
        for m in range(32):
            order[n, m] = m + 32 * n
        for m in range(16):
            order[n, 32 + m] = 160 + m + 16 * n
        if n < 4:
            for j in range(4):
                order[n, 48 + j] = 240 + j + 4 * n
    return order.reshape(-1)  # (320,): trit-major


TQ1_ORDER = _tq1_order()
# TQ2_0: lane 64l + 32h + m of a 256-block holds element 128h + 32l + m (shift l of byte 32h + m)
TQ2_ORDER = np.array(
    [128 * h + 32 * lv + m for lv in range(4) for h in range(2) for m in range(32)], np.int64
)


def _tq2_sums(builder: ir.IRBuilder, p: Any, xs: Any) -> Any:
    """TQ2_0's codes (0..3) of the block at ``p`` by the activations at ``xs``
    (:data:`TQ2_ORDER`): <16 x i32> quad sums. Its 64 bytes in one vector, shifted 4 times."""
    qs = load(builder, p, 0, vec(I8, 64))
    acc = splat(I32, 16, 0)
    for lv in range(4):
        codes = builder.and_(builder.lshr(qs, splat(I8, 64, 2 * lv)), splat(I8, 64, 3))
        acc = small_dot4(builder, acc, codes, load(builder, xs, 64 * lv, vec(I8, 64)))
    return acc


def _tq1_sums(builder: ir.IRBuilder, p: Any, xs: Any) -> Any:
    """TQ1_0's trits (0..2) of the block at ``p`` by the activations at ``xs``
    (:data:`TQ1_ORDER`): <16 x i32> quad sums."""
    qs = load(builder, p, 0, vec(I8, 32))
    rest = load(builder, p, 32, vec(I8, 16))
    qh = load(builder, p, 48, vec(I8, 4))
    # bytes 52..63 of the vector: any value (their activations are zeros)
    tail = shuffle(builder, rest, shuffle(builder, qh, qh, [*range(4), *[0] * 12]), range(32))
    q = shuffle(builder, qs, tail, range(64))
    acc = splat(I32, 16, 0)
    for n in range(5):
        if n:  # byte * 3**n (mod 256), from the last: q + q + q
            q = builder.add(builder.add(q, q), q)
        # (q * 3) >> 8 for a byte q: 1 from 86 up, 2 from 171 up
        trit = builder.add(
            builder.zext(builder.icmp_unsigned(">=", q, splat(I8, 64, 86)), vec(I8, 64)),
            builder.zext(builder.icmp_unsigned(">=", q, splat(I8, 64, 171)), vec(I8, 64)),
        )
        s = load(builder, xs, 64 * n, vec(I8, 64))
        acc = small_dot4(builder, acc, trit, s)
    return acc


@intrinsic(prefer_literal=True)
def ternary_row(
    typingctx: Any,
    raw: Any,
    off: Any,
    nb: Any,
    xs: Any,
    xo: Any,
    ys: Any,
    yo: Any,
    yd: Any,
    out: Any,
    oo: Any,
    fmt: Any,
) -> Any:
    """ggml's generic ``vec_dot_tq{1,2}_0_q8_K`` of one weight row (``nb`` 256-blocks of
    ``fmt`` from byte ``off`` of ``raw``) with one token's Q8_K activations: codes
    ``xs[xo:]`` (int8; in :data:`TQ2_ORDER` or :data:`TQ1_ORDER` within each block), ``ys[yo:]`` the
    sum of each block's codes (int32), ``yd[yo:]`` each block's d (float32). Writes the
    float32 sum to ``out[oo]``."""
    f = _literal(fmt, FORMATS, "ternary_row: fmt")
    if f is None:
        return None
    ts, span = TYPE_SIZE[f], X_SPAN[f]

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        row = byte_ptr(builder, data_ptr(context, builder, sig.args[0], args[0]), args[1])
        x = byte_ptr(builder, data_ptr(context, builder, sig.args[3], args[3]), args[4])
        at = builder.mul(args[6], i64(4))
        ysp = byte_ptr(builder, data_ptr(context, builder, sig.args[5], args[5]), at)
        ydp = byte_ptr(builder, data_ptr(context, builder, sig.args[7], args[7]), at)

        def steps(blocks: int) -> Any:
            def body(b0: Any, carried: list[Any]) -> list[Any]:
                vecs, ds = [], ir.Constant(vec(I16, blocks), None)
                for j in range(blocks):
                    b = builder.add(b0, i64(j))
                    p = byte_ptr(builder, row, builder.mul(b, i64(ts)))
                    for line in range(0, ts, 64):
                        prefetch(builder, p, PREFETCH + line)
                    xb = byte_ptr(builder, x, builder.mul(b, i64(span)))
                    sums = _tq1_sums if f == TQ1_0 else _tq2_sums
                    vecs.append(sums(builder, p, xb))
                    d = load(builder, p, D_AT[f], I16)
                    ds = builder.insert_element(ds, d, ir.Constant(I32, j))
                # the blocks' integer sums reduced together, then their terms in block order
                at = builder.mul(b0, i64(4))
                sumi = builder.sub(
                    _reduce_together(builder, vecs, 16, blocks),
                    load(builder, ysp, at, vec(I32, blocks)),
                )
                dd = builder.fmul(halves(builder, ds), load(builder, ydp, at, vec(F32, blocks)))
                term = builder.fmul(builder.sitofp(sumi, vec(F32, blocks)), dd)
                return [fsum_in_order(builder, carried[0], term, blocks)]

            return body

        nb_v, acc = args[2], ir.Constant(F32, 0.0)
        (acc,) = blocks_loop(builder, nb_v, [acc], steps, (4, 2, 1))
        o = data_ptr(context, builder, sig.args[8], args[8])
        store(builder, acc, o, builder.mul(args[9], i64(4)))
        return context.get_dummy_value()

    return types.none(raw, off, nb, xs, xo, ys, yo, yd, out, oo, fmt), codegen


@njit(**INLINE)
def ternary_activations(x, fmt):
    """The rows of ``x`` (T, K) as Q8_K for :func:`ternary_row`: the codes (T * K/256 *
    :data:`X_SPAN`,) int8, each block's sum of codes (T*K/256,) int32 and d (T*K/256,)
    float32."""
    tokens, k = x.shape
    nb = k // 256
    xq, dx, bsums = q8k_rows(x)
    sums16 = bsums.reshape(-1)
    ys = np.empty(tokens * nb, np.int32)
    for i in range(tokens * nb):
        acc = 0
        for j in range(16):
            acc += sums16[16 * i + j]
        ys[i] = acc
    span = 320 if fmt == TQ1_0 else 256
    order = TQ1_ORDER if fmt == TQ1_0 else TQ2_ORDER
    xs = np.zeros(tokens * nb * span, np.int8)
    for i in range(tokens * nb):
        for lane in range(span):
            e = order[lane]
            if e >= 0:
                xs[span * i + lane] = xq[256 * i + e]
    return xs, ys, dx.reshape(-1)


@njit(**INLINE)
def gemv_ternary(buf, offs, rows, x, simd, threads, out, outs_at, fmt):
    """``x @ W_i.T`` for a few tokens ``x`` (T, K) and the ternary weights ``i`` at bytes
    ``offs[i]`` of ``buf`` (``rows[i]`` rows each): written row-major (T, rows[i]) to
    ``out[outs_at[i]:]``, a row at a time. Each thread takes a share of every weight's rows."""
    tokens, k = x.shape
    nb = k // 256
    ts = 54 if fmt == TQ1_0 else 66
    span = 320 if fmt == TQ1_0 else 256
    rb = nb * ts
    xs, ys, yd = ternary_activations(x, fmt)
    for c in prange(threads):
        for i in range(offs.shape[0]):
            r0, r1 = _chunk(rows[i], threads, c)
            for r in range(r0, r1):
                for t in range(tokens):
                    o = outs_at[i] + t * rows[i] + r
                    ternary_row(
                        buf, offs[i] + r * rb, nb, xs, t * nb * span, ys, t * nb, yd, out, o, fmt
                    )


def _kernel(fmt: int, parallel: bool) -> Any:
    """The driver for one format, the format a constant."""

    def kernel(buf, offs, rows, x, simd, threads, out, outs_at):
        gemv_ternary(buf, offs, rows, x, simd, threads, out, outs_at, fmt)

    return named_kernel(kernel, "gemv", fmt, parallel)


# format id -> (parallel, serial) compiled kernels, as gemv.KERNELS:
# ``kernel(buf, offs, rows, x, simd, threads, out, outs_at)``
KERNELS = {fmt: (_kernel(fmt, True), _kernel(fmt, False)) for fmt in FORMATS}
