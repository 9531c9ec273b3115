"""Q4_0: 32 4-bit values, offset by 8, and one fp16 scale."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.f16 import ggml_fp16_bytes
from qllama.quants.nibbles import c_int32, pack_nibbles, signed_absmax, split_nibbles
from qllama.quants.rounding import F32, read_fp16, safe_reciprocal


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

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {"d": read_fp16(blocks[:, :2]), "qs": blocks[:, 2:]}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        q = xp.astype(split_nibbles(fields["qs"], xp=xp), xp.float32)
        return (q - 8.0) * fields["d"]

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        # the signed extreme maps to q = 0 exactly, so d carries the sign of -max
        d = signed_absmax(x) / F32(-8)
        # (int8_t)(x*id + 8.5f): truncation of a non-negative value, i.e. round half up.
        # This x86 build does not contract it to an FMA (the test vectors agree). C overflows
        # silently where a tiny d has no finite reciprocal; so do we.
        with np.errstate(over="ignore", invalid="ignore"):
            t = x * safe_reciprocal(d) + F32(8.5)
        q = np.minimum(c_int32(t).astype(np.int8), 15).astype(np.uint8)
        out = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :2] = ggml_fp16_bytes(d)
        out[:, 2:] = pack_nibbles(q)
        return out
