"""Q5_0: 32 5-bit values, offset by 16, and one fp16 scale."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.f16 import ggml_fp16_bytes
from qllama.quants.nibbles import (
    c_int32,
    fifth_bits,
    pack_fifth_bits,
    pack_nibbles,
    signed_absmax,
    split_nibbles,
)
from qllama.quants.rounding import F32, read_fp16, safe_reciprocal


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

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {"d": read_fp16(blocks[:, :2]), "qh": blocks[:, 2:6], "qs": blocks[:, 6:]}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        q = split_nibbles(fields["qs"], xp=xp) | fifth_bits(fields["qh"], xp=xp)
        return (xp.astype(q, xp.float32) - 16.0) * fields["d"]

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        d = signed_absmax(x) / F32(-16)
        # (int8_t)(x*id + 16.5f), no FMA on x86: round half up, as Q4_0
        with np.errstate(over="ignore", invalid="ignore"):
            t = x * safe_reciprocal(d) + F32(16.5)
        q = np.minimum(c_int32(t).astype(np.int8), 31).astype(np.uint8)
        out = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :2] = ggml_fp16_bytes(d)
        out[:, 2:6] = pack_fifth_bits(q)
        out[:, 6:] = pack_nibbles(q & 0x0F)
        return out
