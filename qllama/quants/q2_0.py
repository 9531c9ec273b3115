"""Q2_0: 64 weights as 2-bit codes for -1, 0, +1 (+2) times the block's largest |x|."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, IntegerForm, QuantType, Rounding
from qllama.quants.fp4 import nonnan_absmax
from qllama.quants.rounding import F32, c_int32, fp16_bytes, read_fp16, round_away

_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)


class Q2_0(QuantType, ggml_type=GGMLType.Q2_0, vec_dot_type="Q8_0"):
    """Block of 64 weights, 18 bytes::

        offset  0      2                                    18
               +------+------------------------------------+
               | d    | qs[16]: element j at bits          |
               | fp16 | 2(j % 4), 2(j % 4)+1 of qs[j // 4] |
               +------+------------------------------------+

    value = (q - 1) * d, q = clamp(roundf(x / d) + 1, 0, 3) (ties away from zero; the code 3,
    +2d, is never written since |x| <= d). Its dot product spans two Q8_0 blocks, summed as
    Q1_0's is. An importance matrix changes nothing (ggml ignores it).
    """

    imatrix_use = "ignored"  # ggml_quantize_chunk gives the same bytes with one

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {"d": read_fp16(blocks[:, :2]), "qs": blocks[:, 2:]}

    @classmethod
    def codes(cls, fields: Fields, *, xp: Any) -> Any:
        """``(n, 64)`` uint8 codes 0..3."""
        qs = fields["qs"]
        q = xp.stack([(qs >> (2 * k)) & 3 for k in range(4)], axis=-1)  # (n, 16 bytes, 4)
        return xp.reshape(q, (qs.shape[0], 64))

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        q = xp.astype(cls.codes(fields, xp=xp), xp.int16) - 1
        return xp.astype(q, xp.float32) * fields["d"]  # C: ((int)q - 1) * d

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        n = fields["qs"].shape[0]
        q = (cls.codes(fields, xp=np).astype(np.int8) - np.int8(1)).reshape(n * 2, 32)
        return IntegerForm(q=q, d=np.repeat(fields["d"], 2, axis=0), bound=2, group=2)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        """quantize_row_q2_0_ref, every block at once."""
        cls._check_rounding(rounding)
        n = x.shape[0]
        d = nonnan_absmax(x, axis=1)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            inv = np.where(d > 0, F32(1) / np.where(d > 0, d, F32(1)), F32(0))
            q = np.clip(c_int32(round_away(x * inv)).astype(np.int64) + 1, 0, 3).astype(np.uint8)
        out = np.empty((n, cls.type_size), dtype=np.uint8)
        out[:, :2] = fp16_bytes(d)
        out[:, 2:] = np.bitwise_or.reduce(q.reshape(n, 16, 4) << _SHIFTS, axis=2)
        return out
