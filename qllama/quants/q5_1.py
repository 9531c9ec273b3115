"""Q5_1: 32 5-bit values, an fp16 scale and an fp16 minimum."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants import weighted
from qllama.quants.base import Fields, IntegerForm, QuantType, Rounding
from qllama.quants.nibbles import (
    codes,
    pack_fifth_bits,
    pack_nibbles,
    quantize_offset,
    scale_and_offset,
)
from qllama.quants.rounding import fp16_bytes, read_fp16


class Q5_1(QuantType, ggml_type=GGMLType.Q5_1, vec_dot_type="Q8_1"):
    """Block of 32 weights, 24 bytes::

        offset  0      2      4           8                    24
               +------+------+-----------+--------------------+
               | d    | m    | qh[4]     | qs[16]             |
               | fp16 | fp16 | bit e of  | lo: 0..15          |
               |      |      | LE u32 =  | hi: 16..31         |
               |      |      | q[e] >> 4 |                    |
               +------+------+-----------+--------------------+

    q = nibble | fifth bit << 4; value = q * d + m (two roundings, no FMA).
    """

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "d": read_fp16(blocks[:, :2]),
            "m": read_fp16(blocks[:, 2:4]),
            "qh": blocks[:, 4:8],
            "qs": blocks[:, 8:],
        }

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        return scale_and_offset(codes(fields, xp=xp), fields["d"], fields["m"], xp=xp)

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        q = codes(fields, xp=np).astype(np.int8)
        return IntegerForm(q=q, d=fields["d"], m=fields["m"], bound=31)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        return cls._pack(*quantize_offset(x, 31, capped=False))

    @classmethod
    def quantize_weighted(cls, rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
        """quantize_row_q5_1_impl: make_qkx3_quants(32, 31, ...) on weights over the row."""
        return weighted.legacy_rows(rows, imatrix, 31, cls._pack, offset=True)

    @classmethod
    def _pack(cls, d: np.ndarray, mn: np.ndarray, q: np.ndarray) -> np.ndarray:
        """The float32 scales and mins ``(n, 1)`` and 5-bit codes ``(n, 32)`` -> bytes."""
        out = np.empty((q.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :2] = fp16_bytes(d)
        out[:, 2:4] = fp16_bytes(mn)
        out[:, 4:8] = pack_fifth_bits(q)
        out[:, 8:] = pack_nibbles(q & 0x0F)
        return out
