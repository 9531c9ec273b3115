"""Kernels for many tokens (prefill, teacher forcing): each weight block decoded once for
tiles of 16 tokens, held in the vector lanes, with every integer accumulator in a register.

The activations are laid out once per matmul with the tokens side by side (16 a vector);
a weight block's codes are decoded into a small stack buffer and each 32-bit group of them
broadcast from it against the 16 tokens' matching group, so that no horizontal sum is
needed (:func:`legacy_tile`, :func:`kquant_tiles`):

* **32-blocks**, 4 rows x 16 tokens: the stored codes (unsigned) times the tokens' int8
  codes, four products a lane (``vpdpbusd``); minus the centre times the block sums, then
  per row ``(d*y.d)*isum`` (``(isum*d)*y.d`` for Q4_0, ``+ m*y.s`` for the _1 types) added to
  the row's 16 running sums, block after block.
* **K-quants**, 2 rows x 16 tokens x up to :data:`MAX_TILES` tiles: each super-block is
  decoded once for all the tiles of a call: its codes in the order of
  :data:`qllama.backends.numpy.kernels.gemv.LANE_ORDER`, where each 4 bytes are one of ggml's 8
  lanes of one 32-sub-block, and the int16 scale of each pair of them. Each token's 4 activation
  bytes times the 4 codes in pairs (``vpmaddubsw``, exact in int16), times the pair's scales into
  the lane's int32 sum (``vpdpwssd``): unsigned codes against the signed Q8_K codes, or, for Q3_K
  and Q6_K (signed codes), the codes against the activations plus 128 with each lane started at
  minus the 128 times its scaled codes that adds. The 8 lane sums are scaled by ``d*y.d`` into 8
  float32 accumulators, the mins term subtracted from a ninth, kept per tile in a stack buffer from
  one super-block to the next, and the lanes added at the end in order.

The float32 operations per (row, token) are those of ggml's generic C, in its order, as in
:mod:`~qllama.backends.numpy.kernels.gemv`: the results are the same bits
(``tests/test_cpu_kernels.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core.cgutils import alloca_once
from numba.extending import intrinsic

from qllama.backends.numpy.kernels.gemv import (
    CENTRE,
    D_AT,
    LANE_ORDER,
    QS_AT,
    SIZES,
    TYPE_SIZE,
    WITH_M,
    WITH_MINS,
    _chunk,
    _scale_lanes,
    _scales,
    _stored_codes,
    nibble_codes4,
)
from qllama.backends.numpy.kernels.llvm_ir import (
    AVX512,
    F32,
    I1,
    I8,
    I16,
    I32,
    I64,
    PAIRS,
    broadcast,
    byte_ptr,
    consts,
    counted_loop,
    data_ptr,
    declare,
    dot4_into,
    halves,
    i64,
    load,
    opaque,
    pair_dots,
    pick,
    quads,
    quads_zero,
    scaled_pairs,
    shuffle,
    splat,
    store,
    vec,
)
from qllama.backends.numpy.kernels.quantize import q8_row, q8k_row
from qllama.backends.numpy.kernels.simd import (
    KQUANTS,
    LEGACY,
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
    VNNI,
    _kquant_run,
    _literal,
    tune,
)
from qllama.jit import INLINE, named_kernel

TILE = 16  # tokens a vector
# The K-quant tile's 8 lane sums of 2 rows are 16 vectors of 16 int32: registers with AVX-512's
# 32, but with 16 (AVX2: each such vector is 2 of them) they are spilled and reloaded at every
# step, so there the tile sums one lane at a time and adds it into its float lane at once.
LANES_OUTER = not AVX512
# The 32-block tile's products on AVX2 without VNNI (PAIRS), for stored codes below 32: each
# 2 adjacent bytes by vpmaddubsw into int16 (exact below 2 * 31 * 128), those pair sums added
# in int16 over a run of groups of 4 bytes, then their quads by vpmaddwd with ones: one
# multiply per group where dot4_into takes two. A run is as long as int16 holds:
# 8 * 2 * 15 * 128 and 4 * 2 * 31 * 128 are below 2**15. Q8_0's codes (to 255) go by dot4_into.
RUNS = {Q4_0: 8, Q4_1: 8, Q5_0: 4, Q5_1: 4}


# --- IR pieces ---------------------------------------------------------------------------------


def _dot_pairs(builder: ir.IRBuilder, acc: Any, a: Any, b: Any) -> Any:
    """``acc`` (<16 x i32>) plus the sums of each 2 adjacent int16 products of ``a`` and
    ``b`` (<16 x i32> holding 32 int16 each; ``vpdpwssd``, kept whole by
    :func:`~qllama.backends.numpy.kernels.simd.tune`): exact."""
    if VNNI:
        fn = declare(builder, "llvm.x86.avx512.vpdpwssd.512", vec(I32, 16), [vec(I32, 16)] * 3)
        return builder.call(fn, [acc, a, b])
    a32, b32 = (builder.sext(builder.bitcast(v, vec(I16, 32)), vec(I32, 32)) for v in (a, b))
    prod = builder.mul(a32, b32)
    even, odd = (pick(builder, prod, list(range(c, 32, 2))) for c in range(2))
    return builder.add(acc, builder.add(even, odd))


def _scatter(builder: ir.IRBuilder, value: Any, base: Any, index: Any, stride: Any, n: Any) -> None:
    """``base[index + j*stride] = value[j]`` (float32) for the lanes ``j < n``."""
    idx = builder.add(
        broadcast(builder, index, TILE),
        builder.mul(broadcast(builder, stride, TILE), consts(I64, list(range(TILE)))),
    )
    gep = ir.instructions.GEPInstr(
        builder.block, builder.bitcast(base, F32.as_pointer()), [idx], False, "", source_etype=F32
    )
    gep.type = vec(F32.as_pointer(), TILE)
    builder._insert(gep)
    live = builder.icmp_signed("<", consts(I64, list(range(TILE))), broadcast(builder, n, TILE))
    fn = declare(
        builder,
        f"llvm.masked.scatter.v{TILE}f32.v{TILE}p0",
        ir.VoidType(),
        [vec(F32, TILE), vec(F32.as_pointer(), TILE), I32, vec(I1, TILE)],
    )
    builder.call(fn, [value, gep, ir.Constant(I32, 4), live])


def _tile_args(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> dict[str, Any]:
    """:func:`legacy_tile`'s arguments as IR values; ``xv``, ``acts``, ``dxt`` and
    ``sxt`` point at the tile's first block."""
    names = (
        "raw",
        "off",
        "rb",
        "nb",
        "xv",
        "tile",
        "acts",
        "dxt",
        "sxt",
        "out",
        "oo",
        "ostride",
        "nt",
    )
    values = dict(zip(names, args, strict=False))
    for name in ("raw", "xv", "acts", "dxt", "sxt", "out"):
        i = names.index(name)
        values[name] = data_ptr(context, builder, sig.args[i], args[i])
    return values


def _tile_start(builder: ir.IRBuilder, base: Any, a: dict[str, Any], per_block: int) -> Any:
    """Where tile ``a["tile"]`` starts in a tile-major array of ``per_block`` bytes a block."""
    return byte_ptr(builder, base, builder.mul(builder.mul(a["tile"], a["nb"]), i64(per_block)))


# --- 32-blocks ---------------------------------------------------------------------------------


@intrinsic(prefer_literal=True)
def legacy_tile(
    typingctx: Any,
    raw: Any,
    off: Any,
    rb: Any,
    nb: Any,
    xv: Any,
    tile: Any,
    cxt: Any,
    dxt: Any,
    sxt: Any,
    out: Any,
    oo: Any,
    ostride: Any,
    nt: Any,
    fmt: Any,
    n_rows: Any,
) -> Any:
    """``n_rows`` (1 or 4) weight rows of ``nb`` 32-blocks of ``fmt`` (the first at byte
    ``off`` of ``raw``, one every ``rb`` bytes) against the 16 tokens of tile ``tile`` of the
    tiled activations (:func:`q8_tiles`): codes ``xv``, and per block and token the centre
    times the block sum ``cxt`` (int32), d ``dxt`` and s ``sxt`` (float32). Writes row r's sum
    for the tile's token j to ``out[oo + j*ostride + r]`` for ``j < nt``."""
    f = _literal(fmt, LEGACY, "legacy_tile: fmt")
    n = _literal(n_rows, (1, 4), "legacy_tile: n_rows")
    if f is None or n is None:
        return None
    ts, centre = TYPE_SIZE[f], CENTRE.get(f, 0)
    run = RUNS.get(f, 0) if PAIRS else 0
    nibbles = n == 4 and f in QS_AT

    def group_at(r: int, g: int) -> int:
        """Byte offset of row r's elements 4g..4g+3 in the codes buffer."""
        if nibbles:
            return 64 * (g // 4) + 16 * r + 4 * (g % 4)
        return 32 * r + 4 * g

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        a = _tile_args(context, builder, sig, args)
        first = byte_ptr(builder, a["raw"], a["off"])
        rows = [byte_ptr(builder, first, builder.mul(a["rb"], i64(r))) for r in range(n)]
        buf = builder.bitcast(alloca_once(builder, ir.ArrayType(I8, 128)), I8.as_pointer())
        wbuf = opaque(builder, buf)  # read back by broadcast loads (see llvm_ir.opaque)
        xv = _tile_start(builder, a["xv"], a, 8 * 64)
        cxt, dxt, sxt = (_tile_start(builder, a[k], a, 64) for k in ("acts", "dxt", "sxt"))
        zero = ir.Constant(vec(F32, TILE), [ir.Constant(F32, 0.0)] * TILE)

        def block(b: Any, sums: list[Any]) -> list[Any]:
            if nibbles:
                lo, hi = nibble_codes4(builder, f, rows, b)
                store(builder, lo, buf, 0)
                store(builder, hi, buf, 64)
            else:
                for r in range(n):
                    p = byte_ptr(builder, rows[r], builder.mul(b, i64(ts)))
                    store(builder, _stored_codes(builder, f, p), buf, 32 * r)
            ints = [splat(I32, 16, 0) if run else quads_zero()] * n
            pairs: list[Any] = [None] * n
            xb = byte_ptr(builder, xv, builder.mul(b, i64(8 * 64)))
            for g in range(8):
                xs = load(builder, xb, 64 * g, vec(I8, 64))
                for r in range(n):
                    w = broadcast(builder, load(builder, wbuf, group_at(r, g), I32), 16)
                    w = builder.bitcast(w, vec(I8, 64))
                    if not run:
                        ints[r] = dot4_into(builder, ints[r], w, xs)
                        continue
                    # int16 pair sums of `run` groups, then their quads (exact: see RUNS)
                    dots = pair_dots(builder, w, xs)
                    pairs[r] = dots if g % run == 0 else builder.add(pairs[r], dots)
                    if g % run == run - 1:
                        quad = scaled_pairs(builder, pairs[r], splat(I16, 32, 1))
                        ints[r] = builder.add(ints[r], quad)
            ints = [quads(builder, v) for v in ints]
            at = builder.mul(b, i64(64))
            yd = load(builder, dxt, at, vec(F32, TILE))
            cx = load(builder, cxt, at, vec(I32, TILE)) if centre else None
            ys = load(builder, sxt, at, vec(F32, TILE)) if f in WITH_M else None
            new = []
            for r in range(n):
                p = byte_ptr(builder, rows[r], builder.mul(b, i64(ts)))
                isum = builder.sub(ints[r], cx) if centre else ints[r]
                fi = builder.sitofp(isum, vec(F32, TILE))
                dm = halves(builder, load(builder, p, 0, vec(I16, 2)))  # d, and m for _1
                d = broadcast(builder, builder.extract_element(dm, ir.Constant(I32, 0)), TILE)
                if f == Q4_0:
                    term = builder.fmul(builder.fmul(fi, d), yd)
                else:
                    term = builder.fmul(builder.fmul(d, yd), fi)
                if f in WITH_M:
                    m = broadcast(builder, builder.extract_element(dm, ir.Constant(I32, 1)), TILE)
                    term = builder.fadd(term, builder.fmul(m, ys))
                new.append(builder.fadd(sums[r], term))
            return new

        sums = counted_loop(builder, i64(0), a["nb"], [zero] * n, block)
        for r in range(n):
            _scatter(
                builder, sums[r], a["out"], builder.add(a["oo"], i64(r)), a["ostride"], a["nt"]
            )
        return context.get_dummy_value()

    sig = types.none(raw, off, rb, nb, xv, tile, cxt, dxt, sxt, out, oo, ostride, nt, fmt, n_rows)
    return sig, codegen


# --- K-quants ----------------------------------------------------------------------------------


def _decode(builder: ir.IRBuilder, fmt: int, p: Any, codes: Any, scales: Any, r: int) -> Any:
    """Decode the super-block at ``p`` as weight row ``r`` of the tile: its codes, each 64 in
    :data:`LANE_ORDER`, to ``codes[256r:]`` (as stored, unsigned, where the format has no
    centre; signed, as ``integer_form``, for Q3_K and Q6_K), and the int16 scale of each pair
    of codes to ``scales[256r:]``. Returns the mins (<16 x i16>: Q2_K 16, Q4_K/Q5_K 8 then
    zeros; None without) and, for the signed codes, each of the 8 lanes' ``128 * sum(scale *
    code)`` (<8 x i32>), which the unsigned activations ``y + 128`` add (else None)."""
    perm = [int(e) for e in LANE_ORDER]
    sc, mins = _scales(builder, fmt, p)
    excess = None
    for c in range(4):
        a, e = (_kquant_run(builder, fmt, p, 2 * c + j) for j in (0, 1))
        q = shuffle(builder, a, e, perm)
        s = _scale_lanes(builder, fmt, sc, c)
        store(builder, q, codes, 256 * r + 64 * c)
        store(builder, s, scales, 256 * r + 64 * c)
        if fmt in CENTRE:  # word m: 128 * the scaled codes of 4m .. 4m+3, lane m % 8
            part = scaled_pairs(builder, pair_dots(builder, splat(I8, 64, -128), q), s)
            excess = part if excess is None else builder.add(excess, part)
    if excess is not None:
        excess = builder.add(pick(builder, excess, range(8)), pick(builder, excess, range(8, 16)))
    return mins, excess


MAX_TILES = 16  # tiles a call of kquant_tiles takes: each decoded super-block serves them all


@intrinsic(prefer_literal=True)
def kquant_tiles(
    typingctx: Any,
    raw: Any,
    off: Any,
    rb: Any,
    nb: Any,
    xq: Any,
    tile0: Any,
    tiles: Any,
    bsw: Any,
    dxt: Any,
    tokens: Any,
    out: Any,
    oo: Any,
    ostride: Any,
    fmt: Any,
    n_rows: Any,
) -> Any:
    """``n_rows`` (1 or 2) weight rows of ``nb`` super-blocks of K-quant ``fmt`` (the first
    at byte ``off`` of ``raw``, one every ``rb`` bytes) against the ``tiles`` (at most
    :data:`MAX_TILES`) tiles of 16 tokens from ``tile0`` of the tiled Q8_K activations
    (:func:`q8k_tiles`) of ``tokens`` tokens: codes ``xq`` (each 4 of a token one lane of
    one 32-sub-block; plus 128 for Q3_K and Q6_K), the sums for the mins ``bsw`` (int16
    pairs: Q2_K the 8 pairs of sums of 16, Q4_K/Q5_K the 4 pairs of sums of 32) and d
    ``dxt`` (float32). Each super-block is decoded once for all the tiles. Writes row r's
    sum for token t to ``out[oo + t*ostride + r]``."""
    f = _literal(fmt, KQUANTS, "kquant_tiles: fmt")
    n = _literal(n_rows, (1, 2), "kquant_tiles: n_rows")
    if f is None or n is None:
        return None
    ts = TYPE_SIZE[f]
    n_pairs = 8 if f == Q2_K else 4  # pairs of mins
    signed = f in CENTRE  # signed codes against unsigned activations
    width = 9 * n  # float32 vectors of state a tile: per row its total and 8 lanes

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        raw, off, rb, nb, xq, tile0, tiles, bsw, dxt, tokens, out, oo, ostride = args[:13]
        raw, xq, bsw, dxt, out = (
            data_ptr(context, builder, sig.args[i], args[i]) for i in (0, 4, 7, 8, 10)
        )
        first = byte_ptr(builder, raw, off)
        rows = [byte_ptr(builder, first, builder.mul(rb, i64(r))) for r in range(n)]
        bufs = [alloca_once(builder, ir.ArrayType(I8, size * n)) for size in (256, 256, 32)]
        cbuf, sbuf, mbuf = (builder.bitcast(b, I8.as_pointer()) for b in bufs)
        scales, mins_buf = (opaque(builder, b) for b in (sbuf, mbuf))
        n_tiles = builder.sdiv(builder.add(tokens, i64(TILE - 1)), i64(TILE))
        state_ty = ir.ArrayType(I8, 64 * width * MAX_TILES)
        state = builder.bitcast(alloca_once(builder, state_ty), I8.as_pointer())
        zero = ir.Constant(vec(F32, TILE), [ir.Constant(F32, 0.0)] * TILE)

        def at_state(p: Any, j: int) -> Any:
            """Where tile p's state vector j is."""
            return builder.add(builder.mul(p, i64(64 * width)), i64(64 * j))

        def clear(p: Any, carried: list[Any]) -> list[Any]:
            for j in range(width):
                store(builder, zero, state, at_state(p, j))
            return []

        counted_loop(builder, i64(0), tiles, [], clear)

        def super_block(b: Any, carried: list[Any]) -> list[Any]:
            ps = [byte_ptr(builder, rows[r], builder.mul(b, i64(ts))) for r in range(n)]
            start = []
            for r in range(n):
                mins, excess = _decode(builder, f, ps[r], cbuf, sbuf, r)
                if mins is not None:
                    store(builder, mins, mbuf, 32 * r)
                if excess is None:
                    start.append([splat(I32, 16, 0)] * 8)
                else:  # start each lane at minus what y + 128 adds
                    lanes = (builder.extract_element(excess, ir.Constant(I32, j)) for j in range(8))
                    start.append([broadcast(builder, builder.neg(e), 16) for e in lanes])
            d2 = [halves(builder, load(builder, p, D_AT[f], vec(I16, 2))) for p in ps]  # d, dmin
            ds = [
                [
                    broadcast(builder, builder.extract_element(h, ir.Constant(I32, j)), TILE)
                    for j in (0, 1)
                ]
                for h in d2
            ]

            def tile(p: Any, carried: list[Any]) -> list[Any]:
                at = builder.add(builder.mul(b, n_tiles), builder.add(tile0, p))  # block-major
                xb = byte_ptr(builder, xq, builder.mul(at, i64(64 * 64)))
                # broadcast here, not hoisted out of the tile loop and spilled
                codes = opaque(builder, cbuf, True)
                scale_at = opaque(builder, sbuf, True) if LANES_OUTER else scales

                def pair_scales(c: int, h: int) -> list[Any]:
                    """Each row's scale pair for all 8 lanes of chunk c's half h (see
                    LANE_ORDER)."""
                    return [
                        broadcast(
                            builder, load(builder, scale_at, 256 * r + 64 * c + 32 * h, I32), 16
                        )
                        for r in range(n)
                    ]

                def step(ints: list[Any], c: int, h: int, lane: int, sc: list[Any]) -> list[Any]:
                    """Each row's lane sum plus the 4 bytes of each token in lane ``lane``
                    of chunk c's half h (one lane of a 32-sub-block) times the row's codes."""
                    xs = load(builder, xb, 64 * (16 * c + 8 * h + lane), vec(I8, 64))
                    new = []
                    for r in range(n):
                        w = load(builder, codes, 256 * r + 64 * c + 32 * h + 4 * lane, I32)
                        w = builder.bitcast(broadcast(builder, w, 16), vec(I8, 64))
                        pairs = pair_dots(builder, xs, w) if signed else pair_dots(builder, w, xs)
                        pairs = builder.bitcast(pairs, vec(I32, 16))
                        new.append(_dot_pairs(builder, ints[r], pairs, sc[r]))
                    return new

                yd = load(builder, dxt, builder.mul(at, i64(64)), vec(F32, TILE))
                mterms: list[Any] = []
                if f in WITH_MINS:
                    bb = byte_ptr(builder, bsw, builder.mul(at, i64(n_pairs * 64)))
                    for r in range(n):
                        msum = splat(I32, 16, 0)
                        for q in range(n_pairs):
                            bs = load(builder, bb, 64 * q, vec(I32, 16))
                            mn = broadcast(
                                builder, load(builder, mins_buf, 32 * r + 4 * q, I32), 16
                            )
                            msum = _dot_pairs(builder, msum, bs, mn)
                        dmin = ds[r][1]
                        msum_f = builder.sitofp(msum, vec(F32, TILE))
                        mterms.append(builder.fmul(builder.fmul(dmin, yd), msum_f))
                dd = [builder.fmul(ds[r][0], yd) for r in range(n)]
                halves_in_order = [(c, h) for c in range(4) for h in range(2)]
                if LANES_OUTER:  # one lane at a time: 2 int accumulators a row
                    lane_sums: list[list[Any]] = [[] for _ in range(n)]
                    for lane in range(8):
                        ints = [start[r][lane] for r in range(n)]
                        for c, h in halves_in_order:
                            ints = step(ints, c, h, lane, pair_scales(c, h))
                        for r in range(n):
                            if f == Q2_K:  # one sum per block, added up as it goes
                                sums = lane_sums[r]
                                lane_sums[r] = [builder.add(sums[0], ints[r]) if sums else ints[r]]
                            else:  # into its float lane now: fewer live registers
                                w = at_state(p, 9 * r + 1 + lane)
                                acc = load(builder, state, w, vec(F32, TILE))
                                fi = builder.sitofp(ints[r], vec(F32, TILE))
                                store(builder, builder.fadd(acc, builder.fmul(fi, dd[r])), state, w)
                else:  # every lane at once: 8 int accumulators a row, each scale loaded once
                    lane_sums = [list(s) for s in start]
                    for c, h in halves_in_order:
                        sc = pair_scales(c, h)
                        for lane in range(8):
                            now = [lane_sums[r][lane] for r in range(n)]
                            for r, v in enumerate(step(now, c, h, lane, sc)):
                                lane_sums[r][lane] = v
                for r in range(n):
                    where = [at_state(p, 9 * r + j) for j in range(9)]
                    total = load(builder, state, where[0], vec(F32, TILE))
                    if f == Q2_K:  # one sum per block
                        isum = lane_sums[r][0]
                        for more in lane_sums[r][1:]:
                            isum = builder.add(isum, more)
                        fi = builder.sitofp(isum, vec(F32, TILE))
                        total = builder.fadd(
                            total, builder.fsub(builder.fmul(dd[r], fi), mterms[r])
                        )
                    else:
                        if not LANES_OUTER:
                            for lane in range(8):
                                acc = load(builder, state, where[1 + lane], vec(F32, TILE))
                                fi = builder.sitofp(lane_sums[r][lane], vec(F32, TILE))
                                acc = builder.fadd(acc, builder.fmul(fi, dd[r]))
                                store(builder, acc, state, where[1 + lane])
                        if f in WITH_MINS:
                            total = builder.fsub(total, mterms[r])
                    store(builder, total, state, where[0])
                return []

            counted_loop(builder, i64(0), tiles, [], tile)
            return []

        counted_loop(builder, i64(0), nb, [], super_block)

        def write(p: Any, carried: list[Any]) -> list[Any]:
            t0 = builder.mul(builder.add(tile0, p), i64(TILE))
            left = builder.sub(tokens, t0)
            nt = builder.select(builder.icmp_signed("<", left, i64(TILE)), left, i64(TILE))
            o = builder.add(oo, builder.mul(t0, ostride))
            for r in range(n):
                total = load(builder, state, at_state(p, 9 * r), vec(F32, TILE))
                if f != Q2_K:
                    for j in range(1, 9):
                        total = builder.fadd(
                            total, load(builder, state, at_state(p, 9 * r + j), vec(F32, TILE))
                        )
                _scatter(builder, total, out, builder.add(o, i64(r)), ostride, nt)
            return []

        counted_loop(builder, i64(0), tiles, [], write)
        return context.get_dummy_value()

    sig = types.none(
        raw, off, rb, nb, xq, tile0, tiles, bsw, dxt, tokens, out, oo, ostride, fmt, n_rows
    )
    return sig, codegen


# --- activations, tiled ------------------------------------------------------------------------


@njit(**INLINE)
def q8_tiles(x, simd, with_sum, centre):
    """The rows of ``x`` (T, K) as Q8_0 / Q8_1, tiled for :func:`legacy_tile`: codes ``xv``
    (int8), and per block and token ``centre`` times the block sum (int32), d and s
    (float32), ``tpad`` (T rounded up to 16) tokens a block; the padding is zeros."""
    tokens, k = x.shape
    nb = k // 32
    tpad = (tokens + TILE - 1) // TILE * TILE
    qx = np.empty(tokens * k, np.int8)
    dx = np.empty((tokens, nb), np.float32)
    sx = np.zeros((tokens, nb), np.float32)
    flat = x.reshape(-1)
    xv = np.zeros(nb * 8 * tpad * 4, np.int8)
    cxt = np.zeros(nb * tpad, np.int32)
    dxt = np.zeros(nb * tpad, np.float32)
    sxt = np.zeros(nb * tpad, np.float32)
    for t in prange(tokens):
        q8_row(flat, t, k, simd, with_sum, qx, dx, sx)
        tile, j = t // TILE, t % TILE
        for b in range(nb):
            at = tile * nb + b  # tile-major: a tile's blocks one after the other
            acc = 0
            for g in range(8):
                o = ((at * 8 + g) * TILE + j) * 4
                for c in range(4):
                    v = qx[t * k + b * 32 + 4 * g + c]
                    xv[o + c] = v
                    acc += v
            cxt[at * TILE + j] = centre * acc
            dxt[at * TILE + j] = dx[t, b]
            sxt[at * TILE + j] = sx[t, b]
    return xv, cxt, dxt, sxt, tpad


@njit(**INLINE)
def q8k_tiles(x, pairs_of_32, plus_128):
    """The rows of ``x`` (T, K) as Q8_K, tiled for :func:`kquant_tiles`: codes ``xq`` (int8;
    the bytes of ``y + 128`` with ``plus_128``), each 4 of a token one lane of one
    32-sub-block (:data:`LANE_ORDER`), the mins' sums ``bsw`` (pairs of the sums of 32 with
    ``pairs_of_32``, else of 16) and d ``dxt`` (float32), super-block-major (a super-block's
    tiles one after the other, as :func:`kquant_tiles` reads them), ``tpad`` tokens a
    super-block; the padding is zeros."""
    tokens, k = x.shape
    nb = k // 256
    tpad = (tokens + TILE - 1) // TILE * TILE
    tiles = tpad // TILE
    xs = np.empty(tokens * k, np.int8)
    dx = np.empty((tokens, nb), np.float32)
    bsums = np.empty((tokens, k // 16), np.int32)
    flat = x.reshape(-1)
    xq = np.zeros(nb * 64 * tpad * 4, np.int8)
    n_pairs = 4 if pairs_of_32 else 8
    bsw = np.zeros(nb * n_pairs * tpad * 2, np.int16)
    dxt = np.zeros(nb * tpad, np.float32)
    flip = np.int8(-128) if plus_128 else np.int8(0)  # x ^ 0x80 is x + 128 as unsigned
    for t in prange(tokens):
        q8k_row(flat, t, k, xs, dx, bsums)
        tile, i = t // TILE, t % TILE
        for b in range(nb):
            at = b * tiles + tile  # block-major: a super-block's tiles one after the other
            for g in range(64):
                base = t * k + b * 256 + 64 * (g // 16)
                o = ((at * 64 + g) * TILE + i) * 4
                for e in range(4):
                    xq[o + e] = xs[base + LANE_ORDER[4 * (g % 16) + e]] ^ flip
            for q in range(n_pairs):
                o = ((at * n_pairs + q) * TILE + i) * 2
                for h in range(2):
                    if pairs_of_32:
                        s = b * 16 + 4 * q + 2 * h
                        bsw[o + h] = bsums[t, s] + bsums[t, s + 1]
                    else:
                        bsw[o + h] = bsums[t, b * 16 + 2 * q + h]
            dxt[at * TILE + i] = dx[t, b]
    return xq, bsw, dxt, tpad


# --- drivers -----------------------------------------------------------------------------------

L2_TILES = 1 << 21  # bytes of tiled activations a thread sweeps per pass over its rows


@njit(**INLINE)
def gemm_legacy(buf, offs, rows, x, simd, threads, out, outs_at, fmt):
    """``x @ W_i.T`` for many tokens ``x`` (T, K) and the 32-block weights ``i`` at bytes
    ``offs[i]`` of ``buf`` (``rows[i]`` rows each): written row-major (T, rows[i]) to
    ``out[outs_at[i]:]``. Each thread takes a share of every weight's rows; each group of 4
    rows meets the tokens a tile of 16 at a time, as many tiles as keep their activations in
    the core's cache, then the next tiles."""
    tokens, k = x.shape
    nb = k // 32
    rb = nb * SIZES[fmt]
    with_m = fmt == Q4_1 or fmt == Q5_1
    centre = 8 if fmt == Q4_0 else 16 if fmt == Q5_0 else 128 if fmt == Q8_0 else 0
    xv, cxt, dxt, sxt, tpad = q8_tiles(x, simd, with_m, centre)
    tiles = tpad // TILE
    per_pass = max(1, L2_TILES // (k * TILE))
    for c in prange(threads):
        for p0 in range(0, tiles, per_pass):
            p1 = min(tiles, p0 + per_pass)
            for i in range(offs.shape[0]):
                n, groups = rows[i], rows[i] // 4
                g0, g1 = _chunk(groups, threads, c)
                last = n if c == threads - 1 else 4 * g1
                for r in range(4 * g0, last, 4):
                    for tt in range(p0, p1):
                        t0 = tt * TILE
                        nt = min(TILE, tokens - t0)
                        o = outs_at[i] + t0 * n + r
                        if r + 4 <= n:
                            legacy_tile(
                                buf,
                                offs[i] + r * rb,
                                rb,
                                nb,
                                xv,
                                tt,
                                cxt,
                                dxt,
                                sxt,
                                out,
                                o,
                                n,
                                nt,
                                fmt,
                                4,
                            )
                        else:
                            for j in range(n - r):
                                legacy_tile(
                                    buf,
                                    offs[i] + (r + j) * rb,
                                    rb,
                                    nb,
                                    xv,
                                    tt,
                                    cxt,
                                    dxt,
                                    sxt,
                                    out,
                                    o + j,
                                    n,
                                    nt,
                                    fmt,
                                    1,
                                )


@njit(**INLINE)
def gemm_kquant(buf, offs, rows, x, simd, threads, out, outs_at, fmt):
    """As :func:`gemm_legacy`, for K-quant weights: each pair of rows meets the tiles of a
    pass :data:`MAX_TILES` at a time, every super-block decoded once for them."""
    tokens, k = x.shape
    nb = k // 256
    rb = nb * SIZES[fmt]
    xq, bsw, dxt, tpad = q8k_tiles(x, fmt == Q4_K or fmt == Q5_K, fmt == Q3_K or fmt == Q6_K)
    tiles = tpad // TILE
    per_pass = max(1, L2_TILES // (k * TILE))
    for c in prange(threads):
        for p0 in range(0, tiles, per_pass):
            p1 = min(tiles, p0 + per_pass)
            for i in range(offs.shape[0]):
                n, pairs = rows[i], rows[i] // 2
                g0, g1 = _chunk(pairs, threads, c)
                last = n if c == threads - 1 else 2 * g1
                for r in range(2 * g0, last, 2):
                    w, o = offs[i] + r * rb, outs_at[i] + r
                    for q0 in range(p0, p1, MAX_TILES):
                        m = min(p1 - q0, MAX_TILES)
                        if r + 2 <= n:
                            kquant_tiles(
                                buf, w, rb, nb, xq, q0, m, bsw, dxt, tokens, out, o, n, fmt, 2
                            )
                        else:
                            kquant_tiles(
                                buf, w, rb, nb, xq, q0, m, bsw, dxt, tokens, out, o, n, fmt, 1
                            )


def _kernel(fmt: int, parallel: bool) -> Any:
    """The driver for one format, the format a constant (every branch on it folded away).
    The drivers are named as globals, not held in the closure: numba caches a closure over
    ints and bools, not over a dispatcher."""
    legacy = fmt in LEGACY

    def kernel(buf, offs, rows, x, simd, threads, out, outs_at):
        if legacy:
            gemm_legacy(buf, offs, rows, x, simd, threads, out, outs_at, fmt)
        else:
            gemm_kquant(buf, offs, rows, x, simd, threads, out, outs_at, fmt)

    return named_kernel(kernel, "gemm", fmt, parallel)


# format id -> (parallel, serial) compiled kernels:
# ``kernel(buf, offs, rows, x, simd, threads, out, outs_at)``
KERNELS = {fmt: (_kernel(fmt, True), _kernel(fmt, False)) for fmt in LEGACY + KQUANTS}
