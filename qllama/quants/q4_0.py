"""Q4_0: 32 4-bit values, offset by 8, and one fp16 scale."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants import weighted
from qllama.quants.base import Fields, IntegerForm, QuantType, Rounding
from qllama.quants.nibbles import codes, pack_nibbles, quantize_symmetric
from qllama.quants.rounding import fp16_bytes, read_fp16


class Q4_0(QuantType, ggml_type=GGMLType.Q4_0, vec_dot_type="Q8_0"):
    """Block of 32 weights, 18 bytes::

        offset  0      2                    18
               +------+--------------------+
               | d    | qs[16]             |
               | fp16 | lo: 0..15          |
               |      | hi: 16..31         |
               +------+--------------------+

    qs[j] holds element j in its low nibble and element j+16 in its high one;
    value = (q - 8) * d.
    """

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {"d": read_fp16(blocks[:, :2]), "qs": blocks[:, 2:]}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        return (xp.astype(codes(fields, xp=xp), xp.float32) - 8.0) * fields["d"]

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        q = codes(fields, xp=np).astype(np.int8) - np.int8(8)
        return IntegerForm(q=q, d=fields["d"], bound=8, sumi_first=True)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        return cls._pack(*quantize_symmetric(x, 15))

    @classmethod
    def quantize_weighted(cls, rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
        """quantize_row_q4_0_impl: make_qx_quants(32, 8, ...) on weights over the row."""
        return weighted.legacy_rows(rows, imatrix, 8, cls._pack, offset=False)

    @classmethod
    def _pack(cls, d: np.ndarray, q: np.ndarray) -> np.ndarray:
        """The float32 scales ``(n, 1)`` and codes ``(n, 32)`` -> bytes."""
        out = np.empty((q.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :2] = fp16_bytes(d)
        out[:, 2:] = pack_nibbles(q)
        return out
