"""Q1_0: 128 weights as signs, times the block's mean |x| (1.125 bits a weight)."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, IntegerForm, QuantType, Rounding
from qllama.quants.rounding import F32, c_sum, fp16_bytes, read_fp16


class Q1_0(QuantType, ggml_type=GGMLType.Q1_0, vec_dot_type="Q8_0"):
    """Block of 128 weights, 18 bytes::

        offset  0      2                                    18
               +------+------------------------------------+
               | d    | qs[16]: bit j % 8 of qs[j // 8]    |
               | fp16 | is 1 where x[j] >= 0               |
               +------+------------------------------------+

    value = +d where the bit is set, -d where not; d = sum(|x|) / 128 (summed in order).
    -0.0 counts as >= 0. Its dot product spans four Q8_0 blocks: ggml adds
    ``y.d * sumi`` of each in float32, then multiplies the sum by d. An importance matrix
    changes nothing (ggml ignores it).
    """

    imatrix_use = "ignored"  # ggml_quantize_chunk gives the same bytes with one

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        # ggml widens fp16 with a multiply, which quiets a signalling NaN; the other types
        # multiply the scale again, Q1_0 only selects it
        d = read_fp16(blocks[:, :2])
        quiet = (d.view(np.uint32) | np.uint32(0x00400000)).view(F32)
        return {"d": np.where(np.isnan(d), quiet, d), "qs": blocks[:, 2:]}

    @classmethod
    def bits(cls, fields: Fields, *, xp: Any) -> Any:
        """``(n, 128)`` uint8: 1 where element j's bit is set."""
        qs = fields["qs"]
        bits = xp.stack([(qs >> k) & 1 for k in range(8)], axis=-1)  # (n, 16 bytes, 8 bits)
        return xp.reshape(bits, (qs.shape[0], 128))

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        d = fields["d"]
        return xp.where(cls.bits(fields, xp=xp) == 1, d, -d)

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        n = fields["qs"].shape[0]
        q = (2 * cls.bits(fields, xp=np).astype(np.int8) - 1).reshape(n * 4, 32)
        return IntegerForm(q=q, d=np.repeat(fields["d"], 4, axis=0), bound=1, group=4)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        """quantize_row_q1_0_ref, every block at once."""
        cls._check_rounding(rounding)
        d = c_sum(np.ascontiguousarray(np.abs(x).T)) / F32(128)
        out = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :2] = fp16_bytes(d.reshape(-1, 1))
        out[:, 2:] = np.packbits(x >= 0, axis=1, bitorder="little")
        return out
