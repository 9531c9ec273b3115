"""Decoding kernels of the IQ grid formats (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
IQ1_M): each weight row streamed once, its super-blocks decoded in vector registers.

A row's dot products with a few tokens are one loop in LLVM IR (:func:`grid_row`), as the
K-quants' are in :mod:`~qllama.backends.numpy.kernels.gemv`. Per 256-super-block:

* the grid points are gathered from their table (``vpgatherdq`` / ``vpgatherdd`` where the
  host has AVX512; LLVM splits the gather into loads elsewhere) as unsigned magnitudes;
* the signs (IQ2_XXS, IQ2_XS, IQ3_XXS: 7 stored bits and their parity; IQ2_S, IQ3_S: a byte
  per 8 values) become a byte mask per value, and each value is stored as ``C - g`` or
  ``C + g`` (``C`` = 64, every magnitude below it): unsigned bytes below 128. IQ1's values
  ``8 * grid + delta`` (``delta = +-1``, as :mod:`~qllama.backends.numpy.kernels.superblocks`
  decodes them) are stored plus 16, from a table of ``8 * grid + 16``;
* with each token: the codes by the Q8_K activations in pairs (``vpmaddubsw``: exact, as
  ``2 * 127 * 128 < 2**15``), the pairs by their 16-sub-block's integer scale
  (``vpmaddwd``), the lanes added, minus ``C`` times the sum over sub-blocks of scale times
  the activations' 16-sums (Q8_K's ``bsums``): the exact ``bsum`` of ggml's generic C; then
  ``sumf += (d*y.d) * bsum`` (IQ1: ``bsum * 0.125``), and the row's ``row_scale * sumf``
  at the end.

The same integers and the same float32 operations in the same order as
:func:`qllama.backends.numpy.kernels.matmul._matmul_iq` and the oracle: the float32 sum of a
row is that of ggml's generic ``vec_dot_iq*_q8_K`` (``tests/test_cpu_kernels.py`` checks them
bit for bit). The decode is done once per super-block for all the call's tokens (up to
:data:`TOKENS` at a time), whose running sums are kept on the stack. Rows are split over
numba's threads.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from qllama.backends.numpy.kernels.gemv import PREFETCH, _chunk, q8k_rows
from qllama.backends.numpy.kernels.llvm_ir import (
    F32,
    I8,
    I16,
    I32,
    byte_ptr,
    consts,
    counted_loop,
    data_ptr,
    declare,
    gather,
    halves,
    i64,
    load,
    pair_dots,
    pick,
    prefetch,
    reduce_add,
    scaled_pairs,
    splat,
    store,
    vec,
)
from qllama.backends.numpy.kernels.simd import _literal, tune
from qllama.backends.numpy.kernels.superblocks import (
    GRID_IQ1S,
    GRID_IQ2S,
    GRID_IQ2XS,
    GRID_IQ2XXS,
    GRID_IQ3S,
    GRID_IQ3XXS,
    IQ1_M,
    IQ1_S,
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
)
from qllama.jit import INLINE, named_kernel

FORMATS = (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M)
TYPE_SIZE = {IQ2_XXS: 66, IQ2_XS: 74, IQ2_S: 82, IQ3_XXS: 98, IQ3_S: 110, IQ1_S: 50, IQ1_M: 56}
SIZES = np.zeros(64, np.int64)  # bytes per super-block by format id, for compiled code
SIZES[list(TYPE_SIZE)] = list(TYPE_SIZE.values())
ROW_SCALE = {IQ2_XXS: 0.125, IQ2_XS: 0.125, IQ2_S: 0.125, IQ3_XXS: 0.25}  # others: 1
IQ1 = (IQ1_S, IQ1_M)  # values decoded times 8: a block's integer sum times 1/8
CENTRE = 64  # IQ2 / IQ3: a stored code is 64 plus the signed value (magnitudes <= 62)
IQ1_CENTRE = 16  # IQ1: 16 plus 8 * grid + delta, in 7 .. 25
TOKENS = 16  # tokens of one call of grid_row (its running sums' stack slots)

# Every grid as one byte table, each format's points from its own offset: IQ2 and IQ1 have
# 8 values (one u64) a point, IQ3 4 (one u32). IQ1's entries are 8 * grid + 16 (unsigned).
_GRIDS = {
    IQ2_XXS: GRID_IQ2XXS,
    IQ2_XS: GRID_IQ2XS,
    IQ2_S: GRID_IQ2S,
    IQ3_XXS: GRID_IQ3XXS,
    IQ3_S: GRID_IQ3S,
    IQ1_S: 8 * GRID_IQ1S.astype(np.int16) + IQ1_CENTRE,  # IQ1_M shares IQ1_S's grid
}
TABLE_AT: dict[int, int] = {}
_parts, _at = [], 0
for _fmt, _grid in _GRIDS.items():
    TABLE_AT[_fmt] = _at
    _parts.append(np.ascontiguousarray(_grid.astype(np.uint8)).reshape(-1))
    _at += _parts[-1].size
TABLE_AT[IQ1_M] = TABLE_AT[IQ1_S]
TABLE = np.concatenate(_parts)  # (n,) uint8, frozen into the compiled kernels
POINT = {f: 4 if f in (IQ3_XXS, IQ3_S) else 8 for f in FORMATS}  # bytes of one grid point


# --- decoding a super-block -------------------------------------------------------------------


def _gather(builder: ir.IRBuilder, base: Any, index: Any, width: int) -> Any:
    """The grid points ``index`` (<n x i32>) of the table at ``base``, ``width`` bytes each
    (4 or 8): <n*width x i8>, the points' bytes in order."""
    n = index.type.count
    words = gather(builder, base, builder.mul(index, splat(I32, n, width)), ir.IntType(8 * width))
    return builder.bitcast(words, vec(I8, n * width))


def _parity_signs(builder: ir.IRBuilder, s7: Any) -> Any:
    """ggml's ``ksigns_iq2xs``: 7 sign bits (<32 x iN>, below 128) with their parity as bit 7,
    <32 x i8>."""
    n, ty = s7.type.count, s7.type.element
    fn = declare(builder, f"llvm.ctpop.v{n}i{ty.width}", s7.type, [s7.type])
    odd = builder.and_(builder.call(fn, [s7]), splat(ty, n, 1))
    return builder.trunc(builder.or_(s7, builder.shl(odd, splat(ty, n, 7))), vec(I8, n))


def _nibble_scales(builder: ir.IRBuilder, b8: Any, per16: bool) -> Any:
    """``2 * s + 1`` for the nibbles ``s`` of the scale bytes ``b8``, per 16 values (<16 x
    i16>): one a 16 (IQ2_XS, IQ2_S: 8 bytes, low nibble, then high, of each byte) or one a 32
    (IQ3_S: 4 bytes, the last of its block, low nibble first)."""
    if per16:
        spread = pick(builder, b8, [j // 2 for j in range(16)])
        shifts = [4 * (j % 2) for j in range(16)]
    else:
        spread = pick(builder, b8, [j // 4 for j in range(16)])
        shifts = [4 * ((j // 2) % 2) for j in range(16)]
    s = builder.and_(builder.lshr(spread, consts(I8, shifts)), splat(I8, 16, 15))
    s16 = builder.zext(s, vec(I16, 16))
    return builder.add(builder.shl(s16, splat(I16, 16, 1)), splat(I16, 16, 1))


def _aux_scales(builder: ir.IRBuilder, aux: Any) -> Any:
    """IQ2_XXS / IQ3_XXS: ``2 * (aux >> 28) + 1`` of each 32-block's word (<8 x i32>), per 16
    values (<16 x i16>)."""
    s = builder.add(
        builder.shl(builder.lshr(aux, splat(I32, 8, 28)), splat(I32, 8, 1)), splat(I32, 8, 1)
    )
    return builder.trunc(pick(builder, s, [j // 2 for j in range(16)]), vec(I16, 16))


def _aux_signs(builder: ir.IRBuilder, aux: Any) -> Any:
    """IQ2_XXS / IQ3_XXS: the 32 sign bytes (one per 8 values, in order) of the 8 32-blocks'
    words: 7 bits ``(aux >> 7g) & 127`` of group g and their parity."""
    spread = pick(builder, aux, [b for b in range(8) for _ in range(4)])
    s7 = builder.lshr(spread, consts(I32, [7 * g for _ in range(8) for g in range(4)]))
    return _parity_signs(builder, builder.and_(s7, splat(I32, 32, 127)))


def _byte_mask(builder: ir.IRBuilder, bytes_: Any, c: int) -> Any:
    """Per value of 64-chunk ``c``: whether bit ``e % 8`` of byte ``e // 8`` of ``bytes_``
    (<32 x i8>, one per 8 values) is set, <64 x i1>."""
    spread = pick(builder, bytes_, [8 * c + e // 8 for e in range(64)])
    bit = builder.and_(spread, consts(I8, [1 << (e % 8) for e in range(64)]))
    return builder.icmp_unsigned("!=", bit, splat(I8, 64, 0))


def _decode(builder: ir.IRBuilder, f: int, p: Any, table: Any) -> tuple[list[Any], Any, Any]:
    """The super-block of format ``f`` at ``p``: its codes as 4 chunks of 64 unsigned bytes
    (the signed values plus the centre), the integer scale of each 16 values (<16 x i16>) and
    its float32 ``d``."""
    if f == IQ2_XXS:  # 8 x (4 index bytes, u32 aux)
        v = load(builder, p, 2, vec(I8, 64))
        index = builder.zext(
            pick(builder, v, [8 * b + g for b in range(8) for g in range(4)]), vec(I32, 32)
        )
        aux = pick(builder, builder.bitcast(v, vec(I32, 16)), [2 * b + 1 for b in range(8)])
        signs, scales = _aux_signs(builder, aux), _aux_scales(builder, aux)
    elif f == IQ3_XXS:  # 64 index bytes, then 8 u32 aux
        index = builder.zext(load(builder, p, 2, vec(I8, 64)), vec(I32, 64))
        aux = load(builder, p, 66, vec(I32, 8))
        signs, scales = _aux_signs(builder, aux), _aux_scales(builder, aux)
    elif f == IQ2_XS:  # u16: 9-bit index, 7 sign bits; scales[8]
        w = load(builder, p, 2, vec(I16, 32))
        index = builder.zext(builder.and_(w, splat(I16, 32, 511)), vec(I32, 32))
        signs = _parity_signs(builder, builder.lshr(w, splat(I16, 32, 9)))
        scales = _nibble_scales(builder, load(builder, p, 66, vec(I8, 8)), True)
    elif f == IQ2_S:  # qs[32] low index bytes, signs[32], qh[8] (2 bits a group), scales[8]
        qs = builder.zext(load(builder, p, 2, vec(I8, 32)), vec(I32, 32))
        qh = pick(builder, load(builder, p, 66, vec(I8, 8)), [g // 4 for g in range(32)])
        hi = builder.and_(
            builder.lshr(qh, consts(I8, [2 * (g % 4) for g in range(32)])), splat(I8, 32, 3)
        )
        index = builder.or_(qs, builder.shl(builder.zext(hi, vec(I32, 32)), splat(I32, 32, 8)))
        signs = load(builder, p, 34, vec(I8, 32))
        scales = _nibble_scales(builder, load(builder, p, 74, vec(I8, 8)), True)
    elif f == IQ3_S:  # qs[64] low index bytes, qh[8] (bit 8), signs[32], scales[4]
        qs = builder.zext(load(builder, p, 2, vec(I8, 64)), vec(I32, 64))
        qh = pick(builder, load(builder, p, 66, vec(I8, 8)), [g // 8 for g in range(64)])
        hit = builder.icmp_unsigned(
            "!=", builder.and_(qh, consts(I8, [1 << (g % 8) for g in range(64)])), splat(I8, 64, 0)
        )
        index = builder.or_(qs, builder.select(hit, splat(I32, 64, 256), splat(I32, 64, 0)))
        signs = load(builder, p, 74, vec(I8, 32))
        scales = _nibble_scales(builder, load(builder, p, 106, vec(I8, 4)), False)
    elif f == IQ1_S:  # qs[32] low index bytes, qh u16[8]: 3 bits a group, scale, delta's sign
        qs = builder.zext(load(builder, p, 2, vec(I8, 32)), vec(I32, 32))
        qh = builder.zext(load(builder, p, 34, vec(I16, 8)), vec(I32, 8))
        spread = pick(builder, qh, [g // 4 for g in range(32)])
        hi = builder.and_(
            builder.lshr(spread, consts(I32, [3 * (g % 4) for g in range(32)])), splat(I32, 32, 7)
        )
        index = builder.or_(qs, builder.shl(hi, splat(I32, 32, 8)))
        minus = builder.trunc(builder.lshr(qh, splat(I32, 8, 15)), vec(I8, 8))  # 1: delta -1
        minus = pick(builder, minus, [g // 4 for g in range(32)])  # per group of 8
        sc = builder.and_(builder.lshr(qh, splat(I32, 8, 12)), splat(I32, 8, 7))
        sc = builder.add(builder.shl(sc, splat(I32, 8, 1)), splat(I32, 8, 1))
        scales = builder.trunc(pick(builder, sc, [j // 2 for j in range(16)]), vec(I16, 16))
    else:  # IQ1_M: qs[32], qh[16] (a nibble a group: 3 index bits, delta's sign), scales u16[4]
        qs = builder.zext(load(builder, p, 0, vec(I8, 32)), vec(I32, 32))
        qh = pick(builder, load(builder, p, 32, vec(I8, 16)), [g // 2 for g in range(32)])
        nib = builder.lshr(qh, consts(I8, [4 * (g % 2) for g in range(32)]))
        hi = builder.zext(builder.and_(nib, splat(I8, 32, 7)), vec(I32, 32))
        index = builder.or_(qs, builder.shl(hi, splat(I32, 32, 8)))
        minus = builder.and_(builder.lshr(nib, splat(I8, 32, 3)), splat(I8, 32, 1))
        words = load(builder, p, 48, vec(I16, 4))
        spread = pick(builder, words, [j // 4 for j in range(16)])
        sc = builder.and_(
            builder.lshr(spread, consts(I16, [3 * (j % 4) for j in range(16)])), splat(I16, 16, 7)
        )
        scales = builder.add(builder.shl(sc, splat(I16, 16, 1)), splat(I16, 16, 1))
        # d: the top nibbles of the four words, the first lowest
        top = builder.lshr(words, splat(I16, 4, 12))
        top = builder.shl(top, consts(I16, [0, 4, 8, 12]))
        bits = reduce_add(builder, top)  # disjoint bits: the sum is their or
    g = _gather(builder, table, index, POINT[f])  # <256 x i8>
    chunks = [pick(builder, g, range(64 * c, 64 * c + 64)) for c in range(4)]
    if f in IQ1:
        # 8 * grid + 16 from the table, plus delta = 1 - 2 * minus
        delta = builder.sub(splat(I8, 32, 1), builder.shl(minus, splat(I8, 32, 1)))
        codes = [
            builder.add(chunks[c], pick(builder, delta, [8 * c + e // 8 for e in range(64)]))
            for c in range(4)
        ]
    else:
        centre = splat(I8, 64, CENTRE)
        codes = [
            builder.select(
                _byte_mask(builder, signs, c),
                builder.sub(centre, chunks[c]),
                builder.add(centre, chunks[c]),
            )
            for c in range(4)
        ]
    if f == IQ1_M:
        d = halves(builder, bits)
    else:
        d = halves(builder, load(builder, p, 0, I16))
    return codes, scales, d


@intrinsic(prefer_literal=True)
def grid_row(
    typingctx: Any,
    raw: Any,
    off: Any,
    nb: Any,
    table: Any,
    xq: Any,
    bs: Any,
    yd: Any,
    t0: Any,
    tokens: Any,
    out: Any,
    oo: Any,
    ostride: Any,
    fmt: Any,
) -> Any:
    """ggml's generic ``vec_dot_iq*_q8_K`` of one weight row (``nb`` super-blocks of grid
    format ``fmt`` at byte ``off`` of ``raw``) with ``tokens`` (at most :data:`TOKENS`)
    tokens from token ``t0`` of the Q8_K activations: codes ``xq`` (T*K int8, in order), the
    sums of each 16 codes ``bs`` (T*K/16 int16), the super-blocks' d ``yd`` (T*K/256
    float32). Writes token t's float32 sum to ``out[oo + t * ostride]``; ``table`` is
    :data:`TABLE`."""
    f = _literal(fmt, FORMATS, "grid_row: fmt")
    if f is None:
        return None
    ts, centre = TYPE_SIZE[f], IQ1_CENTRE if f in IQ1 else CENTRE
    final = ROW_SCALE.get(f, 1.0)

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        nb_v, t0_v, n_tok, ostride_v = args[2], args[7], args[8], args[11]
        row = byte_ptr(builder, data_ptr(context, builder, sig.args[0], args[0]), args[1])
        tab = byte_ptr(builder, data_ptr(context, builder, sig.args[3], args[3]), TABLE_AT[f])
        xbase, bsbase, ydbase = (
            data_ptr(context, builder, sig.args[i], args[i]) for i in (4, 5, 6)
        )
        k = builder.mul(nb_v, i64(256))
        sums = cgutils.alloca_once(builder, F32, size=TOKENS)
        zero = ir.Constant(F32, 0.0)

        def clear(t: Any, carried: list[Any]) -> list[Any]:
            builder.store(zero, builder.gep(sums, [t]))
            return carried

        counted_loop(builder, i64(0), n_tok, [], clear)

        def super_block(sb: Any, carried: list[Any]) -> list[Any]:
            p = byte_ptr(builder, row, builder.mul(sb, i64(ts)))
            for line in range(0, ts, 64):
                prefetch(builder, p, PREFETCH + line)
            codes, scales, d = _decode(builder, f, p, tab)
            lanes = [pick(builder, scales, [4 * c + i // 8 for i in range(32)]) for c in range(4)]

            def token(t: Any, inner: list[Any]) -> list[Any]:
                tok = builder.add(t0_v, t)
                xo = builder.add(builder.mul(tok, k), builder.mul(sb, i64(256)))
                acc = None
                for c in range(4):
                    xs = load(builder, xbase, builder.add(xo, i64(64 * c)), vec(I8, 64))
                    part = scaled_pairs(builder, pair_dots(builder, codes[c], xs), lanes[c])
                    acc = part if acc is None else builder.add(acc, part)
                bo = builder.mul(builder.add(builder.mul(tok, nb_v), sb), i64(32))  # 16 x i16
                bsums = load(builder, bsbase, bo, vec(I16, 16))
                # the centre's share: centre * sum_s scale_s * bsum_s
                corr = builder.mul(scaled_pairs(builder, scales, bsums), splat(I32, 8, centre))
                folded = builder.add(pick(builder, acc, range(8)), pick(builder, acc, range(8, 16)))
                bsum = reduce_add(builder, builder.sub(folded, corr))
                ydb = load(
                    builder,
                    ydbase,
                    builder.mul(builder.add(builder.mul(tok, nb_v), sb), i64(4)),
                    F32,
                )
                fi = builder.sitofp(bsum, F32)
                if f in IQ1:
                    fi = builder.fmul(fi, ir.Constant(F32, 0.125))
                term = builder.fmul(builder.fmul(d, ydb), fi)
                slot = builder.gep(sums, [t])
                builder.store(builder.fadd(builder.load(slot), term), slot)
                return inner

            counted_loop(builder, i64(0), n_tok, [], token)
            return carried

        counted_loop(builder, i64(0), nb_v, [], super_block)
        o = data_ptr(context, builder, sig.args[9], args[9])

        def write(t: Any, carried: list[Any]) -> list[Any]:
            total = builder.fmul(ir.Constant(F32, final), builder.load(builder.gep(sums, [t])))
            at = builder.add(args[10], builder.mul(t, ostride_v))
            store(builder, total, o, builder.mul(at, i64(4)))
            return carried

        counted_loop(builder, i64(0), n_tok, [], write)
        return context.get_dummy_value()

    sig = types.none(raw, off, nb, table, xq, bs, yd, t0, tokens, out, oo, ostride, fmt)
    return sig, codegen


# --- drivers -----------------------------------------------------------------------------------


@njit(**INLINE)
def q8k_grid(x):
    """The rows of ``x`` (T, K) as Q8_K: codes in order (T*K,) int8, d (T*K/256,) float32,
    the sums of each 16 codes (T*K/16,) int16 (at most 16 * 128 in magnitude)."""
    xq, dx, bsums = q8k_rows(x)
    return xq, dx.reshape(-1), bsums.reshape(-1).astype(np.int16)


@njit(**INLINE)
def gemv_grid(buf, offs, rows, x, simd, threads, out, outs_at, fmt):
    """``x @ W_i.T`` for a few tokens ``x`` (T, K) and the grid-format weights ``i`` at bytes
    ``offs[i]`` of ``buf`` (``rows[i]`` rows each): written row-major (T, rows[i]) to
    ``out[outs_at[i]:]``. Each thread takes a share of every weight's rows; each row is
    decoded once per :data:`TOKENS` tokens."""
    tokens, k = x.shape
    nb = k // 256
    rb = nb * SIZES[fmt]
    xq, dx, bs = q8k_grid(x)
    for c in prange(threads):
        for i in range(offs.shape[0]):
            r0, r1 = _chunk(rows[i], threads, c)
            for r in range(r0, r1):
                for t0 in range(0, tokens, TOKENS):
                    n = min(TOKENS, tokens - t0)
                    o = outs_at[i] + t0 * rows[i] + r
                    grid_row(
                        buf, offs[i] + r * rb, nb, TABLE, xq, bs, dx, t0, n, out, o, rows[i], fmt
                    )


def _kernel(fmt: int, parallel: bool) -> Any:
    """The driver for one format, the format a constant."""

    def kernel(buf, offs, rows, x, simd, threads, out, outs_at):
        gemv_grid(buf, offs, rows, x, simd, threads, out, outs_at, fmt)

    return named_kernel(kernel, "gemv", fmt, parallel)


# format id -> (parallel, serial) compiled kernels:
# ``kernel(buf, offs, rows, x, simd, threads, out, outs_at)``
KERNELS = {fmt: (_kernel(fmt, True), _kernel(fmt, False)) for fmt in FORMATS}
