"""Q5_K: 256 weights in eight 32-sub-blocks, 5-bit values with 6-bit scales and mins."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants import weighted
from qllama.quants.base import Fields, IntegerForm, QuantType, Rounding
from qllama.quants.kquant_search import (
    dequantize_k4,
    integer_form_k4,
    nibbles_k4,
    pack_nibbles_k4,
    quantize_k4,
)
from qllama.quants.rounding import read_fp16


class Q5_K(QuantType, ggml_type=GGMLType.Q5_K, vec_dot_type="Q8_K"):
    """Super-block of 256 weights, 176 bytes::

        offset  0      2      4             16          48                      176
               +------+------+-------------+-----------+------------------------+
               | d    | dmin | scales[12]  | qh[32]    | qs[128]                |
               | fp16 | fp16 | 8 sc, 8 m   | 5th bits  | low 4 bits, 2 a byte   |
               +------+------+-------------+-----------+------------------------+

    Scales and the nibble order of ``qs`` are Q4_K's (bit diagram in
    :func:`qllama.quants.kquant_search.scale_min_k4`). The fifth bit of element ``64c + l``
    is bit ``2c`` of ``qh[l]``, of element ``64c + 32 + l`` bit ``2c + 1``.
    value = (d * sc) * q - (dmin * m), q in [0, 31].
    """

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "d": read_fp16(blocks[:, 0:2]),
            "dmin": read_fp16(blocks[:, 2:4]),
            "scales": blocks[:, 4:16],
            "qh": blocks[:, 16:48],
            "qs": blocks[:, 48:176],
        }

    @classmethod
    def codes(cls, fields: Fields, *, xp: Any) -> Any:
        """The unsigned 5-bit value of each element, ``(n, 8, 32)`` uint8 by sub-block."""
        n = fields["qs"].shape[0]
        # sub-block s takes its fifth bit from bit s of qh[l]
        qh = xp.reshape(fields["qh"], (n, 1, 32))
        top = xp.concat([(qh >> s) & 1 for s in range(8)], axis=1)
        return nibbles_k4(fields["qs"], xp=xp) | (top << 4)

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        return dequantize_k4(fields, cls.codes(fields, xp=xp), xp=xp)

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        return integer_form_k4(fields, cls.codes(fields, xp=np), bound=63 * 31)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        return cls._pack(*quantize_k4(x, nmax=31, rmin=-0.5, nstep=15))

    @classmethod
    def quantize_blocks_weighted(cls, x: np.ndarray, qw: np.ndarray) -> np.ndarray:
        """quantize_row_q5_K_impl."""
        return cls._pack(*weighted.k4(x, qw, nmax=31))

    @classmethod
    def _pack(cls, header: np.ndarray, lq: np.ndarray) -> np.ndarray:
        """The 16 header bytes and L ``(n, 8, 32)`` -> bytes."""
        # (nb, 8, 32): the fifth bit of sub-block s becomes bit s of qh
        qh = np.bitwise_or.reduce((lq >> 4) << np.arange(8, dtype=np.uint8)[:, None], axis=1)
        return np.concatenate([header, qh, pack_nibbles_k4(lq & 15)], axis=1)
