"""Decoding kernels of NVFP4, Q1_0 and Q2_0 (Q8_0 activations): a few tokens against every
weight row, each weight block decoded in vector registers as its bytes arrive.

A row's dot product with one token is one loop in LLVM IR (:func:`small_row`), as the
streaming kernels of :mod:`qllama.backends.numpy.kernels.gemv` state theirs. A weight block
spans several Q8_0 blocks of the activations; per weight block:

* **NVFP4** (64 values, four 16-blocks each with a UE4M3 scale byte): ``qs[8s + j]`` holds
  value ``16s + j`` in its low nibble and ``16s + 8 + j`` in its high one, an index into the
  doubled E2M1 levels (MXFP4's table, plus 128 to be unsigned: ``pshufb``); the 64 levels by
  the activations four products a lane (``vpdpbusd``), each 16's sum minus 128 times the
  activations' sum over it; then ``(d_s * y.d) * isum_s`` added to the row's sum for
  ``s = 0..3`` (two 16-blocks share a Q8_0 block's ``y.d``), the scale ``d_s`` half the
  UE4M3 value (:data:`~qllama.quants.fp4.UE4M3_HALF`, read from the table);
* **Q1_0** (128 values, one bit each: +1 or -1): each bit spread to a byte (0 or 1), by the
  activations, so that ``isum = 2 * sum - (the activations' sum)`` per 32;
* **Q2_0** (64 values of 2 bits, the value ``q - 1``): value ``4i + l`` is bits ``2l`` of
  byte ``i``; the four shifts of the 16 bytes are laid out block by block, and the
  activations once per token in the same order within each 32 (:data:`Q2_ORDER`), the
  activations' sum taken off as for Q1_0.

Q1_0 and Q2_0 then add ``d * inner`` to the row's sum, ``inner`` the float32 sum from 0 of
``y.d * isum`` over the Q8_0 blocks the weight block spans: ggml's generic C, and the
oracle's ``group`` (:func:`qllama.backends.numpy.oracle.vec_dot`), bit for bit
(``tests/test_cpu_kernels.py``). Rows are split over numba's threads.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from qllama.backends.numpy.kernels.gemv import (
    LEVELS,
    PREFETCH,
    _chunk,
    _levels64,
    q8_activations,
)
from qllama.backends.numpy.kernels.llvm_ir import (
    F32,
    I1,
    I8,
    I16,
    I32,
    I64,
    blocks_loop,
    byte_ptr,
    data_ptr,
    dot4,
    fsum_in_order,
    halves,
    i64,
    load,
    pick,
    prefetch,
    shuffle,
    small_dot4,
    splat,
    store,
    vec,
)
from qllama.backends.numpy.kernels.simd import MXFP4, _literal, _reduce_together, tune
from qllama.ggml_types import GGMLType
from qllama.jit import INLINE, named_kernel
from qllama.quants import fp4

NVFP4, Q1_0, Q2_0 = (int(GGMLType[n]) for n in ("NVFP4", "Q1_0", "Q2_0"))
FORMATS = (NVFP4, Q1_0, Q2_0)
TYPE_SIZE = {NVFP4: 36, Q1_0: 18, Q2_0: 18}
SPAN = {NVFP4: 2, Q1_0: 4, Q2_0: 2}  # Q8_0 blocks a weight block spans
# activation sums per weight block: NVFP4's per 16 (times 128), the others' per 32
SUMS = {NVFP4: 4, Q1_0: 4, Q2_0: 2}
STEP = {NVFP4: 4, Q1_0: 2, Q2_0: 4}  # weight blocks a step of the loop (a power of 2)
UE4M3_HALF = np.ascontiguousarray(fp4.UE4M3_HALF)  # NVFP4's scale byte -> half its value
# Q2_0: lane 8l + i of each 32 holds value 4i + l of it
Q2_ORDER = np.array([4 * i + lv for lv in range(4) for i in range(8)], np.int64)


def _nvfp4_sums(builder: ir.IRBuilder, p: Any, xs: Any) -> Any:
    """NVFP4's 64 levels plus 128 of the block at ``p`` by the activations at ``xs``: the 4
    16-blocks' partial sums (one <16 x i32>, 4 lanes each), before the 128 times the
    activations' sums come off."""
    qs = load(builder, p, 4, vec(I8, 32))
    lo = builder.and_(qs, splat(I8, 32, 15))
    hi = builder.lshr(qs, splat(I8, 32, 4))
    idx = shuffle(builder, lo, hi, [8 * (e // 16) + e % 8 + 32 * (e % 16 >= 8) for e in range(64)])
    codes = _levels64(builder, LEVELS[MXFP4], idx)
    return [dot4(builder, splat(I32, 16, 0), codes, load(builder, xs, 0, vec(I8, 64)))]


def _q1_sums(builder: ir.IRBuilder, p: Any, xs: Any) -> Any:
    """Q1_0's 128 bits (as bytes 0 / 1) of the block at ``p`` by the activations: the 4
    32-blocks' partial sums (two <16 x i32>, 8 lanes each)."""
    vecs = []
    for h in range(2):  # 8 bytes, bit j % 8 of byte j // 8 lane j: a mask register's bits
        bits = builder.bitcast(load(builder, p, 2 + 8 * h, I64), vec(I1, 64))
        ones = builder.zext(bits, vec(I8, 64))
        s = load(builder, xs, 64 * h, vec(I8, 64))
        vecs.append(small_dot4(builder, splat(I32, 16, 0), ones, s))
    return vecs


def _q2_sums(builder: ir.IRBuilder, p: Any, xs: Any) -> Any:
    """Q2_0's 64 codes (0..3) of the block at ``p`` in :data:`Q2_ORDER` by the activations
    (in that order): the 2 32-blocks' partial sums (one <16 x i32>, 8 lanes each)."""
    qs = load(builder, p, 2, vec(I8, 16))
    v = [builder.and_(builder.lshr(qs, splat(I8, 16, 2 * lv)), splat(I8, 16, 3)) for lv in range(4)]
    v01, v23 = shuffle(builder, v[0], v[1], range(32)), shuffle(builder, v[2], v[3], range(32))
    # lane 32b + 8l + i: byte 8b + i of shift l
    mask = [
        32 * (lv // 2) + 16 * (lv % 2) + 8 * b + i
        for b in range(2)
        for lv in range(4)
        for i in range(8)
    ]
    codes = shuffle(builder, v01, v23, mask)
    return [small_dot4(builder, splat(I32, 16, 0), codes, load(builder, xs, 0, vec(I8, 64)))]


SUMS_OF = {NVFP4: _nvfp4_sums, Q1_0: _q1_sums, Q2_0: _q2_sums}


@intrinsic(prefer_literal=True)
def small_row(
    typingctx: Any,
    raw: Any,
    off: Any,
    nb: Any,
    xs: Any,
    xo: Any,
    ys: Any,
    yd: Any,
    yo: Any,
    scales: Any,
    out: Any,
    oo: Any,
    fmt: Any,
) -> Any:
    """ggml's generic ``vec_dot`` of one weight row (``nb`` weight blocks of ``fmt`` from
    byte ``off`` of ``raw``) with one token's Q8_0 activations: codes ``xs[xo:]`` (int8; Q2_0's
    in :data:`Q2_ORDER`), ``ys`` the activations' sums to take off (:data:`SUMS` a weight
    block, from ``ys[yo * SUMS // SPAN]``), ``yd[yo:]`` the Q8_0 blocks' d; ``scales``
    NVFP4's :data:`UE4M3_HALF`. Writes the float32 sum to ``out[oo]``."""
    f = _literal(fmt, FORMATS, "small_row: fmt")
    if f is None:
        return None
    ts, span, sums = TYPE_SIZE[f], SPAN[f], SUMS[f]

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        row = byte_ptr(builder, data_ptr(context, builder, sig.args[0], args[0]), args[1])
        x = byte_ptr(builder, data_ptr(context, builder, sig.args[3], args[3]), args[4])
        yo = args[7]
        ysp = byte_ptr(
            builder,
            data_ptr(context, builder, sig.args[5], args[5]),
            builder.mul(yo, i64(4 * sums // span)),
        )
        ydp = byte_ptr(
            builder, data_ptr(context, builder, sig.args[6], args[6]), builder.mul(yo, i64(4))
        )
        table = data_ptr(context, builder, sig.args[8], args[8])

        def steps(blocks: int) -> Any:
            def body(b0: Any, carried: list[Any]) -> list[Any]:
                vecs, ds = [], ir.Constant(vec(I16, blocks), None)
                d4 = ir.Constant(vec(F32, 4 * blocks), None)
                for j in range(blocks):
                    b = builder.add(b0, i64(j))
                    p = byte_ptr(builder, row, builder.mul(b, i64(ts)))
                    for line in range(0, ts, 64):
                        prefetch(builder, p, PREFETCH + line)
                    xb = byte_ptr(builder, x, builder.mul(b, i64(32 * span)))
                    vecs += SUMS_OF[f](builder, p, xb)
                    if f == NVFP4:  # the 4 scales, from the table
                        for s in range(4):
                            u = builder.zext(load(builder, p, s, I8), I64)
                            ds4 = load(builder, table, builder.mul(u, i64(4)), F32)
                            d4 = builder.insert_element(d4, ds4, ir.Constant(I32, 4 * j + s))
                    else:
                        d = load(builder, p, 0, I16)
                        ds = builder.insert_element(ds, d, ir.Constant(I32, j))
                # the blocks' integer sums reduced together, then their terms in order
                n = sums * blocks
                isum = _reduce_together(builder, vecs, 4 if f == NVFP4 else 8, n)
                ysum = load(builder, ysp, builder.mul(b0, i64(4 * sums)), vec(I32, n))
                yds = load(builder, ydp, builder.mul(b0, i64(4 * span)), vec(F32, span * blocks))
                if f == Q1_0:
                    isum = builder.add(isum, isum)
                fi = builder.sitofp(builder.sub(isum, ysum), vec(F32, n))
                if f == NVFP4:  # two 16-blocks a y.d
                    yd2 = pick(builder, yds, [e // 2 for e in range(n)])
                    term = builder.fmul(builder.fmul(d4, yd2), fi)
                    return [fsum_in_order(builder, carried[0], term, n)]
                prods = builder.fmul(yds, fi)
                dw = halves(builder, ds)
                acc = carried[0]
                for j in range(blocks):
                    part = pick(builder, prods, range(span * j, span * (j + 1)))
                    inner = fsum_in_order(builder, ir.Constant(F32, 0.0), part, span)
                    dj = builder.extract_element(dw, ir.Constant(I32, j))
                    acc = builder.fadd(acc, builder.fmul(dj, inner))
                return [acc]

            return body

        nb_v, acc = args[2], ir.Constant(F32, 0.0)
        (acc,) = blocks_loop(builder, nb_v, [acc], steps, (STEP[f], 1))
        o = data_ptr(context, builder, sig.args[9], args[9])
        store(builder, acc, o, builder.mul(args[10], i64(4)))
        return context.get_dummy_value()

    return types.none(raw, off, nb, xs, xo, ys, yd, yo, scales, out, oo, fmt), codegen


@njit(**INLINE)
def small_activations(x, simd, fmt):
    """The rows of ``x`` (T, K) as Q8_0 for :func:`small_row`: the codes (T*K,) int8 (Q2_0's
    in :data:`Q2_ORDER` within each 32), the sums to take off (NVFP4: 128 times each 16's,
    (T*K/16,); else each 32's, (T*K/32,)) int32, and each block's d (T*K/32,) float32."""
    tokens, k = x.shape
    qx, dx, _, _ = q8_activations(x, simd, False, 0)
    per = 16 if fmt == NVFP4 else 32
    times = 128 if fmt == NVFP4 else 1
    ys = np.empty(tokens * k // per, np.int32)
    for i in range(tokens * k // per):
        acc = 0
        for j in range(per):
            acc += qx[per * i + j]
        ys[i] = times * acc
    if fmt != Q2_0:
        return qx, ys, dx.reshape(-1)
    xs = np.empty(tokens * k, np.int8)
    for i in range(tokens * k // 32):
        for lane in range(32):
            xs[32 * i + lane] = qx[32 * i + Q2_ORDER[lane]]
    return xs, ys, dx.reshape(-1)


@njit(**INLINE)
def gemv_small(buf, offs, rows, x, simd, threads, out, outs_at, fmt):
    """``x @ W_i.T`` for a few tokens ``x`` (T, K) and the weights ``i`` of ``fmt`` at bytes
    ``offs[i]`` of ``buf`` (``rows[i]`` rows each): written row-major (T, rows[i]) to
    ``out[outs_at[i]:]``, a row at a time. Each thread takes a share of every weight's rows."""
    tokens, k = x.shape
    ts = 36 if fmt == NVFP4 else 18
    per = 64 if fmt == NVFP4 or fmt == Q2_0 else 128  # values a weight block
    nb = k // per
    rb = nb * ts
    xs, ys, yd = small_activations(x, simd, fmt)
    for c in prange(threads):
        for i in range(offs.shape[0]):
            r0, r1 = _chunk(rows[i], threads, c)
            for r in range(r0, r1):
                for t in range(tokens):
                    o = outs_at[i] + t * rows[i] + r
                    small_row(
                        buf,
                        offs[i] + r * rb,
                        nb,
                        xs,
                        t * k,
                        ys,
                        yd,
                        t * k // 32,
                        UE4M3_HALF,
                        out,
                        o,
                        fmt,
                    )


def _kernel(fmt: int, parallel: bool) -> Any:
    """The driver for one format, the format a constant."""

    def kernel(buf, offs, rows, x, simd, threads, out, outs_at):
        gemv_small(buf, offs, rows, x, simd, threads, out, outs_at, fmt)

    return named_kernel(kernel, "gemv", fmt, parallel)


# format id -> (parallel, serial) compiled kernels, as gemv.KERNELS:
# ``kernel(buf, offs, rows, x, simd, threads, out, outs_at)``
KERNELS = {fmt: (_kernel(fmt, True), _kernel(fmt, False)) for fmt in FORMATS}
