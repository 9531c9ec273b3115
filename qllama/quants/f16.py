"""F16: IEEE half precision, one value per block."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.rounding import fp16_bytes, read_fp16


class F16(QuantType, ggml_type=GGMLType.F16, vec_dot_type="F16"):
    """One value, 2 bytes::

        offset  0      2
               +------+
               | x    |
               | fp16 |
               +------+

    Widening to float32 is exact. The CPU also rounds activations to F16 for F16 weights.
    """

    imatrix_use = "ignored"  # ggml_quantize_chunk gives the same bytes with one

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        x = read_fp16(blocks)
        # ggml's widening (a float multiply) quiets signalling NaNs; numpy's cast keeps them
        u = x.view(np.uint32)
        return {"x": np.where(np.isnan(x), u | np.uint32(0x00400000), u).view(np.float32)}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        return xp.astype(fields["x"], xp.float32)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        return fp16_bytes(x)
