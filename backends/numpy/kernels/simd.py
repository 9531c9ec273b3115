"""LLVM vector primitives for the numba CPU kernels: block decoding and exact integer sums.

numba compiles scalar Python; LLVM vectorizes long loops well but not the 32-element
reductions and nibble unpacking of a quantized block (it unrolls them into scalar code).
These few intrinsics (``numba.extending.intrinsic``) state the vector code directly in
LLVM IR: portable IR (LLVM picks ``vpmaddwd``, ``vpmovsxbw`` and shuffles on x86, their
NEON forms on ARM), and AVX512-VNNI's ``vpdpbusd`` / ``vpdpwssd`` where numba compiles for
a host that has them (:data:`VNNI`):

* :func:`decode_levels`: the 32 levels a block of 4-bit indices picks from its format's table
  (IQ4_NL, IQ4_XS, MXFP4), offset by 128 to be unsigned (``pshufb`` where the host has
  SSSE3, a chain of selects otherwise);
* :func:`dots`: integer dot products of runs of 32 bytes, unsigned by signed, several at once
  (``vpdpbusd`` on hosts with AVX512-VNNI);
* :func:`token_dots`, :func:`token_wdots`: one weight run (int8 codes, or int16 with the
  scales folded in) against 16 tokens held in the vector lanes, for many-token matmuls;
* :func:`lanes8`: a 256-block's integer sums per accumulator lane (``e % 8``), each sub-block
  scaled by its integer scale, as ggml's generic K-quant dot products keep them;
* :func:`half_to_float`, :func:`round_to_half` (fp16 scales), :func:`float_bits`.

Everything here is integer arithmetic (exact in any order) or an exact conversion; the
float32 combination of the sums, where order matters, is plain numba code in
:mod:`qllama.backends.numpy.kernels.matmul`. Block layouts are drawn in each format's class in
:mod:`qllama.quants`. Multi-byte fields (fp16 scales, Q5's ``qh``) are read as stored,
little-endian: GGUF's order, and that of every host numba runs on.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from qllama.ggml_types import GGMLType
from qllama.quants import fp4, iq4_search

I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)

# format ids the kernels pass as literals
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (int(GGMLType[n]) for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"))
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = (int(GGMLType[n]) for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))
LEGACY = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
KQUANTS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
IQ4_NL, IQ4_XS, MXFP4 = (int(GGMLType[n]) for n in ("IQ4_NL", "IQ4_XS", "MXFP4"))
# formats whose 4-bit codes index a table of 16 levels (their values, plus 128)
TABLE_FORMATS = (IQ4_NL, IQ4_XS, MXFP4)
_LEVELS = {
    IQ4_NL: iq4_search.KVALUES,
    IQ4_XS: iq4_search.KVALUES,
    MXFP4: fp4.KVALUES,
}


# --- IR helpers -------------------------------------------------------------------------------


def _vec(elem: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(elem, n)


def _splat(elem: ir.IntType, n: int, value: int) -> ir.Constant:
    return ir.Constant(_vec(elem, n), [ir.Constant(elem, value)] * n)


def _consts(elem: ir.IntType, values: list[int]) -> ir.Constant:
    return ir.Constant(_vec(elem, len(values)), [ir.Constant(elem, v) for v in values])


def _ptr(context: Any, builder: ir.IRBuilder, arrty: types.Array, arr: Any, off: Any) -> Any:
    """Address of element ``off`` of a 1-D array."""
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.gep(data, [off])


def _at(builder: ir.IRBuilder, ptr: Any, off: int, ty: ir.Type) -> Any:
    """``ptr`` + ``off`` bytes, as a pointer to ``ty``."""
    p = builder.bitcast(ptr, I8.as_pointer())
    p = builder.gep(p, [ir.Constant(ir.IntType(64), off)]) if off else p
    return builder.bitcast(p, ty.as_pointer())


def _load(builder: ir.IRBuilder, ptr: Any, off: int, ty: ir.Type) -> Any:
    """Load ``ty`` at byte ``off`` after ``ptr`` (any alignment)."""
    return builder.load(_at(builder, ptr, off, ty), align=1)


def _shuffle(builder: ir.IRBuilder, a: Any, b: Any, mask: list[int]) -> Any:
    return builder.shuffle_vector(a, b, _consts(I32, mask))


def _pick(builder: ir.IRBuilder, v: Any, mask: list[int]) -> Any:
    """Lanes ``mask`` of one vector."""
    return _shuffle(builder, v, v, mask)


def _bits(builder: ir.IRBuilder, v: Any, shifts: list[int], width: int) -> Any:
    """``(v >> shifts) & (2**width - 1)`` lane by lane (uint8 lanes)."""
    n = len(shifts)
    return builder.and_(builder.lshr(v, _consts(I8, shifts)), _splat(I8, n, (1 << width) - 1))


# --- block codes ------------------------------------------------------------------------------


def _nibbles(builder: ir.IRBuilder, qs16: Any) -> Any:
    """16 bytes -> 32 codes: the low nibbles (elements 0..15), then the high ones."""
    lo = builder.and_(qs16, _splat(I8, 16, 15))
    hi = builder.lshr(qs16, _splat(I8, 16, 4))
    return _shuffle(builder, lo, hi, list(range(32)))


def _fifth_bits(builder: ir.IRBuilder, qh4: Any) -> Any:
    """Q5_0/Q5_1 ``qh`` (4 bytes) -> 32 lanes of ``0x10`` where element e's bit is set."""
    spread = _pick(builder, qh4, [e // 8 for e in range(32)])
    # a test against a mask per lane, not a shift per lane (x86 has no variable byte shift)
    hit = builder.icmp_unsigned(
        "!=",
        builder.and_(spread, _consts(I8, [1 << (e % 8) for e in range(32)])),
        _splat(I8, 32, 0),
    )
    return builder.select(hit, _splat(I8, 32, 16), _splat(I8, 32, 0))


def _legacy_codes(builder: ir.IRBuilder, fmt: int, p: Any, offset: bool = True) -> Any:
    """The 32 codes of a Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 block at ``p``: signed as in
    ``integer_form`` (``offset``), or as stored (the _0 types before subtracting 8 / 16)."""
    if fmt == Q8_0:
        return _load(builder, p, 2, _vec(I8, 32))
    qs_at = {Q4_0: 2, Q4_1: 4, Q5_0: 6, Q5_1: 8}[fmt]
    q = _nibbles(builder, _load(builder, p, qs_at, _vec(I8, 16)))
    if fmt in (Q5_0, Q5_1):
        qh_at = 2 if fmt == Q5_0 else 4
        q = builder.or_(q, _fifth_bits(builder, _load(builder, p, qh_at, _vec(I8, 4))))
    sub = {Q4_0: 8, Q5_0: 16}.get(fmt, 0) if offset else 0  # _0 types: symmetric around 8 / 16
    return builder.sub(q, _splat(I8, 32, sub)) if sub else q


def _kquant_run(builder: ir.IRBuilder, fmt: int, p: Any, m: int) -> Any:
    """Signed codes of elements ``32m .. 32m+31`` of a K-quant super-block at ``p``."""
    run = _vec(I8, 32)
    if fmt in (Q2_K, Q3_K):  # element 128n + 32j + l: bits 2j of qs[32n + l]
        n, j = divmod(m, 4)
        qs = _load(builder, p, (16 if fmt == Q2_K else 32) + 32 * n, run)
        q = _bits(builder, qs, [2 * j] * 32, 2)
        if fmt == Q2_K:
            return q
        high = _bits(builder, _load(builder, p, 0, run), [m] * 32, 1)  # bit m of hmask[l]
        q = builder.or_(q, builder.shl(high, _splat(I8, 32, 2)))
        return builder.sub(q, _splat(I8, 32, 4))
    if fmt in (Q4_K, Q5_K):  # element 64c + l: low nibble of qs[32c + l]; 64c + 32 + l: high
        c, high_half = divmod(m, 2)
        qs = _load(builder, p, (16 if fmt == Q4_K else 48) + 32 * c, run)
        q = _bits(builder, qs, [4 * high_half] * 32, 4)
        if fmt == Q4_K:
            return q
        fifth = _bits(builder, _load(builder, p, 16, run), [m] * 32, 1)  # bit m of qh[l]
        return builder.or_(q, builder.shl(fifth, _splat(I8, 32, 4)))
    # Q6_K, element 128n + 32k + l: ql[64n + 32(k%2) + l] (low nibble for k < 2, else high),
    # top two bits (qh[32n + l] >> 2k) & 3
    n, k = divmod(m, 4)
    ql = _load(builder, p, 64 * n + 32 * (k % 2), run)
    lo = _bits(builder, ql, [4 * (k // 2)] * 32, 4)
    hi = _bits(builder, _load(builder, p, 128 + 32 * n, run), [2 * k] * 32, 2)
    q = builder.or_(lo, builder.shl(hi, _splat(I8, 32, 4)))
    return builder.sub(q, _splat(I8, 32, 32))


def _literal(ty: Any, allowed: tuple[int, ...], what: str) -> int | None:
    """The value of a compile-time constant argument, one of ``allowed`` (None: not a
    constant yet; numba then retries with the literal)."""
    if not isinstance(ty, types.IntegerLiteral):
        return None
    value = int(ty.literal_value)
    if value not in allowed:
        raise TypeError(f"{what} is one of {allowed}, not {value}")
    return value


def _table_lookup(builder: ir.IRBuilder, table: list[int], idx: Any) -> Any:
    """``table[idx]`` for 32 indices below 16 (<32 x i8>): two ``pshufb`` where the host has
    SSSE3, else a chain of 15 selects (portable IR)."""
    if SSSE3:
        v16 = _vec(I8, 16)
        fnty = ir.FunctionType(v16, [v16, v16])
        name = "llvm.x86.ssse3.pshuf.b.128"
        fn = builder.module.globals.get(name) or ir.Function(builder.module, fnty, name)
        t = _consts(I8, table)
        lo = builder.call(fn, [t, _pick(builder, idx, list(range(16)))])
        hi = builder.call(fn, [t, _pick(builder, idx, list(range(16, 32)))])
        return _shuffle(builder, lo, hi, list(range(32)))
    out = _splat(I8, 32, table[0])
    for i in range(1, 16):
        hit = builder.icmp_unsigned("==", idx, _splat(I8, 32, i))
        out = builder.select(hit, _splat(I8, 32, table[i]), out)
    return out


@intrinsic(prefer_literal=True)
def decode_levels(typingctx: Any, raw: Any, off: Any, q: Any, qo: Any, fmt: Any) -> Any:
    """The 16 bytes of 4-bit indices at byte ``off`` of ``raw`` -> their 32 levels plus 128
    (uint8) in ``q[qo:qo+32]``: byte j's low nibble is element j, its high nibble element
    j + 16 (IQ4_NL, MXFP4, and each 32-block of IQ4_XS)."""
    f = _literal(fmt, TABLE_FORMATS, "decode_levels: fmt")
    if f is None:
        return None
    table = [(int(v) + 128) & 0xFF for v in _LEVELS[f]]

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        p = _ptr(context, builder, sig.args[0], args[0], args[1])
        out = _ptr(context, builder, sig.args[2], args[2], args[3])
        idx = _nibbles(builder, _load(builder, p, 0, _vec(I8, 16)))
        v = _table_lookup(builder, table, idx)
        builder.store(v, _at(builder, out, 0, v.type), align=1)
        return context.get_dummy_value()

    return types.none(raw, off, q, qo, fmt), codegen


# --- integer sums -----------------------------------------------------------------------------


def _products(builder: ir.IRBuilder, a: Any, b: Any) -> Any:
    """32 int8 x 32 int8 -> 32 int32 products (each fits int16: |a*b| <= 2**14)."""
    return builder.mul(builder.sext(a, _vec(I32, 32)), builder.sext(b, _vec(I32, 32)))


def _combine(builder: ir.IRBuilder, a: Any, b: Any, group: int) -> Any:
    """One step of a joint reduction: ``a`` and ``b`` hold partial sums in runs of ``group``
    lanes per dot product; the result holds ``a``'s then ``b``'s in runs of ``group // 2``."""
    n = a.type.count
    lo = [i for i in range(n) if (i // (group // 2)) % 2 == 0]
    hi = [i for i in range(n) if (i // (group // 2)) % 2 == 1]
    return builder.add(
        _shuffle(builder, a, b, lo + [n + i for i in lo]),
        _shuffle(builder, a, b, hi + [n + i for i in hi]),
    )


def _reduce_together(builder: ir.IRBuilder, vecs: list[Any], group: int, count: int) -> Any:
    """``count`` dot products from vectors of 16 int32 partial sums, each vector holding
    ``16 // group`` of them in runs of ``group`` lanes: the ``count`` sums, in order."""
    while len(vecs) > 1:
        vecs = [_combine(builder, vecs[i], vecs[i + 1], group) for i in range(0, len(vecs), 2)]
        group //= 2
    v = vecs[0]
    while group > 1:  # fewer dot products than lanes: fold the runs in place
        half = group // 2
        lo = [i for i in range(16) if (i // half) % 2 == 0]
        hi = [i for i in range(16) if (i // half) % 2 == 1]
        v = builder.add(_pick(builder, v, lo + lo), _pick(builder, v, hi + hi))
        group = half
    return _pick(builder, v, list(range(count))) if count < 16 else v


def _host_features() -> dict[str, bool]:
    """The CPU features numba compiles for: the host's, or where another target was asked for
    (``NUMBA_CPU_NAME``) the features given with it (``NUMBA_CPU_FEATURES``, e.g.
    ``+avx2,+f16c``), none if none."""
    import platform

    from llvmlite import binding
    from numba.core import config

    if getattr(config, "CPU_NAME", None):
        given = (getattr(config, "CPU_FEATURES", None) or "").split(",")
        return {f[1:]: f[0] == "+" for f in given if len(f) > 1 and f[0] in "+-"}
    features = dict(binding.get_host_cpu_features())
    if platform.machine().lower() in ("arm64", "aarch64"):
        features["f16c"] = True  # fp16 conversions are base AArch64
    return features


_FEATURES = _host_features()
# AVX512-VNNI: vpdpbusd / vpdpwssd. Without it, portable IR (vpmaddwd and shuffles on x86).
VNNI = bool(_FEATURES.get("avx512vnni") and _FEATURES.get("avx512bw"))
# fp16 <-> fp32 in hardware (F16C, AArch64). Without it LLVM would call compiler-rt's
# __extendhfsf2 / __truncsfhf2, which numba's JIT does not link: integer code instead.
HALF = bool(_FEATURES.get("f16c"))
# pshufb: a 16-entry table lookup in one instruction (every x86-64 since 2006)
SSSE3 = bool(_FEATURES.get("ssse3"))


def tune(context: Any, builder: ir.IRBuilder) -> None:
    """Tune the function being built (the one an intrinsic emits into) for these kernels.

    Two LLVM choices cost a kernel several times its speed, and both are features, which change
    the instructions chosen, never what they compute:

    * AMD tunings (znver*) shuffle 128-bit lanes with SSE4A's ``extrq``/``insertq``, legacy-SSE
      instructions that stall for about 100 ns each once the upper halves of the ymm
      registers are in use (measured on a Zen 3 guest: 109 ns against 0.4 ns for ``vpsrlq``),
      which made a Q4_K decode call some 30 times slower: ``-sse4a``;
    * Intel tunings lack ``fast-dpwssd`` and split each ``vpdpwssd`` into ``vpmaddwd`` +
      ``vpaddd``, which halves a loop bound by them: ``+fast-dpwssd`` where :data:`VNNI`.

    Idempotent: every intrinsic calls it, and a function may hold several."""
    features = [f for f in context.codegen()._tm_features.split(",") if f and f != "+sse4a"]
    if _FEATURES.get("sse4a"):
        features.append("-sse4a")
    if VNNI:
        features.append("+fast-dpwssd")
    attrs = builder.function.attributes
    for old in [a for a in attrs if isinstance(a, str) and a.startswith('"target-features"')]:
        set.discard(attrs, old)
    # a string attribute, which llvmlite's add refuses (it knows only the enum ones)
    set.add(attrs, f'"target-features"="{",".join(features)}"')


def _vnni(builder: ir.IRBuilder, name: str, acc: Any, a: Any, b: Any) -> Any:
    """``acc`` plus an AVX512-VNNI dot product of ``a`` and ``b`` (any 512-bit vectors)."""
    v16 = _vec(I32, 16)
    fnty = ir.FunctionType(v16, [v16, v16, v16])
    full = f"llvm.x86.avx512.{name}.512"
    fn = builder.module.globals.get(full) or ir.Function(builder.module, fnty, full)
    return builder.call(fn, [acc, builder.bitcast(a, v16), builder.bitcast(b, v16)])


@intrinsic(prefer_literal=True)
def dots(
    typingctx: Any, u: Any, iu: Any, su: Any, s: Any, is_: Any, ss: Any, out: Any, n: Any
) -> Any:
    """``n`` (a literal: 1, 2, 4, 8 or 16) dot products of 32 bytes, unsigned by signed:
    ``out[i] = sum(uint8(u[iu + i*su + j]) * int8(s[is_ + i*ss + j]) for j in range(32))``
    (int32, exact).

    A stride of 0 reuses one run (a weight block against ``n`` tokens). Products are summed
    four by four with ``vpdpbusd`` where the host has AVX512-VNNI (two runs a vector), else
    in pairs (``vpmaddwd``); the ``n`` vectors are then reduced together, halving the lanes
    and doubling the sums per vector at each step, so each sum costs a fraction of a
    horizontal reduction.
    """
    count = _literal(n, (1, 2, 4, 8, 16), "dots: n")
    if count is None:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        i64 = ir.IntType(64)
        base_u = builder.bitcast(
            _ptr(context, builder, sig.args[0], args[0], args[1]), I8.as_pointer()
        )
        base_s = builder.bitcast(
            _ptr(context, builder, sig.args[3], args[3], args[4]), I8.as_pointer()
        )

        def run(base: Any, stride: Any, i: int) -> Any:
            p = builder.gep(base, [builder.mul(stride, ir.Constant(i64, i))])
            return _load(builder, p, 0, _vec(I8, 32))

        vecs = []
        if VNNI and count > 1:
            group = 8  # two dot products a vector, 8 lanes each
            both = list(range(64))
            for i in range(0, count, 2):
                uu = _shuffle(builder, run(base_u, args[2], i), run(base_u, args[2], i + 1), both)
                vv = _shuffle(builder, run(base_s, args[5], i), run(base_s, args[5], i + 1), both)
                vecs.append(_vnni(builder, "vpdpbusd", _splat(I32, 16, 0), uu, vv))
        else:
            group = 16
            for i in range(count):
                p = builder.mul(
                    builder.zext(run(base_u, args[2], i), _vec(I32, 32)),
                    builder.sext(run(base_s, args[5], i), _vec(I32, 32)),
                )
                vecs.append(
                    builder.add(
                        _pick(builder, p, list(range(0, 32, 2))),
                        _pick(builder, p, list(range(1, 32, 2))),
                    )
                )
        res = _reduce_together(builder, vecs, group, count)
        po = _ptr(context, builder, sig.args[6], args[6], ir.Constant(i64, 0))
        builder.store(res, _at(builder, po, 0, res.type), align=1)
        return context.get_dummy_value()

    return types.none(u, iu, su, s, is_, ss, out, n), codegen


def _splat_dword(builder: ir.IRBuilder, p: Any, off: int) -> Any:
    """The 4 bytes at ``p + off`` repeated 16 times, as <16 x i32>."""
    word = _load(builder, p, off, I32)
    one = builder.insert_element(ir.Constant(_vec(I32, 16), None), word, ir.Constant(I32, 0))
    return _pick(builder, one, [0] * 16)


def _quad_sums(builder: ir.IRBuilder, prod: Any) -> Any:
    """64 int32 products -> 16: the sums of each 4 adjacent (what ``vpdpbusd`` adds)."""
    quads = [_pick(builder, prod, list(range(c, 64, 4))) for c in range(4)]
    return builder.add(builder.add(quads[0], quads[1]), builder.add(quads[2], quads[3]))


@intrinsic(prefer_literal=True)
def token_dots(
    typingctx: Any, w: Any, iw: Any, xv: Any, ix: Any, gs: Any, out: Any, mode: Any
) -> Any:
    """One weight block of 32 bytes against 16 tokens, the tokens in the vector lanes:
    ``out[t] = sum(w[iw + 4g + c] * xv[ix + g*gs + 4t + c] for g < 8, c < 4)`` (int32).

    ``xv`` holds the activations of a block four by four per token (``4t + c``), one group
    ``g`` of 4 elements every ``gs`` bytes, so that one ``vpdpbusd`` adds 4 products for 16
    tokens and no horizontal sum is needed. ``mode`` (a literal) says which side is
    unsigned: 0, the weights (stored codes of Q4/Q5); 1, the activations (``x ^ 0x80``
    against Q8_0's signed weights).
    """
    unsigned_w = _literal(mode, (0, 1), "token_dots: mode")
    if unsigned_w is None:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        i64 = ir.IntType(64)
        pw = _ptr(context, builder, sig.args[0], args[0], args[1])
        px = builder.bitcast(_ptr(context, builder, sig.args[2], args[2], args[3]), I8.as_pointer())
        accs = [_splat(I32, 16, 0)] * 4  # four chains: each vpdpbusd waits for its previous
        for g in range(8):
            wd = _splat_dword(builder, pw, 4 * g)
            xg = builder.gep(px, [builder.mul(args[4], ir.Constant(i64, g))])
            xd = _load(builder, xg, 0, _vec(I32, 16))
            u, sgn = (wd, xd) if unsigned_w == 0 else (xd, wd)
            if VNNI:
                accs[g % 4] = _vnni(builder, "vpdpbusd", accs[g % 4], u, sgn)
            else:
                ub, sb = builder.bitcast(u, _vec(I8, 64)), builder.bitcast(sgn, _vec(I8, 64))
                prod = builder.mul(builder.zext(ub, _vec(I32, 64)), builder.sext(sb, _vec(I32, 64)))
                accs[g % 4] = builder.add(accs[g % 4], _quad_sums(builder, prod))
        acc = builder.add(builder.add(accs[0], accs[1]), builder.add(accs[2], accs[3]))
        po = _ptr(context, builder, sig.args[5], args[5], ir.Constant(i64, 0))
        builder.store(acc, _at(builder, po, 0, acc.type), align=1)
        return context.get_dummy_value()

    return types.none(w, iw, xv, ix, gs, out, mode), codegen


@intrinsic
def token_wdots(typingctx: Any, w: Any, iw: Any, xv: Any, ix: Any, gs: Any, out: Any) -> Any:
    """32 int16 weights against 16 tokens, the tokens in the vector lanes (as
    :func:`token_dots`): ``out[t] = sum(w[iw + 2p + c] * xv[ix + p*gs + 2t + c]
    for p < 16, c < 2)``, int32 (``vpdpwssd`` where the host has AVX512-VNNI). ``xv`` is
    int16, its offsets and stride counted in elements."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        i64 = ir.IntType(64)
        pw = _ptr(context, builder, sig.args[0], args[0], args[1])
        px = _ptr(context, builder, sig.args[2], args[2], args[3])
        accs = [_splat(I32, 16, 0)] * 4
        for p in range(16):
            wd = _splat_dword(builder, pw, 4 * p)
            xd = _load(
                builder,
                builder.gep(px, [builder.mul(args[4], ir.Constant(i64, p))]),
                0,
                _vec(I32, 16),
            )
            if VNNI:
                accs[p % 4] = _vnni(builder, "vpdpwssd", accs[p % 4], xd, wd)
            else:
                a = builder.sext(builder.bitcast(xd, _vec(I16, 32)), _vec(I32, 32))
                b = builder.sext(builder.bitcast(wd, _vec(I16, 32)), _vec(I32, 32))
                prod = builder.mul(a, b)
                pairs = builder.add(
                    _pick(builder, prod, list(range(0, 32, 2))),
                    _pick(builder, prod, list(range(1, 32, 2))),
                )
                accs[p % 4] = builder.add(accs[p % 4], pairs)
        acc = builder.add(builder.add(accs[0], accs[1]), builder.add(accs[2], accs[3]))
        po = _ptr(context, builder, sig.args[5], args[5], ir.Constant(i64, 0))
        builder.store(acc, _at(builder, po, 0, acc.type), align=1)
        return context.get_dummy_value()

    return types.none(w, iw, xv, ix, gs, out), codegen


def _zext32(builder: ir.IRBuilder, v: Any) -> Any:
    return builder.zext(v, _vec(I32, v.type.count))


def _kquant_scales(builder: ir.IRBuilder, fmt: int, p: Any) -> tuple[Any, Any]:
    """A super-block's 16 sub-block scales (8 used by Q4_K/Q5_K) and the mins of its 16
    groups of 16 (each sub-block's min, repeated; zero for Q3_K/Q6_K), <16 x i32> each."""
    zero = _splat(I32, 16, 0)
    if fmt == Q6_K:
        return builder.sext(_load(builder, p, 192, _vec(I8, 16)), _vec(I32, 16)), zero
    if fmt == Q2_K:  # byte s: scale in the low nibble, min in the high one
        b = _load(builder, p, 0, _vec(I8, 16))
        sc = builder.and_(b, _splat(I8, 16, 15))
        return _zext32(builder, sc), _zext32(builder, builder.lshr(b, _splat(I8, 16, 4)))
    if fmt == Q3_K:  # low 4 bits in bytes 96..103 (two a byte), top 2 bits in 104..107
        low8 = _load(builder, p, 96, _vec(I8, 8))
        lo = _shuffle(
            builder,
            builder.and_(low8, _splat(I8, 8, 15)),
            builder.lshr(low8, _splat(I8, 8, 4)),
            list(range(16)),
        )
        top = _pick(builder, _load(builder, p, 104, _vec(I8, 4)), [i % 4 for i in range(16)])
        shifts = ir.Constant(_vec(I32, 16), [ir.Constant(I32, 2 * (i // 4)) for i in range(16)])
        hi = builder.and_(builder.lshr(_zext32(builder, top), shifts), _splat(I32, 16, 3))
        sc = builder.or_(_zext32(builder, lo), builder.shl(hi, _splat(I32, 16, 4)))
        return builder.sub(sc, _splat(I32, 16, 32)), zero
    # Q4_K / Q5_K: ggml's get_scale_min_k4 on bytes 4..15 (see kquant_search.scale_min_k4)
    v = _load(builder, p, 4, _vec(I8, 12))
    s_lo, m_lo, hi = (_pick(builder, v, [o + i % 4 for i in range(8)]) for o in (0, 4, 8))
    first = ir.Constant(
        ir.VectorType(ir.IntType(1), 8), [ir.Constant(ir.IntType(1), i < 4) for i in range(8)]
    )
    six = _splat(I8, 8, 63)

    def top2(x: Any) -> Any:
        return builder.shl(builder.lshr(x, _splat(I8, 8, 6)), _splat(I8, 8, 4))

    sc = builder.select(
        first, builder.and_(s_lo, six), builder.or_(builder.and_(hi, _splat(I8, 8, 15)), top2(s_lo))
    )
    mn = builder.select(
        first, builder.and_(m_lo, six), builder.or_(builder.lshr(hi, _splat(I8, 8, 4)), top2(m_lo))
    )
    sc16 = _shuffle(builder, sc, sc, list(range(8)) + [0] * 8)
    return _zext32(builder, sc16), _zext32(builder, _pick(builder, mn, [j // 2 for j in range(16)]))


@intrinsic(prefer_literal=True)
def lanes8(typingctx: Any, q: Any, x: Any, ix: Any, scales: Any, out: Any, sub: Any) -> Any:
    """ggml's 8 accumulator lanes of one 256-block, in integers.

    ``out[l] = sum_s scales[s] * sum(q[e] * x[ix + e] for e in sub-block s if e % 8 == l)``
    with sub-blocks of ``sub`` (16 or 32) elements; ``q`` holds the block's codes (int8),
    ``scales`` (int32) one integer scale per sub-block.
    """
    size = _literal(sub, (16, 32), "lanes8: sub (elements of a sub-block)")
    if size is None:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        zero = ir.Constant(ir.IntType(64), 0)
        pq = _ptr(context, builder, sig.args[0], args[0], zero)
        px = _ptr(context, builder, sig.args[1], args[1], args[2])
        ps = _ptr(context, builder, sig.args[3], args[3], zero)
        acc = _splat(I32, 8, 0)
        for m in range(8):
            p = _products(
                builder,
                _load(builder, pq, 32 * m, _vec(I8, 32)),
                _load(builder, px, 32 * m, _vec(I8, 32)),
            )
            # lanes l and l + 8k of a run hold the same e % 8
            quarters = [_pick(builder, p, list(range(8 * i, 8 * i + 8))) for i in range(4)]
            halves = [builder.add(quarters[0], quarters[1]), builder.add(quarters[2], quarters[3])]
            if size == 32:
                groups = [(m, builder.add(halves[0], halves[1]))]
            else:
                groups = [(2 * m, halves[0]), (2 * m + 1, halves[1])]
            for s, v in groups:
                scale = _load(builder, ps, 4 * s, I32)
                splat = builder.insert_element(
                    ir.Constant(_vec(I32, 8), None), scale, ir.Constant(I32, 0)
                )
                splat = _pick(builder, splat, [0] * 8)
                acc = builder.add(acc, builder.mul(v, splat))
        po = _ptr(context, builder, sig.args[4], args[4], zero)
        builder.store(acc, _at(builder, po, 0, acc.type), align=1)
        return context.get_dummy_value()

    return types.none(q, x, ix, scales, out, sub), codegen


# --- conversions ------------------------------------------------------------------------------


def _widen_half_bits(builder: ir.IRBuilder, h16: Any) -> Any:
    """fp16 bits -> float32, exactly, in integer operations (subnormals renormalized by one
    float subtraction, infinities and NaN payloads kept)."""
    h = builder.zext(h16, I32)
    o = builder.shl(builder.and_(h, ir.Constant(I32, 0x7FFF)), ir.Constant(I32, 13))
    e = builder.and_(o, ir.Constant(I32, 0x7C00 << 13))
    o = builder.add(o, ir.Constant(I32, 112 << 23))  # rebias the exponent: 127 - 15
    inf_nan = builder.add(o, ir.Constant(I32, 112 << 23))
    sub = builder.fsub(
        builder.bitcast(builder.add(o, ir.Constant(I32, 1 << 23)), ir.FloatType()),
        builder.bitcast(ir.Constant(I32, 113 << 23), ir.FloatType()),
    )
    is_max = builder.icmp_unsigned("==", e, ir.Constant(I32, 0x7C00 << 13))
    is_zero = builder.icmp_unsigned("==", e, ir.Constant(I32, 0))
    o = builder.select(is_max, inf_nan, builder.select(is_zero, builder.bitcast(sub, I32), o))
    sign = builder.shl(builder.and_(h, ir.Constant(I32, 0x8000)), ir.Constant(I32, 16))
    return builder.bitcast(builder.or_(o, sign), ir.FloatType())


@intrinsic
def half_to_float(typingctx: Any, raw: Any, off: Any) -> Any:
    """The fp16 at byte ``off`` of a uint8 array, widened to float32 (exact)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        p = _ptr(context, builder, sig.args[0], args[0], args[1])
        if HALF:  # GGUF is little-endian, as numba's hosts
            return builder.fpext(_load(builder, p, 0, ir.HalfType()), ir.FloatType())
        return _widen_half_bits(builder, _load(builder, p, 0, I16))

    return types.float32(raw, off), codegen


@intrinsic
def round_to_half(typingctx: Any, x: Any) -> Any:
    """float32 -> fp16 (IEEE nearest-even, overflow to inf) -> float32, in hardware (only
    where :data:`HALF`). NaN payloads are the hardware's; callers that store NaN use ggml's
    quiet NaN themselves."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.float32), codegen


@intrinsic
def float_bits(typingctx: Any, x: Any) -> Any:
    """The bits of a float32 as int32."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        return builder.bitcast(args[0], I32)

    return types.int32(types.float32), codegen


@intrinsic
def bits_float(typingctx: Any, x: Any) -> Any:
    """The float32 with these int32 bits."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tune(context, builder)
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


__all__: list[str] = [
    "HALF",
    "KQUANTS",
    "LEGACY",
    "VNNI",
    "bits_float",
    "decode_levels",
    "dots",
    "float_bits",
    "half_to_float",
    "lanes8",
    "round_to_half",
    "token_dots",
    "token_wdots",
]
