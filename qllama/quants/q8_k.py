"""Q8_K: 256 int8 values, one float32 scale and the sums of each 16 (activation type)."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.rounding import F32, first_absmax, nearest_int, read_fp32


class Q8_K(QuantType, ggml_type=GGMLType.Q8_K, vec_dot_type="Q8_K"):
    """Super-block of 256 values, 292 bytes::

        offset  0      4                               260                292
               +------+-------------------------------+------------------+
               | d    | qs[256]  int8                 | bsums[16]  int16 |
               | f32  |                               | sum of each 16 q |
               +------+-------------------------------+------------------+

    value[j] = d * qs[j]. The activation type of every K-quant weight. ``d`` is float32 and
    negative when the largest-magnitude value is positive: that value maps to q = -127.
    """

    # ggml's x86 and ARM CPU quantizers call the reference, so both names give its bytes.
    roundings = ("ref", "simd")

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "d": read_fp32(blocks[:, 0:4]),
            "qs": blocks[:, 4:260].view(np.int8),
            "bsums": np.ascontiguousarray(blocks[:, 260:292]).view("<i2").astype(np.int16),
        }

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        return fields["d"] * xp.astype(fields["qs"], xp.float32)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        top = first_absmax(x, axis=1)  # signed, first of equal magnitudes; NaNs skipped
        zero = top == 0
        # A max below 127/FLT_MAX (~3.7e-37) overflows iscale to inf: ggml then stores d = +-0
        # and q = 0 (nearest_int of +-inf or NaN is -2**22 or 0, whose low byte is 0).
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            iscale = np.where(zero, F32(0), F32(-127) / np.where(zero, F32(1), top)).astype(F32)
            d = np.where(zero, F32(0), F32(1) / np.where(zero, F32(1), iscale)).astype(F32)
            q = np.minimum(nearest_int(iscale * x), 127).astype(np.int8)
        # ggml leaves bsums of an all-zero block unwritten; zero is what a fresh buffer holds
        bsums = q.reshape(-1, 16, 16).sum(axis=2, dtype=np.int16)
        out = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        out[:, 0:4] = d.astype("<f4").view(np.uint8)
        out[:, 4:260] = q.view(np.uint8)
        out[:, 260:292] = bsums.astype("<i2").view(np.uint8)
        return out
