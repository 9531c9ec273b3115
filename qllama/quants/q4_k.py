"""Q4_K: 256 weights in eight 32-sub-blocks, 4-bit values with 6-bit scales and mins."""

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


class Q4_K(QuantType, ggml_type=GGMLType.Q4_K, vec_dot_type="Q8_K"):
    """Super-block of 256 weights, 144 bytes::

        offset  0      2      4             16                                  144
               +------+------+-------------+------------------------------------+
               | d    | dmin | scales[12]  | qs[128]  two 4-bit values a byte   |
               | fp16 | fp16 | 8 sc, 8 m   |                                    |
               +------+------+-------------+------------------------------------+

    ``scales`` packs eight 6-bit scales ``sc`` and mins ``m``, one pair per 32-sub-block (bit
    diagram in :func:`qllama.quants.kquant_search.scale_min_k4`). Element ``64c + l`` is the
    low nibble of ``qs[32c + l]`` (sub-block ``2c``), element ``64c + 32 + l`` its high nibble
    (sub-block ``2c + 1``). value = (d * sc) * q - (dmin * m).
    """

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "d": read_fp16(blocks[:, 0:2]),
            "dmin": read_fp16(blocks[:, 2:4]),
            "scales": blocks[:, 4:16],
            "qs": blocks[:, 16:144],
        }

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        return dequantize_k4(fields, nibbles_k4(fields["qs"], xp=xp), xp=xp)

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        return integer_form_k4(fields, nibbles_k4(fields["qs"], xp=np), bound=63 * 15)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        header, lq = quantize_k4(x, nmax=15, rmin=-1.0, nstep=20)
        return np.concatenate([header, pack_nibbles_k4(lq)], axis=1)

    @classmethod
    def quantize_blocks_weighted(cls, x: np.ndarray, qw: np.ndarray) -> np.ndarray:
        """quantize_row_q4_K_impl."""
        header, lq = weighted.k4(x, qw, nmax=15)
        return np.concatenate([header, pack_nibbles_k4(lq)], axis=1)
