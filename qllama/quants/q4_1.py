"""Q4_1: 32 4-bit values, an fp16 scale and an fp16 minimum."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.f16 import ggml_fp16_bytes
from qllama.quants.nibbles import (
    c_int32,
    min_max,
    pack_nibbles,
    scale_and_offset,
    split_nibbles,
)
from qllama.quants.rounding import F32, read_fp16, safe_reciprocal


class Q4_1(QuantType, ggml_type=GGMLType.Q4_1, vec_dot_type="Q8_1"):
    """Block of 32 weights, 20 bytes::

        offset  0      2      4                    20
               +------+------+--------------------+
               | d    | m    | qs[16]             |
               | fp16 | fp16 | lo: 0..15          |
               |      |      | hi: 16..31         |
               +------+------+--------------------+

    value = q * d + m (two roundings, no FMA), with m the block minimum.
    """

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "d": read_fp16(blocks[:, :2]),
            "m": read_fp16(blocks[:, 2:4]),
            "qs": blocks[:, 4:],
        }

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        q = split_nibbles(fields["qs"], xp=xp)
        return scale_and_offset(q, fields["d"], fields["m"], xp=xp)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        mn, mx = min_max(x)
        # quantized against the f32 min and d, not the stored fp16 ones; clamped at 15.
        # Infinities and overflow make NaNs silently in C, and here.
        with np.errstate(over="ignore", invalid="ignore"):
            d = (mx - mn) / F32(15)
            t = (x - mn) * safe_reciprocal(d) + F32(0.5)
        q = np.minimum(c_int32(t).astype(np.int8), 15).astype(np.uint8)
        out = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :2] = ggml_fp16_bytes(d)
        out[:, 2:4] = ggml_fp16_bytes(mn)
        out[:, 4:] = pack_nibbles(q)
        return out
