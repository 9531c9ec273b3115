"""The CPU arithmetic's oracle: ggml's CPU quantized matmul, computed plainly in numpy.

For a weight row of type T and an activation row, ggml's CPU quantizes the activation row to
T's ``vec_dot_type`` (Q8_0, Q8_1 or Q8_K; rounds it to half for F16/BF16 weights) with its
``from_float``, then calls T's ``vec_dot``: exact integer sums per block, combined with the
blocks' float scales. This module computes the same thing for every (activation row, weight
row) pair at once:

* activations are quantized by :func:`qllama.quants.quantize`, bit-exact with ggml
  (``activation_rounding="ref"``: ``quantize_row_*_ref``, ties away from zero for Q8_0/Q8_1;
  ``"simd"``: the AVX2/NEON ``from_float``, ties to even, ``id = 127/amax``);
* each weight format describes itself as integers and float scales
  (:meth:`~qllama.quants.base.QuantType.integer_form`), and :func:`vec_dot` is written once
  over that form: the integer sums of a block are float32 BLAS products that are exact (every
  partial sum is an integer of at most 2**24, checked per format; float64 for the IQ formats
  whose sums can pass it, rounded to float32 as C converts ggml's int32 sum), and the float
  scales are combined in the order of ggml's generic C (``ggml-cpu/quants.c``). Results
  equal that C, compiled as written (no FMA contraction), bit for bit; ggml's SIMD kernels,
  and builds that contract ``sumf += a*b`` into an FMA, differ from it by float32 rounding
  only.

Weights stay the file's bytes (a zero-copy view) and are unpacked chunk by chunk in each
call, so memory per call is bounded by ``work_bytes``; no unpacked copy is kept. This path is
the oracle for faster CPU kernels, so it favours clarity and exactness over speed.

The backend that runs it, and chooses between it and the compiled kernels, is
:mod:`qllama.backends.numpy.dispatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qllama.quants.base import Fields, IntegerForm

F32 = np.float32

# Largest |q| of an activation block: 127, or -128 where the AVX2 quantizer saturates a NaN.
_ACT_BOUND = 128
_EXACT_F32 = 2**24  # every integer up to this magnitude is exact in float32
_EXACT_F64 = 2**53


@dataclass(frozen=True)
class Activations:
    """Activation rows quantized to a weight's ``vec_dot_type``, laid out per weight block.

    ``q`` is ``(n_blocks, lanes, T, block_size // lanes)`` float32 (small exact integers), so
    that ``q[b] @ w[b]`` is the integer sum of block ``b`` per accumulator lane; ``d`` and
    ``s`` are ``(n_blocks, T)``; ``bsums`` (Q8_K) is ``(n_blocks, T, n_sub)``: the sums of
    ``q`` over each of the weight's sub-blocks.
    """

    q: np.ndarray
    d: np.ndarray
    s: np.ndarray | None = None
    bsums: np.ndarray | None = None

    @classmethod
    def of(cls, fields: Fields, shape: tuple[int, int], form: IntegerForm) -> Activations:
        """Lay out the unpacked Q8_0 / Q8_1 / Q8_K fields of ``shape`` (T, K) for ``form``."""
        tokens, k = shape
        block = form.q.shape[1]
        n_blocks = k // block
        qs = fields["qs"].reshape(tokens, n_blocks, block // form.lanes, form.lanes)
        # a weight block may be a part of an activation block (NVFP4's 16, IQ4_XS's 32): it
        # takes the d of the activation block it lies in
        n_act = fields["d"].size // tokens
        per_token = {
            f: np.repeat(fields[f].reshape(tokens, n_act), n_blocks // n_act, axis=1).T
            for f in ("d", "s")
            if f in fields
        }
        bsums = None
        if "bsums" in fields and form.mins is not None:
            # Q8_K keeps sums of 16; a weight sub-block of 32 is two of them (exact integers)
            n_sub = form.mins.shape[1]
            per_sub = fields["bsums"].reshape(tokens, n_blocks, n_sub, 16 // n_sub)
            bsums = np.ascontiguousarray(per_sub.sum(axis=3).transpose(1, 0, 2), dtype=F32)
        return cls(
            q=np.ascontiguousarray(qs.transpose(1, 3, 0, 2), dtype=F32),
            d=np.ascontiguousarray(per_token["d"]),
            s=np.ascontiguousarray(per_token["s"]) if "s" in per_token else None,
            bsums=bsums,
        )


@dataclass(frozen=True)
class WeightBlocks:
    """An :class:`IntegerForm` laid out for BLAS: block-major, weight rows last.

    ``w`` is ``(n_blocks, lanes, block_size // lanes, R)`` float32, the integers with the
    sub-block scales folded in (small exact integers; float64 where a block's sum can pass
    2**24); ``d``, ``m``, ``dmin`` are ``(n_blocks, 1, R)`` and ``mins``
    ``(n_blocks, n_sub, R)``, or None where absent; ``lanes``, ``sumi_first``,
    ``isum_scale``, ``row_scale``, ``post`` (as ``d``) and ``group`` are the form's.
    """

    w: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    dmin: np.ndarray | None
    mins: np.ndarray | None
    lanes: int
    sumi_first: bool
    isum_scale: float = 1.0
    row_scale: float = 1.0
    post: np.ndarray | None = None
    group: int = 1

    @classmethod
    def of(cls, form: IntegerForm, rows: int) -> WeightBlocks:
        block = form.q.shape[1]
        n_blocks = form.q.shape[0] // rows
        # every partial sum of a block's integer dot product must be exact: in float32 when
        # it cannot pass 2**24, else in float64 (IQ2, IQ3_XXS: up to 128 * 256 * 62 * 31)
        largest = _ACT_BOUND * (block // form.lanes) * form.bound
        if largest > _EXACT_F64 or (largest > _EXACT_F32 and form.lanes > 1):
            raise AssertionError(
                f"{block // form.lanes} products up to {_ACT_BOUND} * {form.bound} can pass "
                "the exact range of their float sum"
            )
        wide = np.float64 if largest > _EXACT_F32 else F32
        w = form.q.astype(np.int32)
        if form.scales is not None:
            w *= np.repeat(form.scales.astype(np.int32), form.sub_size, axis=1)
        w4 = w.reshape(rows, n_blocks, block // form.lanes, form.lanes).transpose(1, 3, 2, 0)

        def per_block(a: np.ndarray) -> np.ndarray:
            """(rows * n_blocks, k) -> (n_blocks, k, rows) float32."""
            a3 = a.reshape(rows, n_blocks, a.shape[1]).transpose(1, 2, 0)
            return np.ascontiguousarray(a3, dtype=F32)

        return cls(
            w=np.ascontiguousarray(w4, dtype=wide),
            d=per_block(form.d),
            m=None if form.m is None else per_block(form.m),
            dmin=None if form.dmin is None else per_block(form.dmin),
            mins=None if form.mins is None else per_block(form.mins),
            lanes=form.lanes,
            sumi_first=form.sumi_first,
            isum_scale=form.isum_scale,
            row_scale=form.row_scale,
            post=None if form.post is None else per_block(form.post),
            group=form.group,
        )


def vec_dot(acts: Activations, wb: WeightBlocks, tokens: slice) -> np.ndarray:
    """ggml's CPU ``vec_dot`` of activation rows ``tokens`` with every weight row of ``wb``.

    Returns ``(T, R)`` float32, equal bit for bit to ggml's generic C (``ggml-cpu/quants.c``)
    compiled without FMA contraction. Per block, in block order: the integer sums (float32
    BLAS, exact), then ``sumf += (d*y.d)*isum + m*y.s - (dmin*y.d)*msum`` (Q4_0:
    ``(isum*d)*y.d``; IQ1: ``isum*isum_scale`` for ``isum``; IQ4_XS:
    ``((d*y.d)*post)*isum``); with 8 lanes, ``(d*y.d)*isum`` goes to 8 accumulators instead,
    added to ``sumf`` after the last block. With ``group`` > 1 (Q1_0, Q2_0) each run of
    ``group`` blocks is one weight block: ``sumf += d * inner``, ``inner`` the float32 sum of
    the run's ``y.d*isum``. The IQ2 and IQ3_XXS rows end with ``row_scale * sumf``.
    """
    q_act, d_act = acts.q[:, :, tokens], acts.d[:, tokens]
    sumf = np.zeros((d_act.shape[1], wb.w.shape[3]), dtype=F32)
    lane_sums = np.zeros((wb.lanes, *sumf.shape), dtype=F32)
    inner = np.zeros_like(sumf)
    for b in range(q_act.shape[0]):
        # (lanes, T, R): exact integers; a float64 sum rounds to float32 as C's (float)sumi
        sumi = np.matmul(q_act[b], wb.w[b]).astype(F32, copy=False)
        if wb.isum_scale != 1.0:  # exact: a power of two on an integer below 2**24
            sumi *= F32(wb.isum_scale)
        yd = d_act[b][:, None]
        mterm = None
        if wb.mins is not None:  # - (dmin*y.d) * sum(m * bsums), integers exact as well
            assert acts.bsums is not None and wb.dmin is not None
            mterm = (wb.dmin[b] * yd) * np.matmul(acts.bsums[b, tokens], wb.mins[b])
        if wb.lanes > 1:
            sumi *= wb.d[b] * yd
            lane_sums += sumi
            if mterm is not None:
                sumf -= mterm
            continue
        isum = sumi[0]
        if wb.group > 1:  # C: sumi += d1*sumi_block over the run, then sumf += d0*sumi
            inner = (F32(0) if b % wb.group == 0 else inner) + yd * isum
            if b % wb.group == wb.group - 1:
                sumf += wb.d[b] * inner
            continue
        if wb.post is not None:
            term = ((wb.d[b] * yd) * wb.post[b]) * isum
        else:
            term = (isum * wb.d[b]) * yd if wb.sumi_first else (wb.d[b] * yd) * isum
        if wb.m is not None:  # Q4_1 / Q5_1: + m*y.s, with the activation's stored fp16 s
            assert acts.s is not None
            term = term + wb.m[b] * acts.s[b, tokens][:, None]
        if mterm is not None:
            term = term - mterm
        sumf += term
    if wb.lanes > 1:
        for lane in lane_sums:
            sumf += lane
    if wb.row_scale != 1.0:
        sumf *= F32(wb.row_scale)
    return sumf
