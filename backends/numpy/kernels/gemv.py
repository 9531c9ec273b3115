"""Decoding kernels: a few tokens against every weight row, streamed once at memory speed.

Each weight row's dot product with one token is one loop in LLVM IR (:func:`legacy_rows`,
:func:`kquant_row`, :func:`iq4xs_row`), its accumulators in registers from the first block
to the last, so that the bytes of a row are read once, in order, and used as they arrive:

* **32-blocks** (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; IQ4_NL and MXFP4, whose nibbles index a
  table of levels), 4 rows (Q8_0: 1, :func:`_four_rows`) and 4 blocks a step (the nibble
  formats where the host has AVX512-VBMI: each row's 4 blocks in one vector, picked from two
  64-byte loads by ``vpermt2b``, :func:`_rows_sums4`; else each block's 4 rows in one): the
  codes as stored (unsigned: Q8_0's ``w ^ 0x80``, i.e. ``w + 128``; the levels plus 128) times the
  activations, four products a lane (``vpdpbusd``), the 16 dot products' lanes reduced
  together; minus the centre times the activations' block sum (8, 16 or 128: precomputed
  per token) gives ``integer_form``'s sums; the 16 fp16 scales in one gather (MXFP4: its
  E8M0 bytes, made float32 from their bits);
  ``(d*y.d)*isum`` (Q4_0: ``(isum*d)*y.d``; ``+ m*y.s`` for the _1 types) for the 16 at
  once, then added to each row's sum one by one, in block order.
* **K-quants** (Q2_K..Q6_K), a 256-super-block a step: ggml's 8 accumulator lanes (element
  ``e`` in lane ``e % 8``). The activations are permuted once per token within each 64
  (:data:`LANE_ORDER`) so that adjacent bytes share a lane and a 16-sub-block; the codes get
  the same permutation (one ``vpermb``); ``vpmaddubsw`` sums them in pairs (int16, exact),
  ``vpmaddwd`` multiplies by the sub-block scales and adds two pairs of one lane. The 8 lane
  sums are scaled by ``d*y.d`` into 8 float32 accumulators (one vector), the mins term
  ``(dmin*y.d)*msum`` subtracted from the row's sum, the lanes added at the end in order.
* **IQ4_XS**, a 256-super-block a step: each 32-block's levels plus 128 (a ``pshufb`` table
  lookup of its nibbles) times the Q8_K activations (``vpdpbusd``), minus 128 times their
  block sums; the 8 sub-block scales ``ls - 32`` as one vector; ``((d*y.d)*(ls - 32))*isum``
  added to the row's sum sub-block by sub-block.

These are the same integers and the same float32 operations, in the same order, as ggml's
generic C and :func:`qllama.backends.numpy.oracle.vec_dot`: ``tests/test_cpu_kernels.py`` checks
them bit for bit. Rows are split over numba's threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from qllama.backends.numpy.kernels.llvm_ir import (
    AVX512,
    F32,
    I1,
    I8,
    I16,
    I32,
    I64,
    PAIRS,
    VBMI,
    blocks_loop,
    broadcast,
    byte_ptr,
    consts,
    counted_loop,
    data_ptr,
    dot4,
    dot4_into,
    fsum_in_order,
    gather_dwords,
    halves,
    i64,
    joined,
    load,
    pair_dots,
    pick,
    prefetch,
    quads,
    quads_zero,
    reduce_add,
    scaled_pairs,
    shuffle,
    signed_dot4,
    small_dot4,
    splat,
    store,
    vec,
)
from qllama.backends.numpy.kernels.quantize import q8_row, q8k_row
from qllama.backends.numpy.kernels.simd import (
    IQ4_NL,
    IQ4_XS,
    KQUANTS,
    LEGACY,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    _kquant_run,
    _kquant_scales,
    _legacy_codes,
    _literal,
    _nibbles,
    _reduce_together,
    _table_lookup,
    tune,
)
from qllama.jit import INLINE, JIT, named_kernel
from qllama.quants import fp4, iq4_search

TYPE_SIZE = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, IQ4_NL: 18, MXFP4: 17}
TYPE_SIZE |= {Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210}
# what the stored (unsigned) code is above integer_form's: Q4_0, Q5_0, Q8_0 (as w ^ 0x80);
# Q3_K and Q6_K (their codes are signed in integer_form); the others have none
CENTRE = {Q4_0: 8, Q5_0: 16, Q8_0: 128, Q3_K: 4, Q6_K: 32, IQ4_NL: 128, MXFP4: 128}
# the 32-block formats of the decoding loop: the legacy ones, IQ4_NL (Q4_0's layout, its
# nibbles indexing a table of levels, stored plus 128) and MXFP4 (IQ4_NL's, its fp16 d one
# E8M0 byte instead, its table the doubled E2M1 values)
BLOCKS32 = (*LEGACY, IQ4_NL, MXFP4)
IQ4_LEVELS = [(int(v) + 128) & 0xFF for v in iq4_search.KVALUES]  # unsigned: levels + 128
LEVELS = {IQ4_NL: IQ4_LEVELS, MXFP4: [(int(v) + 128) & 0xFF for v in fp4.KVALUES]}
WITH_M = (Q4_1, Q5_1)  # + m * y.s
WITH_MINS = (Q2_K, Q4_K, Q5_K)  # - (dmin * y.d) * msum
SUB32 = (Q4_K, Q5_K)  # sub-blocks of 32 elements (the other K-quants: 16)
SIZES = np.zeros(64, np.int64)  # bytes per block by format id, for compiled code
SIZES[list(TYPE_SIZE)] = list(TYPE_SIZE.values())
D_AT = {Q2_K: 80, Q3_K: 108, Q4_K: 0, Q5_K: 0, Q6_K: 208}  # byte offset of d (dmin: + 2)

PREFETCH = 1024  # bytes ahead of a row's reads

# Within each 64 elements of a K-quant super-block: byte 4m + 2q + p, m = 8h + l, holds
# element 16(2h + q) + 8p + l. Each pair of bytes is then one lane (l) of one 16-sub-block
# (2h + q), each 4 bytes one lane of one 32-sub-block, and lane l's sums fall in 32-bit
# words l and l + 8.
LANE_ORDER = np.array(
    [
        16 * (2 * h + q) + 8 * p + lane
        for h in range(2)
        for lane in range(8)
        for q in range(2)
        for p in range(2)
    ],
    np.int64,
)


# --- 32-blocks ---------------------------------------------------------------------------------


def _stored_codes(builder: ir.IRBuilder, fmt: int, p: Any) -> Any:
    """The 32 codes of the block at ``p`` as unsigned bytes (Q8_0: ``w ^ 0x80``; IQ4_NL,
    MXFP4: their levels plus 128)."""
    if fmt in LEVELS:
        qs = load(builder, p, QS_AT[fmt], vec(I8, 16))
        return _table_lookup(builder, LEVELS[fmt], _nibbles(builder, qs))
    q = _legacy_codes(builder, fmt, p, False)
    return builder.xor(q, splat(I8, 32, 0x80)) if fmt == Q8_0 else q


# formats whose stored codes are below 32 (vpmaddubsw takes them exactly: llvm_ir.small_dot4)
SMALL_CODES = (Q4_0, Q4_1, Q5_0, Q5_1)
# On AVX2 without VNNI, Q8_0's codes enter the decode loop's products as they are, signed
# (llvm_ir.signed_dot4, as ggml's AVX2 code does), where AVX512-VNNI takes them as stored
# plus 128 (vpdpbusd is unsigned by signed) with the centre's 128 times the block sums taken
# off after: the same integers either way.
Q8_SIGNED = PAIRS
Q8_0_CENTRE = 0 if Q8_SIGNED else CENTRE[Q8_0]
GEMV_CENTRE = CENTRE | {Q8_0: Q8_0_CENTRE}
# where a nibble block's 16 qs bytes start
QS_AT = {Q4_0: 2, Q4_1: 4, Q5_0: 6, Q5_1: 8, IQ4_NL: 2, MXFP4: 1}
QH_AT = {Q5_0: 2, Q5_1: 4}  # its 4 bytes of fifth bits
# Each row's four blocks of a step in one vector (:func:`_rows_sums4`), where the host
# permutes bytes across a 512-bit vector (AVX512-VBMI); else each block's four rows
ROW_BLOCKS4 = (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4) if AVX512 and VBMI else ()


def _nibble_codes(
    builder: ir.IRBuilder, fmt: int, qs: Any, spread: Callable[[int], Any]
) -> tuple[Any, Any]:
    """The stored codes of four 16-byte ``qs`` runs of a nibble format side by side (<64 x
    i8>, a block's a run): its low nibbles (elements 0..15 of each), then its high ones
    (16..31); IQ4_NL's and MXFP4's levels plus 128; Q5's fifth bits (bit j of ``qh`` for
    element j) or'ed in, ``spread(half)`` giving for each byte of a half the ``qh`` byte
    that holds its bit (bit ``n % 8`` of it for byte n)."""
    lo = builder.and_(qs, splat(I8, 64, 15))
    hi = builder.and_(builder.lshr(qs, splat(I8, 64, 4)), splat(I8, 64, 15))
    if fmt in LEVELS:  # the levels the nibbles index, plus 128
        lo, hi = (_levels64(builder, LEVELS[fmt], codes) for codes in (lo, hi))
    if fmt in QH_AT:
        for half in (0, 1):
            bit = builder.and_(spread(half), consts(I8, [1 << (n % 8) for n in range(64)]))
            hit = builder.icmp_unsigned("!=", bit, splat(I8, 64, 0))
            fifth = builder.select(hit, splat(I8, 64, 16), splat(I8, 64, 0))
            if half:
                hi = builder.or_(hi, fifth)
            else:
                lo = builder.or_(lo, fifth)
    return lo, hi


def nibble_codes4(builder: ir.IRBuilder, fmt: int, rows: list[Any], blk: Any) -> tuple[Any, Any]:
    """The stored codes of block ``blk`` of 4 rows of a nibble format (Q4_0, Q4_1, Q5_0,
    Q5_1, IQ4_NL, MXFP4), two <64 x i8>: the rows' elements 0..15 side by side (16 bytes a
    row), then their elements 16..31 (:func:`_nibble_codes`). The 4 rows' 16 ``qs`` bytes
    are loaded into one vector, their 4 ``qh`` bytes into another."""
    at = builder.mul(blk, i64(TYPE_SIZE[fmt]))
    qs = [load(builder, rows[r], builder.add(at, i64(QS_AT[fmt])), vec(I8, 16)) for r in range(4)]
    v = joined(builder, qs)
    qh = None
    if fmt in QH_AT:
        words = [
            load(builder, rows[r], builder.add(at, i64(QH_AT[fmt])), vec(I8, 4)) for r in range(4)
        ]
        qh = joined(builder, words)

    def spread(half: int) -> Any:
        return pick(builder, qh, [4 * (n // 16) + 2 * half + (n % 16) // 8 for n in range(64)])

    return _nibble_codes(builder, fmt, v, spread)


def _row_codes4(builder: ir.IRBuilder, fmt: int, row: Any, b0: Any) -> tuple[Any, Any, Any]:
    """Blocks ``b0 .. b0+3`` of one row of a nibble format in two 64-byte loads (the first
    64 bytes and the last 64 of the four blocks: none past them), each block's bytes picked
    from those into its 128-bit lane (``vpermt2b``): their stored codes as
    :func:`nibble_codes4` lays out 4 rows' (block b in lane b), and each block's first
    32-bit word (d; m after it in Q4_1 and Q5_1), <4 x i32>."""
    ts = TYPE_SIZE[fmt]
    first = byte_ptr(builder, row, builder.mul(b0, i64(ts)))
    head, tail = (
        load(builder, first, 0, vec(I8, 64)),
        load(builder, first, 4 * ts - 64, vec(I8, 64)),
    )

    def picked(offsets: list[int]) -> Any:  # byte p of the four blocks, for each of offsets
        return shuffle(builder, head, tail, [p if p < 64 else p - 4 * ts + 128 for p in offsets])

    qs = picked([ts * (n // 16) + QS_AT[fmt] + n % 16 for n in range(64)])
    words = builder.bitcast(picked([ts * (n // 4) + n % 4 for n in range(16)]), vec(I32, 4))

    def spread(half: int) -> Any:
        return picked([ts * (n // 16) + QH_AT[fmt] + 2 * half + (n % 16) // 8 for n in range(64)])

    lo, hi = _nibble_codes(builder, fmt, qs, spread)
    return lo, hi, words


def _levels64(builder: ir.IRBuilder, table: list[int], idx: Any) -> Any:
    """``table``'s levels plus 128 for 64 indices below 16, 32 at a time."""
    parts = [_table_lookup(builder, table, pick(builder, idx, range(h, h + 32))) for h in (0, 32)]
    return shuffle(builder, parts[0], parts[1], range(64))


def _nibble_sums(builder: ir.IRBuilder, fmt: int, rows: list[Any], x: Any, blk: Any) -> Any:
    """The integer sums of block ``blk`` of 4 rows of a nibble format with one token: the
    low halves (:func:`nibble_codes4`) against the token's first 16 activations in every
    128-bit lane, the high ones against the next 16. <16 x i32>, 4 partial sums per row."""
    lo, hi = nibble_codes4(builder, fmt, rows, blk)
    xb = builder.mul(blk, i64(32))
    xl, xh = (load(builder, x, builder.add(xb, i64(h)), vec(I8, 16)) for h in (0, 16))
    xl, xh = (pick(builder, v16, [n % 16 for n in range(64)]) for v16 in (xl, xh))
    return _halves_dot(builder, fmt, lo, hi, xl, xh)


def _halves_dot(builder: ir.IRBuilder, fmt: int, lo: Any, hi: Any, xl: Any, xh: Any) -> Any:
    """The low halves' codes ``lo`` by their activations ``xl`` plus the high ones' ``hi``
    by ``xh`` (<64 x i8> each, four 16-byte runs): <16 x i32>, 4 partial sums a run."""
    if PAIRS and fmt in SMALL_CODES:  # vpmaddubsw, the halves' pair sums added in int16
        pairs = builder.add(pair_dots(builder, lo, xl), pair_dots(builder, hi, xh))
        return scaled_pairs(builder, pairs, splat(I16, 32, 1))
    return quads(builder, dot4_into(builder, dot4_into(builder, quads_zero(), lo, xl), hi, xh))


def _rows_sums4(
    builder: ir.IRBuilder, fmt: int, rows: list[Any], x: Any, b0: Any
) -> tuple[Any, Any]:
    """The integer sums of blocks ``b0 .. b0+3`` of each row of a nibble format with one
    token, each row's four blocks in one vector (:func:`_row_codes4`), all reduced together:
    <4R x i32>, lane ``R*b + r`` for row r's block ``b0 + b``; and the blocks' first words in
    the same lanes."""
    n_rows = len(rows)
    xs = [
        load(builder, x, builder.add(builder.mul(b0, i64(32)), i64(h)), vec(I8, 64))
        for h in (0, 64)
    ]
    xl, xh = (
        shuffle(builder, xs[0], xs[1], [32 * (n // 16) + half + n % 16 for n in range(64)])
        for half in (0, 16)
    )
    dots, words = [], []
    for row in rows:
        lo, hi, w = _row_codes4(builder, fmt, row, b0)
        dots.append(_halves_dot(builder, fmt, lo, hi, xl, xh))
        words.append(w)
    by_row = _reduce_together(builder, dots, 4, 4 * n_rows)  # lane 4r + b
    order = [4 * (n % n_rows) + n // n_rows for n in range(4 * n_rows)]  # lane R*b + r
    return pick(builder, by_row, order), pick(builder, joined(builder, words), order)


def _legacy_sums(
    builder: ir.IRBuilder, fmt: int, rows: list[Any], x: Any, b0: Any, blocks: int
) -> Any:
    """The integer sums of ``blocks`` blocks from ``b0`` of each row with one token (the
    codes as stored: see :func:`legacy_rows`), reduced together: <R * blocks x i32>, lane
    ``R*b + r`` for row r's block ``b0 + b``."""
    ts, n_rows = TYPE_SIZE[fmt], len(rows)
    count = n_rows * blocks
    if n_rows == 4 and fmt in QS_AT:
        vecs = [_nibble_sums(builder, fmt, rows, x, builder.add(b0, i64(b))) for b in range(blocks)]
        return _reduce_together(builder, vecs, 4, count)
    # two (row, block) dot products a vector: 8 partial sums each
    dots: list[tuple[int, int] | None] = [(r, b) for b in range(blocks) for r in range(n_rows)]
    dots += [None] * (len(dots) % 2)
    zero32 = splat(I8, 32, 0)
    vecs = []
    for i in range(0, len(dots), 2):
        parts = []
        for dot in dots[i : i + 2]:
            if dot is None:
                parts.append((zero32, zero32))
                continue
            r, b = dot
            blk = builder.add(b0, i64(b))
            at = byte_ptr(builder, rows[r], builder.mul(blk, i64(ts)))
            if fmt == Q8_0 and Q8_SIGNED:
                codes = load(builder, at, 2, vec(I8, 32))
            else:
                codes = _stored_codes(builder, fmt, at)
            parts.append((codes, load(builder, x, builder.mul(blk, i64(32)), vec(I8, 32))))
        u = shuffle(builder, parts[0][0], parts[1][0], list(range(64)))
        xs = shuffle(builder, parts[0][1], parts[1][1], list(range(64)))
        dot_of: Callable[..., Any]
        if fmt == Q8_0 and Q8_SIGNED:
            dot_of = signed_dot4
        else:
            dot_of = small_dot4 if fmt in SMALL_CODES else dot4
        vecs.append(dot_of(builder, splat(I32, 16, 0), u, xs))
    return _reduce_together(builder, vecs, 8, count)


def _block_words(
    builder: ir.IRBuilder, rows: list[Any], rb: Any, at: Any, ts: int, per_block: list[int]
) -> Any:
    """The first 32-bit word (d, and m for the _1 types) of block ``per_block[n]`` of row
    ``n % R`` for each lane n, from byte ``at`` of each row: one ``vpgatherdd`` where the host
    has AVX512; else a load each at a constant offset from its row's pointer (AVX2's gather
    is slow, and LLVM would split the vector of addresses into scalars first)."""
    n_rows, count = len(rows), len(per_block)
    if AVX512:
        row_of = consts(I64, [n % n_rows for n in range(count)])
        offsets = builder.add(
            consts(I64, [b * ts for b in per_block]),
            builder.mul(broadcast(builder, rb, count), row_of),
        )
        first = byte_ptr(builder, rows[0], at)
        return gather_dwords(builder, first, builder.trunc(offsets, vec(I32, count)))
    starts = [byte_ptr(builder, row, at) for row in rows]
    words = ir.Constant(vec(I32, count), None)
    for n, b in enumerate(per_block):
        word = load(builder, starts[n % n_rows], b * ts, I32)
        words = builder.insert_element(words, word, ir.Constant(I32, n))
    return words


def _legacy_step(
    builder: ir.IRBuilder,
    fmt: int,
    rows: list[Any],
    rb: Any,
    x: Any,
    cxp: Any,
    ydp: Any,
    ysp: Any,
    b0: Any,
    blocks: int,
    sums: Any,
) -> Any:
    """``blocks`` blocks from ``b0`` of each row (pointers ``rows``): their terms, added to
    the rows' sums ``sums`` (<R x float>) block by block. The R * blocks integer sums are
    reduced together, lane ``R*b + r`` for row r's block ``b0 + b``."""
    ts, centre, n_rows = TYPE_SIZE[fmt], GEMV_CENTRE.get(fmt, 0), len(rows)
    count = n_rows * blocks
    # the same bytes of the next rows (the next group's, one group ahead: the rows of a group
    # lie one after the other, so their lines come in order)
    ahead = builder.add(builder.mul(b0, i64(ts)), builder.mul(rb, i64(n_rows)))
    for r in range(n_rows):
        for line in range(0, blocks * ts, 64):
            prefetch(builder, rows[r], builder.add(ahead, i64(line)))
    words = None
    if blocks == 4 and fmt in ROW_BLOCKS4:
        isum, words = _rows_sums4(builder, fmt, rows, x, b0)
    else:
        isum = _legacy_sums(builder, fmt, rows, x, b0, blocks)  # (R * blocks,) i32
    per_block = [n // n_rows for n in range(count)]  # lane -> block

    def by_block(base: Any, elem: ir.Type) -> Any:
        v = load(builder, base, builder.mul(b0, i64(4)), vec(elem, blocks))
        return pick(builder, v, per_block)

    if centre:
        isum = builder.sub(isum, by_block(cxp, I32))
    if words is None:
        words = _block_words(builder, rows, rb, builder.mul(b0, i64(ts)), ts, per_block)
    if fmt == MXFP4:
        d = _e8m0_halves(builder, builder.and_(words, splat(I32, count, 0xFF)))
    else:
        d = halves(builder, builder.trunc(words, vec(I16, count)))
    fi = builder.sitofp(isum, vec(F32, count))
    yd = by_block(ydp, F32)
    if fmt == Q4_0:
        term = builder.fmul(builder.fmul(fi, d), yd)
    else:
        term = builder.fmul(builder.fmul(d, yd), fi)
    if fmt in WITH_M:
        m = halves(
            builder, builder.trunc(builder.lshr(words, splat(I32, count, 16)), vec(I16, count))
        )
        term = builder.fadd(term, builder.fmul(m, by_block(ysp, F32)))
    for b in range(blocks):  # each row's sum, block by block
        sums = builder.fadd(sums, pick(builder, term, list(range(n_rows * b, n_rows * (b + 1)))))
    return sums


def _e8m0_halves(builder: ir.IRBuilder, e: Any) -> Any:
    """MXFP4's scale bytes ``e`` (<n x i32>, below 256) as ``ggml_e8m0_to_fp32_half`` makes
    them, from the bits: ``0x00200000 << e`` for the subnormals (e < 2), else ``(e - 1) << 23``."""
    n = e.type.count
    low = builder.icmp_unsigned("<", e, splat(I32, n, 2))
    sub = builder.shl(splat(I32, n, 0x00200000), e)
    normal = builder.shl(builder.sub(e, splat(I32, n, 1)), splat(I32, n, 23))
    return builder.bitcast(builder.select(low, sub, normal), vec(F32, n))


@intrinsic(prefer_literal=True)
def legacy_rows(
    typingctx: Any,
    raw: Any,
    off: Any,
    rb: Any,
    nb: Any,
    xq: Any,
    xo: Any,
    cx: Any,
    yd: Any,
    ys: Any,
    out: Any,
    oo: Any,
    fmt: Any,
    n_rows: Any,
) -> Any:
    """ggml's generic ``vec_dot`` of ``n_rows`` (1 or 4) weight rows of ``nb`` 32-blocks of
    format ``fmt`` (the first at byte ``off`` of ``raw``, one every ``rb`` bytes) with one
    token's Q8_0 / Q8_1 activations: codes ``xq[xo:xo+32*nb]`` (int8), ``cx[b]`` the centre
    times their block sums (int32), ``yd`` and ``ys`` the blocks' stored d and s (float32).
    Writes the rows' float32 sums to ``out[oo:oo+n_rows]``.

    Four blocks a step: the rows' 16 integer sums reduced together, their terms computed
    as one vector and added to the 4 rows' sums as a 4-lane vector, block after block; then
    2 and 1 blocks for the rest."""
    f = _literal(fmt, BLOCKS32, "legacy_rows: fmt")
    n = _literal(n_rows, (1, 4), "legacy_rows: n_rows")
    if f is None or n is None:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        rb, nb_v = args[2], args[3]
        first = byte_ptr(builder, data_ptr(context, builder, sig.args[0], args[0]), args[1])
        rows = [byte_ptr(builder, first, builder.mul(rb, i64(r))) for r in range(n)]
        x = byte_ptr(builder, data_ptr(context, builder, sig.args[4], args[4]), args[5])
        cxp, ydp, ysp = (data_ptr(context, builder, sig.args[i], args[i]) for i in (6, 7, 8))

        def steps(blocks: int) -> Any:
            def body(b0: Any, carried: list[Any]) -> list[Any]:
                return [
                    _legacy_step(builder, f, rows, rb, x, cxp, ydp, ysp, b0, blocks, carried[0])
                ]

            return body

        sums = ir.Constant(vec(F32, n), [ir.Constant(F32, 0.0)] * n)
        (sums,) = blocks_loop(builder, nb_v, [sums], steps, (4, 2, 1))
        o = data_ptr(context, builder, sig.args[9], args[9])
        store(builder, sums, o, builder.mul(args[10], i64(4)))
        return context.get_dummy_value()

    return types.none(raw, off, rb, nb, xq, xo, cx, yd, ys, out, oo, fmt, n_rows), codegen


# --- K-quants ----------------------------------------------------------------------------------


def _sub_of(fmt: int, chunk: int, n: int) -> int:
    """The sub-block of int16 lane ``n`` (a pair of :data:`LANE_ORDER` bytes) of 64-chunk
    ``chunk`` of a super-block."""
    h, q = n // 16, n % 2
    return 2 * chunk + h if fmt in SUB32 else 4 * chunk + 2 * h + q


def _k4_scales(builder: ir.IRBuilder, p: Any) -> Any:
    """Q4_K / Q5_K: ggml's ``get_scale_min_k4`` for all 8 sub-blocks, <16 x i8>: the
    scales, then the mins (6 bits each; bit diagram in
    :func:`qllama.quants.kquant_search.scale_min_k4`)."""
    v = load(builder, p, 4, vec(I8, 16))  # 12 bytes of scales, 4 of qs (unused)
    a = pick(builder, v, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11])
    top = pick(builder, v, [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7])
    top = builder.shl(builder.lshr(top, splat(I8, 16, 6)), splat(I8, 16, 4))
    low6 = builder.and_(a, splat(I8, 16, 63))
    hi_sc = builder.or_(builder.and_(a, splat(I8, 16, 15)), top)
    hi_mn = builder.or_(builder.lshr(a, splat(I8, 16, 4)), top)
    lane = [ir.Constant(I1, 1 if (n % 8) < 4 else 0) for n in range(16)]
    sc_lane = [ir.Constant(I1, 1 if n < 8 else 0) for n in range(16)]
    hi = builder.select(ir.Constant(vec(I1, 16), sc_lane), hi_sc, hi_mn)
    return builder.select(ir.Constant(vec(I1, 16), lane), low6, hi)


def _scales(builder: ir.IRBuilder, fmt: int, p: Any) -> tuple[Any, Any]:
    """A super-block's sub-block scales (<16 x i8>; 8 used by Q4_K/Q5_K) and mins (<16 x
    i16>: Q2_K 16, Q4_K/Q5_K 8 then zeros; None without mins). Q2_K's, Q4_K's and Q5_K's
    scales are unsigned, Q3_K's and Q6_K's signed."""
    if fmt in SUB32:
        both = _k4_scales(builder, p)
        mins = builder.zext(pick(builder, both, list(range(8, 16)) * 2), vec(I16, 16))
        return both, mins
    if fmt == Q6_K:
        return load(builder, p, 192, vec(I8, 16)), None
    if fmt == Q2_K:  # byte s: scale in the low nibble, min in the high one
        b = load(builder, p, 0, vec(I8, 16))
        mins = builder.zext(builder.lshr(b, splat(I8, 16, 4)), vec(I16, 16))
        return builder.and_(b, splat(I8, 16, 15)), mins
    sc, _ = _kquant_scales(builder, fmt, p)  # Q3_K
    return builder.trunc(sc, vec(I8, 16)), None


def _scale_lanes(builder: ir.IRBuilder, fmt: int, sc: Any, chunk: int) -> Any:
    """The int16 scale of each pair of chunk ``chunk`` (<32 x i16>), from the scales ``sc``
    (<16 x i8>): one byte shuffle, with zeros (unsigned scales) or sign bytes as the high
    halves."""
    subs = [_sub_of(fmt, chunk, n) for n in range(32)]
    if fmt in (Q3_K, Q6_K):
        return pick(builder, builder.sext(sc, vec(I16, 16)), subs)
    mask = [i for s in subs for i in (s, 16)]  # byte 16: a zero
    return builder.bitcast(shuffle(builder, sc, splat(I8, 16, 0), mask), vec(I16, 32))


@intrinsic(prefer_literal=True)
def kquant_row(
    typingctx: Any,
    raw: Any,
    off: Any,
    nb: Any,
    xl: Any,
    xo: Any,
    bs: Any,
    bo: Any,
    yd: Any,
    fmt: Any,
) -> Any:
    """ggml's generic ``vec_dot`` of one weight row (``nb`` super-blocks of K-quant ``fmt`` at
    byte ``off`` of ``raw``) with one token's Q8_K activations: codes ``xl[xo:xo+256*nb]``
    (int8, each 64 in :data:`LANE_ORDER`), the int16 sums ``bs[bo:]`` of each 16 (Q2_K) or
    each 32 (Q4_K, Q5_K) codes, and the super-blocks' d ``yd`` (float32). Returns the
    float32 sum."""
    f = _literal(fmt, KQUANTS, "kquant_row: fmt")
    if f is None:
        return None
    ts, centre = TYPE_SIZE[f], CENTRE.get(f, 0)
    perm = [int(e) for e in LANE_ORDER]
    n_mins = 16 if f == Q2_K else 8

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        row = byte_ptr(builder, data_ptr(context, builder, sig.args[0], args[0]), args[1])
        x = byte_ptr(builder, data_ptr(context, builder, sig.args[3], args[3]), args[4])
        bsp = byte_ptr(
            builder,
            data_ptr(context, builder, sig.args[5], args[5]),
            builder.mul(args[6], i64(2)),
        )
        ydp = data_ptr(context, builder, sig.args[7], args[7])

        def super_block(b: Any, carried: list[Any]) -> list[Any]:
            total, lanes = carried
            p = byte_ptr(builder, row, builder.mul(b, i64(ts)))
            for line in range(0, ts, 64):
                prefetch(builder, p, PREFETCH + line)
            sc, mn16 = _scales(builder, f, p)
            xb = builder.mul(b, i64(256))
            acc = splat(I32, 16, 0)
            for c in range(4):
                a, e = (_kquant_run(builder, f, p, 2 * c + j) for j in (0, 1))
                if centre:  # the stored code: integer_form's plus the centre
                    a, e = (builder.add(v, splat(I8, 32, centre)) for v in (a, e))
                u = shuffle(builder, a, e, perm)
                xs = load(builder, x, builder.add(xb, i64(64 * c)), vec(I8, 64))
                pairs = pair_dots(builder, u, xs)
                if centre:
                    pairs = builder.sub(pairs, pair_dots(builder, splat(I8, 64, centre), xs))
                scales = _scale_lanes(builder, f, sc, c)
                acc = builder.add(acc, scaled_pairs(builder, pairs, scales))
            aux = builder.add(pick(builder, acc, range(8)), pick(builder, acc, range(8, 16)))
            d2 = halves(builder, load(builder, p, D_AT[f], vec(I16, 2)))  # d, then dmin
            d, dmin = (builder.extract_element(d2, ir.Constant(I32, j)) for j in (0, 1))
            ydb = load(builder, ydp, builder.mul(b, i64(4)), F32)
            dd = builder.fmul(d, ydb)
            if mn16 is not None:
                bsums = load(builder, bsp, builder.mul(b, i64(2 * n_mins)), vec(I16, n_mins))
                mins = pick(builder, mn16, range(n_mins))
                msum = builder.sitofp(reduce_add(builder, scaled_pairs(builder, mins, bsums)), F32)
                mterm = builder.fmul(builder.fmul(dmin, ydb), msum)
            if f == Q2_K:  # one sum per block: (d*y.d)*isum - (dmin*y.d)*msum
                isum = builder.sitofp(reduce_add(builder, aux), F32)
                return [builder.fadd(total, builder.fsub(builder.fmul(dd, isum), mterm)), lanes]
            scaled = builder.fmul(builder.sitofp(aux, vec(F32, 8)), broadcast(builder, dd, 8))
            lanes = builder.fadd(lanes, scaled)
            if mn16 is not None:
                total = builder.fsub(total, mterm)
            return [total, lanes]

        zero = ir.Constant(F32, 0.0)
        zeros = ir.Constant(vec(F32, 8), [zero] * 8)
        total, lanes = counted_loop(builder, i64(0), args[2], [zero, zeros], super_block)
        return total if f == Q2_K else fsum_in_order(builder, total, lanes, 8)

    return types.float32(raw, off, nb, xl, xo, bs, bo, yd, fmt), codegen


# --- drivers -----------------------------------------------------------------------------------


# --- IQ4_XS -----------------------------------------------------------------------------------

IQ4_XS_SIZE = 136  # d (fp16), scales_h (u16), scales_l (4 bytes), qs (128 bytes)


def _iq4xs_codes(builder: ir.IRBuilder, p: Any, j: int) -> Any:
    """Sub-block ``j``'s 32 levels plus 128 (unsigned bytes) of the super-block at ``p``: the
    low nibbles of its 16 ``qs`` bytes are elements 0..15, the high ones 16..31."""
    qs = load(builder, p, 8 + 16 * j, vec(I8, 16))
    return _table_lookup(builder, IQ4_LEVELS, _nibbles(builder, qs))


def _iq4xs_scales(builder: ir.IRBuilder, p: Any) -> Any:
    """The 8 sub-block scales ``ls - 32`` of the super-block at ``p`` (<8 x i32>): ``ls_j``
    is nibble ``j % 2`` of ``scales_l[j / 2]`` with bits ``2j, 2j+1`` of ``scales_h`` above."""
    h = broadcast(builder, builder.zext(load(builder, p, 2, I16), I32), 8)
    high = builder.and_(builder.lshr(h, consts(I32, [2 * j for j in range(8)])), splat(I32, 8, 3))
    low = pick(builder, load(builder, p, 4, vec(I8, 4)), [j // 2 for j in range(8)])
    low = builder.lshr(builder.zext(low, vec(I32, 8)), consts(I32, [4 * (j % 2) for j in range(8)]))
    ls = builder.or_(builder.and_(low, splat(I32, 8, 15)), builder.shl(high, splat(I32, 8, 4)))
    return builder.sub(ls, splat(I32, 8, 32))


@intrinsic
def iq4xs_row(
    typingctx: Any,
    raw: Any,
    off: Any,
    nb: Any,
    xq: Any,
    xo: Any,
    cx: Any,
    co: Any,
    yd: Any,
    yo: Any,
    out: Any,
    oo: Any,
) -> Any:
    """ggml's generic ``vec_dot_iq4_xs_q8_K`` of one weight row (``nb`` super-blocks from byte
    ``off`` of ``raw``) with one token's Q8_K activations: codes ``xq[xo:]`` (int8, in
    order), ``cx[co:]`` 128 times each 32's sum of codes (int32), ``yd[yo:]`` each
    super-block's d (float32). Writes the float32 sum to ``out[oo]``.

    Per super-block: the 8 sub-blocks' levels plus 128 by the activations (``vpdpbusd``, two
    sub-blocks a vector), minus 128 times the sub-block sums, gives the exact integer sums;
    each sub-block adds ``((d*y.d)*(ls - 32))*isum`` to the row's sum, in order."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)

        def at(i: int, off: Any, scale: int) -> Any:
            base = data_ptr(context, builder, sig.args[i], args[i])
            return byte_ptr(builder, base, builder.mul(off, i64(scale)))

        row, x, cxp, ydp = (
            at(0, args[1], 1),
            at(3, args[4], 1),
            at(5, args[6], 4),
            at(7, args[8], 4),
        )

        def body(sb: Any, carried: list[Any]) -> list[Any]:
            p = byte_ptr(builder, row, builder.mul(sb, i64(IQ4_XS_SIZE)))
            for line in range(0, IQ4_XS_SIZE, 64):  # a few super-blocks ahead
                prefetch(builder, p, PREFETCH + line)
            xs = byte_ptr(builder, x, builder.mul(sb, i64(256)))
            vecs = []
            for j in range(0, 8, 2):  # two sub-blocks a vector
                u = shuffle(
                    builder, _iq4xs_codes(builder, p, j), _iq4xs_codes(builder, p, j + 1), range(64)
                )
                s = load(builder, xs, 32 * j, vec(I8, 64))
                vecs.append(dot4(builder, splat(I32, 16, 0), u, s))
            isum = _reduce_together(builder, vecs, 8, 8)  # (8,) i32, in sub-block order
            isum = builder.sub(isum, load(builder, cxp, builder.mul(sb, i64(32)), vec(I32, 8)))
            d = halves(builder, load(builder, p, 0, I16))
            d4d8 = builder.fmul(d, load(builder, ydp, builder.mul(sb, i64(4)), F32))
            ls = builder.sitofp(_iq4xs_scales(builder, p), vec(F32, 8))
            term = builder.fmul(
                builder.fmul(broadcast(builder, d4d8, 8), ls), builder.sitofp(isum, vec(F32, 8))
            )
            return [fsum_in_order(builder, carried[0], term, 8)]

        (acc,) = counted_loop(builder, i64(0), args[2], [ir.Constant(F32, 0.0)], body)
        o = data_ptr(context, builder, sig.args[9], args[9])
        store(builder, acc, o, builder.mul(args[10], i64(4)))
        return context.get_dummy_value()

    return types.none(raw, off, nb, xq, xo, cx, co, yd, yo, out, oo), codegen


@njit(**INLINE)
def q8k_rows(x):
    """The rows of ``x`` (T, K) as Q8_K: codes in order (T*K,) int8, d (T, K/256) float32,
    the sums of each 16 codes (T, K/16) int32."""
    tokens, k = x.shape
    xq = np.empty(tokens * k, np.int8)
    dx = np.empty((tokens, k // 256), np.float32)
    bsums = np.empty((tokens, k // 16), np.int32)
    flat = x.reshape(-1)
    for t in range(tokens):
        q8k_row(flat, t, k, xq, dx, bsums)
    return xq, dx, bsums


@njit(**JIT)
def q8k_plain(x):
    """The rows of ``x`` (T, K) as Q8_K, codes in order (T*K,) int8, with d (T*K/256,)
    float32 and 128 times the sum of each 32 codes (T*K/32,) int32."""
    tokens, k = x.shape
    xq, dx, bsums = q8k_rows(x)
    sums16 = bsums.reshape(-1)
    cx = np.empty(tokens * k // 32, np.int32)
    for i in range(tokens * k // 32):
        cx[i] = 128 * (sums16[2 * i] + sums16[2 * i + 1])
    return xq, dx.reshape(-1), cx


@njit(**INLINE)
def gemv_iq4xs(buf, offs, rows, x, simd, threads, out, outs_at, fmt):
    """As :func:`gemv_legacy`, for IQ4_XS weights, a row at a time."""
    tokens, k = x.shape
    nb = k // 256
    rb = nb * IQ4_XS_SIZE
    xq, dx, cx = q8k_plain(x)
    for c in prange(threads):
        for i in range(offs.shape[0]):
            r0, r1 = _chunk(rows[i], threads, c)
            for r in range(r0, r1):
                for t in range(tokens):
                    o = outs_at[i] + t * rows[i] + r
                    iq4xs_row(
                        buf, offs[i] + r * rb, nb, xq, t * k, cx, t * k // 32, dx, t * nb, out, o
                    )


@njit(**INLINE)
def _kquant_dot(raw, off, nb, xl, xo, bs, bo, yd, fmt):
    """:func:`kquant_row` of a format known when compiling."""
    if fmt == Q2_K:
        return kquant_row(raw, off, nb, xl, xo, bs, bo, yd, Q2_K)
    if fmt == Q3_K:
        return kquant_row(raw, off, nb, xl, xo, bs, bo, yd, Q3_K)
    if fmt == Q4_K:
        return kquant_row(raw, off, nb, xl, xo, bs, bo, yd, Q4_K)
    if fmt == Q5_K:
        return kquant_row(raw, off, nb, xl, xo, bs, bo, yd, Q5_K)
    return kquant_row(raw, off, nb, xl, xo, bs, bo, yd, Q6_K)


@njit(**JIT)
def q8_activations(x, simd, with_sum, centre):
    """The rows of ``x`` (T, K) as Q8_0 / Q8_1 (``with_sum``): int8 codes (T*K,), stored d
    and s (T, K/32) float32, and ``centre`` times each block's sum of codes (T, K/32)."""
    tokens, k = x.shape
    nb = k // 32
    qx = np.empty(tokens * k, np.int8)
    dx = np.empty((tokens, nb), np.float32)
    sx = np.zeros((tokens, nb), np.float32)
    cx = np.zeros((tokens, nb), np.int32)
    flat = x.reshape(-1)
    for t in range(tokens):
        q8_row(flat, t, k, simd, with_sum, qx, dx, sx)
        if centre:
            row = qx[t * k : (t + 1) * k]  # (K,)
            for b in range(nb):
                acc = np.int32(0)
                for j in range(32 * b, 32 * b + 32):
                    acc += np.int32(row[j])
                cx[t, b] = centre * acc
    return qx, dx, sx, cx


@njit(**JIT)
def q8k_activations(x):
    """The rows of ``x`` (T, K) as Q8_K, codes each 64 in :data:`LANE_ORDER` (T*K,) int8,
    with d (T, K/256) float32 and the sums of each 16 (T*K/16,) and of each 32 (T*K/32,)
    codes as int16 (at most 32 * 128 in magnitude)."""
    tokens, k = x.shape
    xq, dx, bsums = q8k_rows(x)
    xl = np.empty(tokens * k, np.int8)
    for c in range(0, tokens * k, 32):
        # LANE_ORDER's own loops, each half of 64: xl[4l + 2q + p] = xq[16q + 8p + l] (the
        # table's lookups took 1.1 us for 1536 codes, these loops 0.4)
        for q in range(2):
            for p in range(2):
                for lane in range(8):
                    xl[c + 4 * lane + 2 * q + p] = xq[c + 16 * q + 8 * p + lane]
    sums = bsums.reshape(-1)  # (T*K/16,)
    bs32 = np.empty(sums.shape[0] // 2, np.int16)
    for i in range(bs32.shape[0]):
        bs32[i] = sums[2 * i] + sums[2 * i + 1]
    return xl, dx, sums.astype(np.int16), bs32


@njit(**INLINE)
def _chunk(rows: int, parts: int, c: int) -> tuple[int, int]:
    return c * rows // parts, (c + 1) * rows // parts


@njit(**INLINE)
def _four_rows(buf, off, rb, nb, qx, xo, cx, yd, ys, out, o, fmt):
    """:func:`legacy_rows` of the 4 rows from byte ``off`` against one token: in one step,
    their integer sums reduced together, where decoding the codes is the work; one row after
    the other for Q8_0, whose bytes are its codes: its 4 interleaved rows streamed at
    0.64-0.75x the speed of single rows (a 1B file's products, 2 threads, AVX-512 and AVX2
    alike), while Q4_0, Q5_0, Q5_1 and IQ4_NL went 5-12% faster by four (Q4_1 alike within
    the noise). The same bits either way."""
    if fmt == Q8_0:
        for j in range(4):
            legacy_rows(buf, off + j * rb, rb, nb, qx, xo, cx, yd, ys, out, o + j, fmt, 1)
    else:
        legacy_rows(buf, off, rb, nb, qx, xo, cx, yd, ys, out, o, fmt, 4)


@njit(**INLINE)
def gemv_legacy(buf, offs, rows, x, simd, threads, out, outs_at, fmt):
    """``x @ W_i.T`` for a few tokens ``x`` (T, K) and the 32-block weights ``i`` at bytes
    ``offs[i]`` of ``buf`` (``rows[i]`` rows each): written row-major (T, rows[i]) to
    ``out[outs_at[i]:]``. Each thread takes a share of every weight's rows."""
    tokens, k = x.shape
    nb = k // 32
    rb = nb * SIZES[fmt]
    with_m = fmt == Q4_1 or fmt == Q5_1
    centre = 8 if fmt == Q4_0 else 16 if fmt == Q5_0 else 128 if fmt in (IQ4_NL, MXFP4) else 0
    centre = Q8_0_CENTRE if fmt == Q8_0 else centre
    qx, dx, sx, cx = q8_activations(x, simd, with_m, centre)
    for c in prange(threads):
        for i in range(offs.shape[0]):
            n, groups = rows[i], rows[i] // 4
            g0, g1 = _chunk(groups, threads, c)
            for r in range(4 * g0, 4 * g1, 4):
                for t in range(tokens):
                    o = outs_at[i] + t * n + r
                    _four_rows(
                        buf, offs[i] + r * rb, rb, nb, qx, t * k, cx[t], dx[t], sx[t], out, o, fmt
                    )
            if c == threads - 1:
                for r in range(4 * groups, n):
                    for t in range(tokens):
                        o = outs_at[i] + t * n + r
                        legacy_rows(
                            buf,
                            offs[i] + r * rb,
                            rb,
                            nb,
                            qx,
                            t * k,
                            cx[t],
                            dx[t],
                            sx[t],
                            out,
                            o,
                            fmt,
                            1,
                        )


@njit(**INLINE)
def gemv_kquant(buf, offs, rows, x, simd, threads, out, outs_at, fmt):
    """As :func:`gemv_legacy`, for K-quant weights."""
    tokens, k = x.shape
    nb = k // 256
    rb = nb * SIZES[fmt]
    xl, dx, bs16, bs32 = q8k_activations(x)
    bs = bs16 if fmt == Q2_K else bs32
    per = k // 16 if fmt == Q2_K else k // 32
    for c in prange(threads):
        for i in range(offs.shape[0]):
            r0, r1 = _chunk(rows[i], threads, c)
            for r in range(r0, r1):
                for t in range(tokens):
                    o = outs_at[i] + t * rows[i] + r
                    out[o] = _kquant_dot(
                        buf, offs[i] + r * rb, nb, xl, t * k, bs, t * per, dx[t], fmt
                    )


def _kernel(fmt: int, parallel: bool) -> Any:
    """The driver for one format, the format a constant (every branch on it folded away).
    The drivers are named as globals, not held in the closure: numba caches a closure over
    ints and bools, not over a dispatcher."""
    legacy, iq4 = fmt in BLOCKS32, fmt == IQ4_XS

    def kernel(buf, offs, rows, x, simd, threads, out, outs_at):
        if legacy:
            gemv_legacy(buf, offs, rows, x, simd, threads, out, outs_at, fmt)
        elif iq4:
            gemv_iq4xs(buf, offs, rows, x, simd, threads, out, outs_at, fmt)
        else:
            gemv_kquant(buf, offs, rows, x, simd, threads, out, outs_at, fmt)

    return named_kernel(kernel, "gemv", fmt, parallel)


# format id -> (parallel, serial) compiled kernels:
# ``kernel(buf, offs, rows, x, simd, threads, out, outs_at)``
KERNELS = {fmt: (_kernel(fmt, True), _kernel(fmt, False)) for fmt in (*BLOCKS32, *KQUANTS, IQ4_XS)}
