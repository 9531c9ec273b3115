"""Q2_K: 256 weights in sixteen 16-sub-blocks, 2-bit values with 4-bit scales and mins."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants import weighted
from qllama.quants.base import Fields, IntegerForm, QuantType, Rounding
from qllama.quants.kquant_search import requantize, search_sub_blocks, super_scale
from qllama.quants.rounding import F32, fp16_bytes, read_fp16


class Q2_K(QuantType, ggml_type=GGMLType.Q2_K, vec_dot_type="Q8_K"):
    """Super-block of 256 weights, 84 bytes; ``d`` and ``dmin`` come last::

        offset  0             16                               80     82     84
               +-------------+--------------------------------+------+------+
               | scales[16]  | qs[64]  four 2-bit values/byte | d    | dmin |
               | m:4 | sc:4  |                                | fp16 | fp16 |
               +-------------+--------------------------------+------+------+

    ``scales[s]`` of sub-block ``s``: bits 0-3 the scale ``sc``, bits 4-7 the min ``m``::

        bit   7 6 5 4 3 2 1 0
              m m m m s s s s

    Element ``e = 128n + 32j + l`` is bits ``2j, 2j+1`` of ``qs[32n + l]``, in sub-block
    ``e // 16``. value = (d * sc) * q - (dmin * m).
    """

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "scales": blocks[:, 0:16],
            "qs": blocks[:, 16:80],
            "d": read_fp16(blocks[:, 80:82]),
            "dmin": read_fp16(blocks[:, 82:84]),
        }

    @classmethod
    def codes(cls, fields: Fields, *, xp: Any) -> Any:
        """The 2-bit value of each element, ``(n, 16, 16)`` uint8 by sub-block."""
        qs = xp.reshape(fields["qs"], (fields["qs"].shape[0], 2, 32))
        q = xp.stack([(qs >> (2 * j)) & 3 for j in range(4)], axis=2)
        return xp.reshape(q, (qs.shape[0], 16, 16))

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        n = fields["qs"].shape[0]
        scales = fields["scales"]
        d = fields["d"] * xp.astype(scales & 15, xp.float32)
        dm = fields["dmin"] * xp.astype(scales >> 4, xp.float32)
        q = xp.astype(cls.codes(fields, xp=xp), xp.float32)
        y = xp.reshape(d, (n, 16, 1)) * q - xp.reshape(dm, (n, 16, 1))
        return xp.reshape(y, (n, 256))

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        scales = fields["scales"]
        return IntegerForm(
            q=cls.codes(fields, xp=np).reshape(-1, 256).astype(np.int8),
            d=fields["d"],
            scales=scales & 15,
            mins=scales >> 4,
            dmin=fields["dmin"],
            bound=15 * 3,
        )

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        nb = x.shape[0]
        lq, scales, mins = search_sub_blocks(
            x, np.abs(x), 16, nmax=3, rmin=-0.5, rdelta=0.1, nstep=15, use_mad=True
        )
        ls, d = super_scale(scales, 15)
        lm, dmin = super_scale(mins, 15)
        # ggml stores the int scale into the byte, then ORs in min << 4: both wrap to 8 bits
        packed = ((ls & 0xFF) | ((lm << 4) & 0xFF)).astype(np.uint8)
        dd = d * (packed & 15).astype(F32)
        dm = dmin * (packed >> 4).astype(F32)
        lq = requantize(x.reshape(nb, 16, 16), dd, lq, lo=0, hi=3, dm=dm)
        return cls._pack(packed, lq, d, dmin)

    @classmethod
    def quantize_blocks_weighted(cls, x: np.ndarray, qw: np.ndarray) -> np.ndarray:
        """quantize_row_q2_K_impl."""
        return cls._pack(*weighted.q2_k(x, qw))

    @classmethod
    def _pack(
        cls, packed: np.ndarray, lq: np.ndarray, d: np.ndarray, dmin: np.ndarray
    ) -> np.ndarray:
        """Scale bytes ``(n, 16)``, L ``(n, 16, 16)``, float32 d and dmin ``(n, 1)`` -> bytes."""
        nb = lq.shape[0]
        # (nb, 2, 4, 32): the four 32-runs of a 128 half share bytes, run j at bits 2j
        runs = lq.reshape(nb, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[:, None]
        out = np.empty((nb, cls.type_size), dtype=np.uint8)
        out[:, 0:16] = packed
        out[:, 16:80] = np.bitwise_or.reduce(runs, axis=2).reshape(nb, 64)
        out[:, 80:82] = fp16_bytes(d)
        out[:, 82:84] = fp16_bytes(dmin)
        return out
