"""Q8_0: 32 int8 values and one fp16 scale."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.rounding import F32, fp16_bytes, read_fp16, round_away, safe_reciprocal


class Q8_0(QuantType, ggml_type=GGMLType.Q8_0, vec_dot_type="Q8_0"):
    """Block of 32 weights, 34 bytes::

        offset  0      2                                   34
               +------+------------------------------------+
               | d    | qs[32]  int8                       |
               | fp16 |                                    |
               +------+------------------------------------+

    value[j] = qs[j] * d. Also the activation type of Q4_0, Q5_0 and Q8_0 weights.
    """

    roundings = ("ref", "simd")

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {"d": read_fp16(blocks[:, :2]), "qs": blocks[:, 2:].view(np.int8)}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        return xp.astype(fields["qs"], xp.float32) * fields["d"]

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        amax = np.max(np.abs(x), axis=1, keepdims=True)
        d = amax / F32(127)
        if rounding == "ref":
            # quantize_row_q8_0_ref: roundf (ties away) with the f32 d, not the stored fp16 one
            q = round_away(x * safe_reciprocal(d))
        else:
            # AVX2 from_float: id = 127/amax and _mm256_round_ps (ties to even)
            with np.errstate(divide="ignore"):
                iscale = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
            q = np.rint(x * iscale)
        out = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :2] = fp16_bytes(d)
        out[:, 2:] = q.astype(np.int8).view(np.uint8)
        return out
