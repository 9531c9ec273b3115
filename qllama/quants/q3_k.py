"""Q3_K: 256 weights in 16 sub-blocks of 16, 3-bit quants, 6-bit sub-block scales."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants import weighted
from qllama.quants.base import Fields, IntegerForm, QuantType, Rounding
from qllama.quants.kquant_search import make_q3_quants, quantize_groups_16, requantize
from qllama.quants.rounding import F32, first_absmax, fp16, fp16_bytes, nearest_int, read_fp16

_SHIFTS_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8)
_SHIFTS_1BIT = np.arange(8, dtype=np.uint8)


def _scales_and_bytes(xs: np.ndarray, lq: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The 6-bit group scales under one fp16 super-scale, L requantized against the stored
    scales, and the Q3_K bytes, from the search's ``(n, 16, 16)`` x and L and ``(n, 16)``
    group scales."""
    # ggml tests max_scale != 0 here (no epsilon); a zero one leaves the scale bytes 0
    max_scale = first_absmax(scales, axis=1)
    has = max_scale != 0
    iscale = F32(-32) / np.where(has, max_scale, F32(1))
    ls = np.where(has, np.clip(nearest_int(iscale * scales), -32, 31) + 32, 0)
    d_raw = np.where(has, F32(1) / iscale, F32(0))
    return _pack(xs, lq, ls, d_raw)


def _pack(xs: np.ndarray, lq: np.ndarray, ls: np.ndarray, d_raw: np.ndarray) -> np.ndarray:
    """x and the search's L ``(n, 16, 16)``, the 6-bit scales ``(n, 16)`` (offset 32) and the
    float32 d ``(n, 1)`` -> L requantized against the stored scales, and the Q3_K bytes."""
    nb = xs.shape[0]
    # requantize against the stored scales; a zero dd keeps the search's L (stale)
    dd = fp16(d_raw) * (ls - 32).astype(F32)
    lq = requantize(xs, dd, lq, lo=-4, hi=3)

    ls = ls.astype(np.uint8)
    lq = lq.reshape(nb, 256)
    out = np.empty((nb, Q3_K.type_size), dtype=np.uint8)
    high = (lq >> 2).reshape(nb, 8, 32) << _SHIFTS_1BIT[:, None]
    out[:, :32] = np.bitwise_or.reduce(high, axis=1)
    low = (lq & 3).reshape(nb, 2, 4, 32) << _SHIFTS_2BIT[:, None]
    out[:, 32:96] = np.bitwise_or.reduce(low, axis=2).reshape(nb, 64)
    out[:, 96:104] = (ls[:, :8] & 15) | ((ls[:, 8:] & 15) << 4)
    top = (ls >> 4).reshape(nb, 4, 4) << _SHIFTS_2BIT[:, None]
    out[:, 104:108] = np.bitwise_or.reduce(top, axis=1)
    out[:, 108:] = fp16_bytes(d_raw)
    return out


class Q3_K(QuantType, ggml_type=GGMLType.Q3_K, vec_dot_type="Q8_K"):
    """Super-block of 256 weights (16 sub-blocks of 16), 110 bytes::

        offset 0            32             96            108    110
              +------------+--------------+-------------+------+
              | hmask[32]  | qs[64]       | scales[12]  | d    |
              | high bits  | low 2 bits   | 16 x 6 bits | fp16 |
              +------------+--------------+-------------+------+

    q[e] is a 3-bit value, e = 128n + 32j + l (half n in 0..1, j in 0..3, l in 0..31)::

                       bits 7..6          5..4               3..2               1..0
        qs[32n + l]    q[128n + 96 + l]   q[128n + 64 + l]   q[128n + 32 + l]   q[128n + l]

                       bit 7        6            ...   1           0
        hmask[l]       q[224 + l]   q[192 + l]   ...   q[32 + l]   q[l]       (bit 2 of q)

    Sub-block scale s[i], i = e // 16, 6 bits (b = 0..3 in each row)::

                       bits 7..6       5..4           3..2           1..0
        scales[b]      s[b + 8] bits 3..0             s[b] bits 3..0
        scales[4 + b]  s[b + 12] bits 3..0            s[b + 4] bits 3..0
        scales[8 + b]  s[b + 12] 5..4  s[b + 8] 5..4  s[b + 4] 5..4  s[b] 5..4

    value[e] = (d * (s[e // 16] - 32)) * (q[e] - 4).
    """

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "hmask": blocks[:, :32],
            "qs": blocks[:, 32:96],
            "scales": blocks[:, 96:108],
            "d": read_fp16(blocks[:, 108:110]),
        }

    @classmethod
    def codes(cls, fields: Fields, *, xp: Any) -> tuple[Any, Any]:
        """The unsigned 3-bit value of each element ``(n, 16, 16)`` and the unsigned 6-bit
        scale of each sub-block ``(n, 16)``, uint8 both (ggml subtracts 4 and 32)."""
        s = fields["scales"]
        nb = s.shape[0]
        lo = xp.concat([s[:, :8] & 15, s[:, :8] >> 4], axis=1)
        top = s[:, 8:]
        hi = xp.concat([(top >> k) & 3 for k in (0, 2, 4, 6)], axis=1)
        qs = xp.reshape(fields["qs"], (nb, 2, 1, 32))
        low = xp.reshape(xp.concat([(qs >> k) & 3 for k in (0, 2, 4, 6)], axis=2), (nb, 256))
        hm = xp.reshape(fields["hmask"], (nb, 1, 32))
        high = xp.reshape(xp.concat([(hm >> b) & 1 for b in range(8)], axis=1), (nb, 256))
        return xp.reshape(low | (high << 2), (nb, 16, 16)), lo | (hi << 4)

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        q, sc = cls.codes(fields, xp=xp)
        nb = sc.shape[0]
        # widen before subtracting: both the scale and q are stored offset, unsigned
        dl = fields["d"] * (xp.astype(sc, xp.float32) - 32.0)  # C: dl = d_all * (sc - 32)
        y = xp.reshape(dl, (nb, 16, 1)) * (xp.astype(q, xp.float32) - 4.0)
        return xp.reshape(y, (nb, 256))

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        q, sc = cls.codes(fields, xp=np)
        return IntegerForm(
            q=q.reshape(-1, 256).astype(np.int8) - np.int8(4),
            d=fields["d"],
            scales=sc.astype(np.int8) - np.int8(32),
            bound=32 * 4,
            lanes=8,
        )

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        """quantize_row_q3_K_ref, all blocks at once."""
        cls._check_rounding(rounding)
        return quantize_groups_16(np.asarray(x, dtype=F32), make_q3_quants, 4, _scales_and_bytes)

    @classmethod
    def quantize_blocks_weighted(cls, x: np.ndarray, qw: np.ndarray) -> np.ndarray:
        """quantize_row_q3_K_impl: the group and scale fits both make_qx_quants, weighted."""
        lq, ls, d = weighted.q3_k(x, qw)
        return _pack(x.reshape(-1, 16, 16), lq, ls, d)
