"""BF16: the top 16 bits of an IEEE single, one value per block."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bits of ``ggml_compute_fp32_to_bf16``.

    Finite values and infinities round to nearest, ties to even, by integer addition (so the
    largest floats round up to inf). A NaN is truncated and forced quiet (bit 6), which keeps
    its sign and the top of its payload.
    """
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (u >> 16) | np.uint32(64), rounded).astype(np.uint16)


class BF16(QuantType, ggml_type=GGMLType.BF16, vec_dot_type="BF16"):
    """One value, 2 bytes::

        offset  0      2
               +------+
               | x    |
               | bf16 |
               +------+

    value = the float32 whose top half is these bits and whose low half is zero.
    """

    imatrix_use = "ignored"  # ggml_quantize_chunk gives the same bytes with one

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        u = np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << 16
        return {"x": u.view(np.float32)}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        return xp.astype(fields["x"], xp.float32)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        return bf16_bits(x).astype("<u2").view(np.uint8).reshape(-1, cls.type_size)
