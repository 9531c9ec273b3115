"""Q8_1: 32 int8 values, an fp16 scale and the fp16 scaled sum of the values."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.q8_0 import quantize_q8
from qllama.quants.rounding import F32, fp16_bytes, read_fp16


class Q8_1(QuantType, ggml_type=GGMLType.Q8_1, vec_dot_type="Q8_1"):
    """Block of 32 activations, 36 bytes::

        offset  0      2      4                                   36
               +------+------+------------------------------------+
               | d    | s    | qs[32]  int8                       |
               | fp16 | fp16 |                                    |
               +------+------+------------------------------------+

    value[j] = qs[j] * d; s = fp16(d * sum(qs)) with the f32 d, which Q4_1/Q5_1 dot
    products use for the minimum term. The activation type of Q4_1, Q5_1 and Q8_1 weights.
    """

    roundings = ("ref", "simd")

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "d": read_fp16(blocks[:, :2]),
            "s": read_fp16(blocks[:, 2:4]),
            "qs": blocks[:, 4:].view(np.int8),
        }

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        return xp.astype(fields["qs"], xp.float32) * fields["d"]

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        d, qs, total = quantize_q8(x, rounding)
        with np.errstate(over="ignore", invalid="ignore"):
            s = total.astype(F32) * d  # C: sum*d, int converted to float first
        out = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :2] = fp16_bytes(d)
        out[:, 2:4] = fp16_bytes(s)
        out[:, 4:] = qs.view(np.uint8)
        return out
