"""F32: plain IEEE single precision, one value per block."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.rounding import read_fp32


class F32(QuantType, ggml_type=GGMLType.F32, vec_dot_type="F32"):
    """One value, 4 bytes::

        offset  0      4
               +------+
               | x    |
               | fp32 |
               +------+

    Stored as is: quantize and dequantize copy bits (NaN payloads included).
    """

    imatrix_use = "ignored"  # ggml_quantize_chunk gives the same bytes with one

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {"x": read_fp32(blocks)}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        return xp.astype(fields["x"], xp.float32)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        return np.ascontiguousarray(x, dtype="<f4").view(np.uint8).reshape(-1, cls.type_size)
