"""Compiled (numba) flash attention: ggml's CPU ``one_chunk`` kernel, bit for bit.

``ggml_compute_forward_flash_attn_ext_f16_one_chunk`` walks the cells of each query row in
order: a masked cell is skipped; a score above the running maximum rescales the accumulator by
``expf(M_old - s)`` (libm), any other adds ``expf(s - M)`` times the value row with one FMA per
element; the sum is ``S*ms + vs``. An F16 V cache keeps an f16 accumulator, rounded to half
after every rescale and every key (x86 F16C + FMA: ``f16(fma(v, vs, acc))``); other V types
accumulate in float32. :func:`qllama.runtime.flash_attention.one_chunk_oracle` states the same in
plain numpy; ``tests/test_kv_cache.py`` checks that both give the same bits.

The scores come in already computed (the K type's ``vec_dot`` against the converted query: a
cell's score does not depend on when it is computed), so one kernel serves every K type.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

import qllama.jit  # noqa: F401  (numba's cache of these functions, stamped as the kernels')

F32 = np.float32
NEG_INF = F32(-np.inf)


@intrinsic
def fma32(typingctx: object, a: object, b: object, c: object) -> object:
    """``a*b + c`` in float32 with one rounding (LLVM's ``llvm.fma.f32``: the instruction on
    an FMA host, libm's ``fmaf`` elsewhere; exact either way)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context: object, builder: ir.IRBuilder, signature: object, args: list) -> object:
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def as_bits(typingctx: object, x: object) -> object:
    """A float32's bits, as a uint32."""
    sig = types.uint32(types.float32)

    def codegen(context: object, builder: ir.IRBuilder, signature: object, args: list) -> object:
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def from_bits(typingctx: object, u: object) -> object:
    """The float32 of bits ``u`` (a uint32)."""
    sig = types.float32(types.uint32)

    def codegen(context: object, builder: ir.IRBuilder, signature: object, args: list) -> object:
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@numba.njit(cache=True, inline="always")
def round_f16(x: float) -> float:
    """``x`` (float32) rounded to half, nearest-even, as a float32 (``cvtps_ph``'s value)."""
    u = as_bits(x)
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x7F800000):  # inf, nan
        return x
    if a >= np.uint32(
        0x38800000
    ):  # 2^-14 and up: 10 mantissa bits, the carry may bump the exponent
        a = (a + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
        if a > np.uint32(0x477FE000):  # past 65504
            a = np.uint32(0x7F800000)
        return from_bits((u & np.uint32(0x80000000)) | a)
    # subnormal halves: multiples of 2^-24 (both scalings are exact)
    return F32(np.rint(x * F32(16777216.0)) * F32(5.9604644775390625e-08))


@numba.njit(cache=True, parallel=True)
def one_chunk(
    scores: np.ndarray,
    mask: np.ndarray,
    v: np.ndarray,
    scale: float,
    softcap: float,
    f16_acc: bool,
    fused_sum: bool,
    c0: int,
    c1: int,
    acc_out: np.ndarray,
    m_out: np.ndarray,
    s_out: np.ndarray,
) -> None:
    """The loop over cells ``c0 <= c < c1`` of rows ``scores`` (G, R, S) (raw products,
    before the scale) under ``mask`` (t, S) (row r reads mask row ``r % t``) over values
    ``v`` (G, S, DV), float32 holding the values the kernel reads (f16, bf16 or dequantized).
    Writes each row's accumulator (G, R, DV, as float32, not yet divided by the sum), its
    maximum and its sum (G, R): the kernel's state at the chunk's end (its ``partials``).
    ``softcap``: 0 for none, else ggml's ``cap*tanhf(s*scale)`` (``scale`` already divided by
    ``cap``). ``fused_sum``: the sum ``S*ms + vs`` as one FMA (GCC contracts it on FMA
    builds)."""
    G, R = scores.shape[0], scores.shape[1]
    t, DV = mask.shape[0], v.shape[2]
    for gr in numba.prange(G * R):
        g, r = gr // R, gr % R
        m_row = r % t
        acc = np.zeros(DV, np.float32)
        total = F32(0.0)
        M = NEG_INF
        for c in range(c0, c1):
            mv = mask[m_row, c]
            if mv == NEG_INF:
                continue
            s = scores[g, r, c] * F32(scale)
            if softcap != 0.0:
                s = F32(softcap) * F32(math.tanh(s))
            s = s + mv
            ms = F32(1.0)
            vs = F32(1.0)
            if s > M:
                ms = F32(math.exp(M - s))
                M = s
                if f16_acc:
                    for d in range(DV):
                        acc[d] = round_f16(acc[d] * ms)
                else:
                    for d in range(DV):
                        acc[d] = acc[d] * ms
            else:
                vs = F32(math.exp(s - M))
            if f16_acc:
                for d in range(DV):
                    acc[d] = round_f16(fma32(v[g, c, d], vs, acc[d]))
            else:
                for d in range(DV):
                    acc[d] = fma32(v[g, c, d], vs, acc[d])
            total = fma32(total, ms, vs) if fused_sum else total * ms + vs
        for d in range(DV):
            acc_out[g, r, d] = acc[d]
        m_out[g, r] = M
        s_out[g, r] = total
