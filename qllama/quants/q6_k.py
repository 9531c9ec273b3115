"""Q6_K: 256 weights in 16 sub-blocks of 16, 6-bit quants, int8 sub-block scales."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.rounding import F32, fp16, fp16_bytes, read_fp16

# ggml-quants.c GROUP_MAX_EPS: a group whose largest |x| is below this quantizes to zero
GROUP_MAX_EPS = F32(1e-15)


def nearest_int_c(f: np.ndarray) -> np.ndarray:
    """ggml ``nearest_int`` bit for bit: add 1.5 * 2**23, keep the low 23 bits, minus 2**22.

    Equals ``rounding.nearest_int`` (half to even) where ggml asserts it is valid,
    |f| <= 4194303, and also matches its release build outside that range and on inf / NaN
    (NaN gives 0), which happen when an fp16 super-block scale overflows to inf.
    """
    v = np.add(f, F32(12582912.0), dtype=F32).view(np.int32)
    v &= np.int32(0x007FFFFF)  # in place: this runs on every search step
    v -= np.int32(0x00400000)
    return v


def c_absmax(x: np.ndarray, axis: int) -> np.ndarray:
    """ggml's ``if (fabsf(v) > amax) { amax = fabsf(v); max = v; }`` scan from amax = 0.

    The signed value of the first strictly largest |x| along ``axis`` (kept as a length-1
    axis); NaNs never win, and +0.0 when nothing is > 0.
    """
    a = np.abs(x)
    a = np.where(np.isnan(a), F32(0), a)
    idx = np.expand_dims(np.argmax(a, axis=axis), axis)
    found = np.take_along_axis(a, idx, axis=axis) > 0
    return np.where(found, np.take_along_axis(x, idx, axis=axis), F32(0)).astype(F32)


def seq_sum_rows(t: np.ndarray) -> np.ndarray:
    """C's ``s = 0; for (i...) s += t[i]`` over axis 0, in float32, vectorised over the rest.

    Same values as ``rounding.seq_sum(t, axis=0)`` but dozens of times faster for a short
    axis 0: each step is one contiguous add instead of a strided cumsum.
    """
    acc = t[0] + F32(0)  # 0 + t[0], as C starts: turns -0.0 into +0.0
    for row in t[1:]:
        acc += row
    return acc


def make_qx_quants(xt: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml ``make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL)`` for many groups at once.

    ``xt`` is ``(n, groups)`` float32, one group per column: element-major, so each step of
    ggml's sequential loop over a group's n elements is one contiguous row. Returns ``L``
    ``(n, groups)`` uint8 in ``[0, 2*nmax)`` and the signed scales ``(groups,)`` float32.

    The symmetric scale search: start from iscale = -nmax/max (max = the signed value of
    largest magnitude), then try 18 nearby iscales and keep the one with the best weighted
    least-squares fit (weights x**2).
    """
    xt = np.asarray(xt, dtype=F32)
    mx = c_absmax(xt, axis=0)[0]
    zero = np.abs(mx) < GROUP_MAX_EPS
    mx = np.where(zero, F32(1), mx)  # the zero groups' results are overwritten below
    w = xt * xt
    wx = w * xt

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # C: sumlx += w*x[i]*l; suml2 += w*l*l, f32 in index order
        lq = np.clip(nearest_int_c(iscale * xt), -nmax, nmax - 1).astype(F32)
        return seq_sum_rows(wx * lq), seq_sum_rows(w * lq * lq)

    best_iscale = F32(-nmax) / mx
    sumlx, suml2 = fit(best_iscale)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            iscale = -(F32(nmax) + F32(0.1) * F32(step)) / mx
            sumlx, suml2 = fit(iscale)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            new_scale = sumlx / suml2
            best_iscale = np.where(better, iscale, best_iscale)
            scale = np.where(better, new_scale, scale)
            best = np.where(better, new_scale * sumlx, best)
    # L of the accepted iscale is the same expression ggml evaluates when it accepts it
    lq = np.clip(nearest_int_c(best_iscale * xt), -nmax, nmax - 1) + nmax
    lq = np.where(zero, 0, lq).astype(np.uint8)
    return lq, np.where(zero, F32(0), scale).astype(F32)


class Q6_K(QuantType, ggml_type=GGMLType.Q6_K, vec_dot_type="Q8_K"):
    """Super-block of 256 weights (16 sub-blocks of 16), 210 bytes::

        offset 0              128           192           208    210
              +--------------+-------------+-------------+------+
              | ql[128]      | qh[64]      | scales[16]  | d    |
              | low 4 bits   | high 2 bits | int8        | fp16 |
              +--------------+-------------+-------------+------+

    q[e] is a 6-bit value, e = 128n + 32k + l (half n in 0..1, quarter k in 0..3, l in
    0..31); its low nibble is in ql, its top two bits in qh::

                         bits 7..4           bits 3..0
        ql[64n + l]      q[128n + 64 + l]    q[128n + l]
        ql[64n + 32 + l] q[128n + 96 + l]    q[128n + 32 + l]

                         bits 7..6           5..4                3..2                1..0
        qh[32n + l]      q[128n + 96 + l]    q[128n + 64 + l]    q[128n + 32 + l]    q[128n + l]

    value[e] = (d * scales[e // 16]) * (q[e] - 32).
    """

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "ql": blocks[:, :128],
            "qh": blocks[:, 128:192],
            "scales": blocks[:, 192:208].view(np.int8),
            "d": read_fp16(blocks[:, 208:210]),
        }

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        ql = fields["ql"]
        nb = ql.shape[0]
        ql = xp.reshape(ql, (nb, 2, 2, 32))  # [n, 32-byte half of ql, l]
        lo = xp.concat([ql & 15, ql >> 4], axis=2)  # axis 2 is now k
        qh = xp.reshape(fields["qh"], (nb, 2, 1, 32))
        hi = xp.concat([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        # widen before subtracting 32: q6 is unsigned
        q = xp.astype(lo | (hi << 4), xp.float32) - 32.0
        scale = fields["d"] * xp.astype(fields["scales"], xp.float32)  # C: d * sc first
        y = xp.reshape(scale, (nb, 16, 1)) * xp.reshape(q, (nb, 16, 16))
        return xp.reshape(y, (nb, 256))

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        """quantize_row_q6_K_ref, all blocks at once."""
        cls._check_rounding(rounding)
        # C overflows silently: huge inputs give an inf fp16 d, then inf/NaN steps ggml takes too
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return cls._quantize(np.asarray(x, dtype=F32))

    @classmethod
    def _quantize(cls, x: np.ndarray) -> np.ndarray:
        nb = x.shape[0]
        xs = x.reshape(nb, 16, 16)
        lq, scales = make_qx_quants(np.ascontiguousarray(xs.reshape(-1, 16).T), 32)
        lq = lq.T.reshape(nb, 16, 16)
        scales = scales.reshape(nb, 16)

        max_scale = c_absmax(scales, axis=1)  # (nb, 1)
        zero = np.abs(max_scale) < GROUP_MAX_EPS  # such blocks are written as all-zero bytes
        iscale = F32(-128) / np.where(zero, F32(1), max_scale)
        d_raw = F32(1) / iscale
        # the largest |scale| maps to -128; the cap only clips a +128 from rounding
        sc = np.minimum(127, nearest_int_c(iscale * scales))
        # requantize against the stored fp16 d; a zero dd keeps make_qx_quants' L (stale)
        dd = fp16(d_raw) * sc.astype(F32)
        skip = dd == 0
        lr = nearest_int_c(xs / np.where(skip, F32(1), dd)[..., None])
        lq = np.where(skip[..., None], lq, np.clip(lr, -32, 31) + 32).astype(np.uint8)

        lq4 = lq.reshape(nb, 2, 4, 32)  # [n, k, l]
        ql = (lq4[:, :, :2] & 15) | ((lq4[:, :, 2:] & 15) << 4)  # [n, ql half, l]
        hi = (lq4 >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
        qh = hi[:, :, 0] | hi[:, :, 1] | hi[:, :, 2] | hi[:, :, 3]

        out = np.empty((nb, cls.type_size), dtype=np.uint8)
        out[:, :128] = ql.reshape(nb, 128)
        out[:, 128:192] = qh.reshape(nb, 64)
        out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
        out[:, 208:] = fp16_bytes(d_raw)
        out[zero[:, 0]] = 0
        return out
