"""LLVM IR building blocks of the streaming CPU kernels (:mod:`~qllama.backends.numpy.kernels.gemv`,
:mod:`~qllama.backends.numpy.kernels.gemm`): loops, gathers, the integer dot-product steps,
conversions.

:mod:`qllama.backends.numpy.kernels.simd` states single vector operations as numba intrinsics; the
streaming kernels go one step further and state a whole loop over a weight row in IR, so
that every accumulator stays in a register from the first block to the last (numba would
store each intrinsic's result to memory and load it back). These helpers emit IR into the
builder of such an intrinsic:

* :func:`counted_loop`: ``for i in range(start, stop, step)`` with loop-carried values;
* :func:`gather_dwords`: 16 little-endian 32-bit words at 16 byte offsets (``vpgatherdd``);
* :func:`dot4` (:func:`dot4_into` and :func:`quads` to sum many), :func:`pair_dots`,
  :func:`scaled_pairs`: exact integer products, summed four
  (``vpdpbusd``; on AVX2 ``vpmaddwd`` on the bytes widened to int16, then the pairs added)
  or two at a time (``vpmaddubsw``, then ``vpmaddwd`` with integer scales);
* :func:`halves`: fp16 bit patterns widened to float32, exactly.

Each step uses the x86 instruction where the host has it and portable IR otherwise (LLVM
picks the host's instructions for it); both give the same integers. Every float32 operation
the kernels emit is a plain ``fadd``/``fmul``/``sitofp`` without fast-math flags, so LLVM
keeps the order and the roundings written, as C compiled without ``-ffp-contract``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from llvmlite import ir

from qllama.backends.numpy.kernels.simd import _FEATURES, HALF, VNNI, _widen_half_bits

I1, I8, I16, I32, I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
F32 = ir.FloatType()

AVX512 = bool(_FEATURES.get("avx512f") and _FEATURES.get("avx512bw"))
# AVX2 has them on 256 bits. LLVM forms vpmaddwd from the portable IR below, but not the
# saturating vpmaddubsw (portable IR cannot say it saturates), which is called by name
AVX2 = bool(_FEATURES.get("avx2"))
# byte permutes across a 512-bit vector (vpermb, vpermt2b); without them LLVM spells them out
VBMI = bool(_FEATURES.get("avx512vbmi"))


def vec(elem: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(elem, n)


def splat(elem: ir.IntType, n: int, value: int) -> ir.Constant:
    return ir.Constant(vec(elem, n), [ir.Constant(elem, value)] * n)


def consts(elem: ir.Type, values: Sequence[Any]) -> ir.Constant:
    return ir.Constant(vec(elem, len(values)), [ir.Constant(elem, v) for v in values])


def i64(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


def shuffle(builder: ir.IRBuilder, a: Any, b: Any, mask: Sequence[int]) -> Any:
    return builder.shuffle_vector(a, b, consts(I32, mask))


def pick(builder: ir.IRBuilder, v: Any, mask: Sequence[int]) -> Any:
    """Lanes ``mask`` of one vector."""
    return shuffle(builder, v, v, mask)


def broadcast(builder: ir.IRBuilder, x: Any, n: int) -> Any:
    """A scalar in all ``n`` lanes of a vector."""
    one = builder.insert_element(ir.Constant(vec(x.type, n), None), x, ir.Constant(I32, 0))
    return pick(builder, one, [0] * n)


def data_ptr(context: Any, builder: ir.IRBuilder, arrty: Any, arr: Any) -> Any:
    """The first element's address of a numba array, as ``i8*``."""
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.bitcast(data, I8.as_pointer())


def byte_ptr(builder: ir.IRBuilder, base: Any, off: Any) -> Any:
    """``base`` (``i8*``) plus ``off`` bytes (an i64 value or a Python int)."""
    return builder.gep(base, [i64(off) if isinstance(off, int) else off])


def load(builder: ir.IRBuilder, base: Any, off: Any, ty: ir.Type) -> Any:
    """Load ``ty`` at ``base`` + ``off`` bytes, any alignment."""
    return builder.load(builder.bitcast(byte_ptr(builder, base, off), ty.as_pointer()), align=1)


def store(builder: ir.IRBuilder, value: Any, base: Any, off: Any) -> None:
    """Store ``value`` at ``base`` + ``off`` bytes, any alignment."""
    ptr = builder.bitcast(byte_ptr(builder, base, off), value.type.as_pointer())
    builder.store(value, ptr, align=1)


def opaque(builder: ir.IRBuilder, ptr: Any, here: bool = False) -> Any:
    """``ptr``, hidden from the optimizer (an empty inline asm returns it). Loads through it
    are then real loads: LLVM would otherwise forward a buffer's stored vector into the
    loads that broadcast its 32-bit groups, as register shuffles on the one shuffle port,
    where a broadcast from memory costs a load. With ``here`` the asm stays where it is
    emitted, so that loads through it in a loop are not hoisted out of the loop either."""
    fnty = ir.FunctionType(ptr.type, [ptr.type])
    return builder.asm(fnty, "", "=r,0", [ptr], here)


def declare(builder: ir.IRBuilder, name: str, ret: ir.Type, args: Sequence[ir.Type]) -> Any:
    """An LLVM intrinsic (or any external function) of the module, declared once."""
    fn = builder.module.globals.get(name)
    return fn or ir.Function(builder.module, ir.FunctionType(ret, list(args)), name)


def counted_loop(
    builder: ir.IRBuilder,
    start: Any,
    stop: Any,
    carried: Sequence[Any],
    body: Callable[[Any, list[Any]], list[Any]],
    step: int = 1,
) -> list[Any]:
    """``for i in range(start, stop, step)`` (i64 values), carrying ``carried`` from one
    iteration to the next: ``body(i, values)`` emits an iteration and returns the values for
    the next. Returns the values after the last iteration (``carried`` if there is none)."""
    entry = builder.block
    fn = builder.function
    head, loop, done = (fn.append_basic_block(n) for n in ("loop.head", "loop.body", "loop.end"))
    builder.branch(head)
    builder.position_at_end(head)
    i = builder.phi(I64)
    i.add_incoming(start, entry)
    phis = []
    for v in carried:
        p = builder.phi(v.type)
        p.add_incoming(v, entry)
        phis.append(p)
    builder.cbranch(builder.icmp_signed("<", i, stop), loop, done)
    builder.position_at_end(loop)
    new = body(i, list(phis))
    latch = builder.block
    i.add_incoming(builder.add(i, i64(step)), latch)
    for p, v in zip(phis, new, strict=True):
        p.add_incoming(v, latch)
    builder.branch(head)
    builder.position_at_end(done)
    return list(phis)


def blocks_loop(
    builder: ir.IRBuilder,
    n: Any,
    carried: Sequence[Any],
    steps: Callable[[int], Callable[[Any, list[Any]], list[Any]]],
    widths: Sequence[int],
) -> list[Any]:
    """The blocks ``0 .. n`` (an i64) in order, ``widths[0]`` a step while that many are left,
    then ``widths[1]``, ... (powers of 2, descending, the last 1): ``steps(w)`` is the body of
    a step of ``w`` blocks (:func:`counted_loop`'s), the values carried through all of them."""
    start, values = i64(0), list(carried)
    for w in widths:
        stop = n if w == 1 else builder.and_(n, i64(-w))
        values = counted_loop(builder, start, stop, values, steps(w), step=w)
        start = stop
    return values


def prefetch(builder: ir.IRBuilder, base: Any, off: Any) -> None:
    """Ask for the cache line at ``base`` + ``off`` bytes (``prefetcht0``; never faults)."""
    fn = declare(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    builder.call(fn, [byte_ptr(builder, base, off), *(ir.Constant(I32, v) for v in (0, 3, 1))])


def gather_dwords(builder: ir.IRBuilder, base: Any, offsets: Any) -> Any:
    """The little-endian 32-bit words at ``base`` + ``offsets[j]`` bytes: a list of ints, or
    an <n x i64> value; <n x i32> (``vpgatherdd`` where the host has AVX512; LLVM splits it
    into loads elsewhere)."""
    if isinstance(offsets, list | tuple):
        offsets = consts(I32, list(offsets))
    n = offsets.type.count
    if n == 1:
        off = builder.sext(builder.extract_element(offsets, ir.Constant(I32, 0)), I64)
        word = load(builder, base, off, I32)
        return builder.insert_element(ir.Constant(vec(I32, 1), None), word, ir.Constant(I32, 0))
    return gather(builder, base, offsets, I32)


def gather(builder: ir.IRBuilder, base: Any, offsets: Any, elem: ir.IntType) -> Any:
    """The little-endian ``elem`` words at ``base`` + ``offsets[j]`` bytes, ``offsets`` an
    <n x i32> value: <n x elem>, one masked gather (``vpgatherdd``/``vpgatherdq`` where the
    host has AVX512; LLVM splits it into loads elsewhere)."""
    n = offsets.type.count
    # a vector GEP of 32-bit offsets: one gather (64-bit ones would take two); llvmlite
    # types a GEP by its pointer only, so the vector result type is set here
    gep = ir.instructions.GEPInstr(builder.block, base, [offsets], False, "", source_etype=I8)
    gep.type = vec(I8.as_pointer(), n)
    builder._insert(gep)
    ptrs = builder.bitcast(gep, vec(elem.as_pointer(), n))
    bits = elem.width
    fn = declare(
        builder,
        f"llvm.masked.gather.v{n}i{bits}.v{n}p0",
        vec(elem, n),
        [vec(elem.as_pointer(), n), I32, vec(I1, n), vec(elem, n)],
    )
    every = ir.Constant(vec(I1, n), [ir.Constant(I1, 1)] * n)
    return builder.call(fn, [ptrs, ir.Constant(I32, 1), every, ir.Constant(vec(elem, n), None)])


def halves(builder: ir.IRBuilder, h: Any) -> Any:
    """fp16 bit patterns (<n x i16>, or one i16) widened to float32, exactly."""
    n = h.type.count if isinstance(h.type, ir.VectorType) else 0
    if HALF:
        half = vec(ir.HalfType(), n) if n else ir.HalfType()
        return builder.fpext(builder.bitcast(h, half), vec(F32, n) if n else F32)
    if not n:
        return _widen_half_bits(builder, h)
    lanes = [
        _widen_half_bits(builder, builder.extract_element(h, ir.Constant(I32, j))) for j in range(n)
    ]
    out = ir.Constant(vec(F32, n), None)
    for j, v in enumerate(lanes):
        out = builder.insert_element(out, v, ir.Constant(I32, j))
    return out


def _x86(builder: ir.IRBuilder, name: str, ret: ir.Type, *args: Any) -> Any:
    return builder.call(declare(builder, name, ret, [a.type for a in args]), list(args))


def _by_parts(
    builder: ir.IRBuilder, name: str, ret: ir.VectorType, width: int, a: Any, b: Any
) -> Any:
    """A 256-bit x86 instruction on each ``width`` lanes of ``a`` and ``b``, its results
    joined in order into one vector."""
    n = a.type.count
    outs = [
        _x86(builder, name, ret, *(pick(builder, v, list(range(i, i + width))) for v in (a, b)))
        for i in range(0, n, width)
    ]
    return joined(builder, outs)


def joined(builder: ir.IRBuilder, vecs: Sequence[Any]) -> Any:
    """Vectors of one type (a power of 2 of them) side by side in one, in order."""
    while len(vecs) > 1:
        m = vecs[0].type.count
        vecs = [
            shuffle(builder, x, y, list(range(2 * m)))
            for x, y in zip(vecs[::2], vecs[1::2], strict=True)
        ]
    return vecs[0]


# AVX2 without VNNI: an accumulator of dot4_into keeps the pair sums (vpmaddwd's), twice the
# lanes, and adds each pair to its neighbour once, when quads asks for the sums
PAIRS = AVX2 and not VNNI


def _pairs(builder: ir.IRBuilder, u: Any, s: Any) -> Any:
    """The sums of each 2 adjacent products of 64 unsigned bytes ``u`` by 64 signed bytes
    ``s``, <32 x i32> (``vpmaddwd`` on the bytes widened to int16: exact, unlike
    ``vpmaddubsw``, which saturates at 2 * 255 * 128)."""
    u16, s16 = builder.zext(u, vec(I16, 64)), builder.sext(s, vec(I16, 64))
    return _by_parts(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), 16, u16, s16)


def quads_zero() -> ir.Constant:
    """A zero accumulator for :func:`dot4_into`."""
    return splat(I32, 32 if PAIRS else 16, 0)


def dot4_into(builder: ir.IRBuilder, acc: Any, u: Any, s: Any) -> Any:
    """:func:`dot4` into an accumulator of :func:`quads_zero`, whose sums :func:`quads` gives:
    the same integers, with one step fewer a call on AVX2."""
    return builder.add(acc, _pairs(builder, u, s)) if PAIRS else dot4(builder, acc, u, s)


def quads(builder: ir.IRBuilder, acc: Any) -> Any:
    """The 16 quad sums (<16 x i32>) of an accumulator of :func:`dot4_into`."""
    if acc.type.count == 16:
        return acc
    even, odd = (pick(builder, acc, list(range(c, 32, 2))) for c in range(2))
    return builder.add(even, odd)


def dot4(builder: ir.IRBuilder, acc: Any, u: Any, s: Any) -> Any:
    """``acc`` (<16 x i32>) plus the sums of each 4 adjacent products of 64 unsigned bytes
    ``u`` by 64 signed bytes ``s`` (``vpdpbusd``): exact, at most 4 * 255 * 128 a lane."""
    if VNNI:
        v16 = vec(I32, 16)
        args = [acc, builder.bitcast(u, v16), builder.bitcast(s, v16)]
        return _x86(builder, "llvm.x86.avx512.vpdpbusd.512", v16, *args)
    if AVX2:
        return builder.add(acc, quads(builder, _pairs(builder, u, s)))
    prod = builder.mul(builder.zext(u, vec(I32, 64)), builder.sext(s, vec(I32, 64)))
    quads4 = [pick(builder, prod, list(range(c, 64, 4))) for c in range(4)]
    total = builder.add(builder.add(quads4[0], quads4[1]), builder.add(quads4[2], quads4[3]))
    return builder.add(acc, total)


def pair_dots(builder: ir.IRBuilder, u: Any, s: Any) -> Any:
    """The sums of each 2 adjacent products of 64 unsigned bytes ``u`` by 64 signed bytes
    ``s``, <32 x i16> (``vpmaddubsw``). The caller keeps ``2 * u * |s|`` within int16 (the
    instruction saturates), so that every sum is exact."""
    if AVX512:
        return _x86(builder, "llvm.x86.avx512.pmaddubs.w.512", vec(I16, 32), u, s)
    if AVX2:
        return _by_parts(builder, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), 32, u, s)
    prod = builder.mul(builder.zext(u, vec(I16, 64)), builder.sext(s, vec(I16, 64)))
    even, odd = (pick(builder, prod, list(range(c, 64, 2))) for c in range(2))
    return builder.add(even, odd)


def scaled_pairs(builder: ir.IRBuilder, p: Any, scales: Any) -> Any:
    """``p[2i] * scales[2i] + p[2i+1] * scales[2i+1]`` for 32 or 16 int16 lanes, half as
    many int32 (``vpmaddwd``): exact."""
    n = p.type.count
    if AVX512 and n == 32:
        return _x86(builder, "llvm.x86.avx512.pmaddw.d.512", vec(I32, 16), p, scales)
    if AVX2 and n % 16 == 0:
        return _by_parts(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), 16, p, scales)
    prod = builder.mul(builder.sext(p, vec(I32, n)), builder.sext(scales, vec(I32, n)))
    even, odd = (pick(builder, prod, list(range(c, n, 2))) for c in range(2))
    return builder.add(even, odd)


def small_dot4(builder: ir.IRBuilder, acc: Any, u: Any, s: Any) -> Any:
    """:func:`dot4` where every byte of ``u`` is below 128: on AVX2 without VNNI
    ``vpmaddubsw`` (exact: 2 * 127 * 128 < 2**15), then ``vpmaddwd`` by ones, 3 instructions
    for 32 bytes where :func:`dot4` takes 9 (it widens both operands to int16)."""
    if not PAIRS:
        return dot4(builder, acc, u, s)
    return builder.add(acc, scaled_pairs(builder, pair_dots(builder, u, s), splat(I16, 32, 1)))


def signed_dot4(builder: ir.IRBuilder, acc: Any, w: Any, s: Any) -> Any:
    """``acc`` (<16 x i32>) plus the sums of each 4 adjacent products of 64 signed bytes
    ``w`` (weight codes) by 64 signed bytes ``s`` (activation codes): on AVX2 without VNNI
    :func:`small_dot4` of ``|s|`` (``vpabsb``; -128 reads as the unsigned 128) by ``w`` with
    ``s``'s sign (``vpsignb``).

    Exact unless a byte of ``w`` is -128 where ``s`` is negative (``vpsignb`` cannot negate
    -128): the caller sends such weights elsewhere (:func:`q8_0_codes_in_range`). ggml's AVX2
    code takes the roles the other way round (``|w|`` by ``s`` signed by ``w``), which is
    inexact where an activation code is -128: the code of a NaN, ``inf * 0`` included, that
    an infinite block's scale (inf, not NaN) turns into an infinity whose sign is that of
    the integer sum. qllama computes ggml's generic C, whose integer sums are exact."""
    if not PAIRS:  # the products in int32
        prod = builder.mul(builder.sext(w, vec(I32, 64)), builder.sext(s, vec(I32, 64)))
        quads4 = [pick(builder, prod, list(range(c, 64, 4))) for c in range(4)]
        total = builder.add(builder.add(quads4[0], quads4[1]), builder.add(quads4[2], quads4[3]))
        return builder.add(acc, total)
    abs_fn = declare(builder, "llvm.abs.v64i8", vec(I8, 64), [vec(I8, 64), I1])
    magnitude = builder.call(abs_fn, [s, ir.Constant(I1, 0)])
    signed = _by_parts(builder, "llvm.x86.avx2.psign.b", vec(I8, 32), 32, w, s)
    return small_dot4(builder, acc, magnitude, signed)


def reduce_add(builder: ir.IRBuilder, v: Any) -> Any:
    """The sum of an integer vector's lanes (exact in its width)."""
    n, elem = v.type.count, v.type.element
    fn = declare(builder, f"llvm.vector.reduce.add.v{n}i{elem.width}", elem, [v.type])
    return builder.call(fn, [v])


def fsum_in_order(builder: ir.IRBuilder, acc: Any, terms: Any, n: int) -> Any:
    """``((acc + terms[0]) + terms[1]) + ... + terms[n-1]`` in float32, in that order (the
    sum of a row's block terms in block order, as ggml's ``sumf += ...``)."""
    for j in range(n):
        acc = builder.fadd(acc, builder.extract_element(terms, ir.Constant(I32, j)))
    return acc
