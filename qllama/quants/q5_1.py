"""Q5_1: 32 5-bit values, an fp16 scale and an fp16 minimum."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.f16 import ggml_fp16_bytes
from qllama.quants.nibbles import (
    c_int32,
    fifth_bits,
    min_max,
    pack_fifth_bits,
    pack_nibbles,
    scale_and_offset,
    split_nibbles,
)
from qllama.quants.rounding import F32, read_fp16, safe_reciprocal


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
        q = split_nibbles(fields["qs"], xp=xp) | fifth_bits(fields["qh"], xp=xp)
        return scale_and_offset(q, fields["d"], fields["m"], xp=xp)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        mn, mx = min_max(x)
        # (uint8_t)((x - min)*id + 0.5f): unlike Q4_1 no clamp; the low byte is kept
        with np.errstate(over="ignore", invalid="ignore"):
            d = (mx - mn) / F32(31)
            t = (x - mn) * safe_reciprocal(d) + F32(0.5)
        q = c_int32(t).astype(np.uint8)
        out = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :2] = ggml_fp16_bytes(d)
        out[:, 2:4] = ggml_fp16_bytes(mn)
        out[:, 4:8] = pack_fifth_bits(q)
        out[:, 8:] = pack_nibbles(q & 0x0F)
        return out
