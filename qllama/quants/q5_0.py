"""Q5_0: 32 5-bit values, offset by 16, and one fp16 scale."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants import weighted
from qllama.quants.base import Fields, IntegerForm, QuantType, Rounding
from qllama.quants.nibbles import codes, pack_fifth_bits, pack_nibbles, quantize_symmetric
from qllama.quants.rounding import fp16_bytes, read_fp16


class Q5_0(QuantType, ggml_type=GGMLType.Q5_0, vec_dot_type="Q8_0"):
    """Block of 32 weights, 22 bytes::

        offset  0      2           6                    22
               +------+-----------+--------------------+
               | d    | qh[4]     | qs[16]             |
               | fp16 | bit e of  | lo: 0..15          |
               |      | LE u32 =  | hi: 16..31         |
               |      | q[e] >> 4 |                    |
               +------+-----------+--------------------+

    q = nibble | fifth bit << 4; value = (q - 16) * d.
    """

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {"d": read_fp16(blocks[:, :2]), "qh": blocks[:, 2:6], "qs": blocks[:, 6:]}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        return (xp.astype(codes(fields, xp=xp), xp.float32) - 16.0) * fields["d"]

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        q = codes(fields, xp=np).astype(np.int8) - np.int8(16)
        return IntegerForm(q=q, d=fields["d"], bound=16)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        return cls._pack(*quantize_symmetric(x, 31))

    @classmethod
    def quantize_weighted(cls, rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
        """quantize_row_q5_0_impl: make_qx_quants(32, 16, ...) on weights over the row."""
        return weighted.legacy_rows(rows, imatrix, 16, cls._pack, offset=False)

    @classmethod
    def _pack(cls, d: np.ndarray, q: np.ndarray) -> np.ndarray:
        """The float32 scales ``(n, 1)`` and 5-bit codes ``(n, 32)`` -> bytes."""
        out = np.empty((q.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :2] = fp16_bytes(d)
        out[:, 2:6] = pack_fifth_bits(q)
        out[:, 6:] = pack_nibbles(q & 0x0F)
        return out
