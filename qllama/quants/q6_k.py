"""Q6_K: 256 weights in 16 sub-blocks of 16, 6-bit quants, int8 sub-block scales."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants import weighted
from qllama.quants.base import Fields, IntegerForm, QuantType, Rounding
from qllama.quants.kquant_search import (
    GROUP_MAX_EPS,
    make_qx_quants,
    quantize_groups_16,
    requantize,
)
from qllama.quants.rounding import F32, first_absmax, fp16, fp16_bytes, nearest_int, read_fp16


def _scales_and_bytes(xs: np.ndarray, lq: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The int8 group scales under one fp16 super-scale, L requantized against the stored
    scales, and the Q6_K bytes, from the search's ``(n, 16, 16)`` x and L and ``(n, 16)``
    group scales."""
    nb = xs.shape[0]
    max_scale = first_absmax(scales, axis=1)  # (nb, 1)
    zero = np.abs(max_scale) < GROUP_MAX_EPS  # such blocks are written as all-zero bytes
    iscale = F32(-128) / np.where(zero, F32(1), max_scale)
    d_raw = F32(1) / iscale
    # the largest |scale| maps to -128; the cap only clips a +128 from rounding
    sc = np.minimum(127, nearest_int(iscale * scales))
    # requantize against the stored fp16 d; a zero dd keeps make_qx_quants' L (stale)
    dd = fp16(d_raw) * sc.astype(F32)
    lq = requantize(xs, dd, lq, lo=-32, hi=31)

    lq4 = lq.reshape(nb, 2, 4, 32)  # [n, k, l]
    ql = (lq4[:, :, :2] & 15) | ((lq4[:, :, 2:] & 15) << 4)  # [n, ql half, l]
    hi = (lq4 >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    qh = hi[:, :, 0] | hi[:, :, 1] | hi[:, :, 2] | hi[:, :, 3]

    out = np.empty((nb, Q6_K.type_size), dtype=np.uint8)
    out[:, :128] = ql.reshape(nb, 128)
    out[:, 128:192] = qh.reshape(nb, 64)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:] = fp16_bytes(d_raw)
    out[zero[:, 0]] = 0
    return out


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

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "ql": blocks[:, :128],
            "qh": blocks[:, 128:192],
            "scales": blocks[:, 192:208].view(np.int8),
            "d": read_fp16(blocks[:, 208:210]),
        }

    @classmethod
    def codes(cls, fields: Fields, *, xp: Any) -> Any:
        """The unsigned 6-bit value of each element, ``(n, 16, 16)`` uint8 by sub-block."""
        ql = fields["ql"]
        nb = ql.shape[0]
        ql = xp.reshape(ql, (nb, 2, 2, 32))  # [n, 32-byte half of ql, l]
        lo = xp.concat([ql & 15, ql >> 4], axis=2)  # axis 2 is now k
        qh = xp.reshape(fields["qh"], (nb, 2, 1, 32))
        hi = xp.concat([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        return xp.reshape(lo | (hi << 4), (nb, 16, 16))

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        nb = fields["ql"].shape[0]
        # widen before subtracting 32: q6 is unsigned
        q = xp.astype(cls.codes(fields, xp=xp), xp.float32) - 32.0
        scale = fields["d"] * xp.astype(fields["scales"], xp.float32)  # C: d * sc first
        return xp.reshape(xp.reshape(scale, (nb, 16, 1)) * q, (nb, 256))

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        q = cls.codes(fields, xp=np).astype(np.int8) - np.int8(32)
        return IntegerForm(
            q=q.reshape(-1, 256), d=fields["d"], scales=fields["scales"], bound=128 * 32, lanes=8
        )

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        """quantize_row_q6_K_ref, all blocks at once."""
        cls._check_rounding(rounding)
        return quantize_groups_16(np.asarray(x, dtype=F32), make_qx_quants, 32, _scales_and_bytes)

    @classmethod
    def quantize_blocks_weighted(cls, x: np.ndarray, qw: np.ndarray) -> np.ndarray:
        """quantize_row_q6_K_impl: the reference with ``qw`` as make_qx_quants' weights."""
        return _scales_and_bytes(*weighted.q6_k(x, qw))
