"""F16: IEEE half precision, one value per block."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.rounding import read_fp16


def fp16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bits of ``ggml_compute_fp32_to_fp16``: nearest even, and every NaN
    becomes the quiet NaN 0x7e00 with its sign (numpy would keep some payload bits)."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is the IEEE answer
        bits = x.astype("<f2").view(np.uint16)
    sign = (x.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)
    return np.where(np.isnan(x), sign | np.uint16(0x7E00), bits)


def ggml_fp16_bytes(x: np.ndarray) -> np.ndarray:
    """float32 ``(n, 1)`` -> the ``(n, 2)`` little-endian bytes of :func:`fp16_bits`."""
    return fp16_bits(x).astype("<u2").reshape(-1, 1).view(np.uint8)


class F16(QuantType, ggml_type=GGMLType.F16, vec_dot_type="F16"):
    """One value, 2 bytes::

        offset  0      2
               +------+
               | x    |
               | fp16 |
               +------+

    Widening to float32 is exact. The CPU also rounds activations to F16 for F16 weights.
    """

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
        return ggml_fp16_bytes(x)
