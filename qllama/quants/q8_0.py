"""Q8_0: 32 int8 values and one fp16 scale."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, IntegerForm, QuantType, Rounding
from qllama.quants.rounding import (
    F32,
    avx2_absmax,
    c_int32,
    fp16_bytes,
    read_fp16,
    round_away,
    running_absmax,
    safe_reciprocal,
)


def quantize_q8(x: np.ndarray, rounding: Rounding) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What ggml's Q8_0 and Q8_1 quantizers share, for ``(n, 32)`` float32 blocks.

    Returns the float32 ``d`` (before its fp16 store), the stored ``qs`` (int8) and the
    int32 sum of the quantized values that Q8_1's ``s`` is made of, each with ggml's
    behaviour on NaN, inf, tiny and huge blocks:

    * ``"ref"`` (``quantize_row_q8_*_ref``): running ``MAX`` scan, ``id = 1/d`` from the
      f32 ``d``, ``roundf`` (ties away); the int8 store keeps the low byte of x86's int cast
      and the sum is of the stored bytes.
    * ``"simd"`` (AVX2 ``quantize_row_q8_*``): the ``maxps`` tree, ``id = 127/amax``,
      round to even; the sum is of the int32 lanes (wrapping) and the bytes saturate.
    """
    # C's float arithmetic overflows and makes NaNs silently (tiny, huge or NaN blocks)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if rounding == "ref":
            d = running_absmax(x) / F32(127)
            qs = c_int32(round_away(x * safe_reciprocal(d))).astype(np.int8)
            total = np.sum(qs, axis=1, keepdims=True, dtype=np.int32)
            return d, qs, np.asarray(total)
        amax = avx2_absmax(x)
        iscale = np.where(amax != 0, F32(127) / np.where(amax != 0, amax, F32(1)), F32(0))
        q32 = c_int32(np.rint(x * iscale.astype(F32)))
        total = np.sum(q32, axis=1, keepdims=True, dtype=np.int32)
        qs = np.clip(q32, -128, 127).astype(np.int8)
        return amax / F32(127), qs, np.asarray(total)


class Q8_0(QuantType, ggml_type=GGMLType.Q8_0, vec_dot_type="Q8_0"):
    """Block of 32 weights, 34 bytes::

        offset  0      2                                   34
               +------+------------------------------------+
               | d    | qs[32]  int8                       |
               | fp16 |                                    |
               +------+------------------------------------+

    value[j] = qs[j] * d. Also the activation type of Q4_0, Q5_0 and Q8_0 weights.
    """

    roundings = ("ref", "simd")
    imatrix_use = "ignored"  # ggml_quantize_chunk gives the same bytes with one

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {"d": read_fp16(blocks[:, :2]), "qs": blocks[:, 2:].view(np.int8)}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        return xp.astype(fields["qs"], xp.float32) * fields["d"]

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        return IntegerForm(q=fields["qs"], d=fields["d"], bound=128)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        d, qs, _ = quantize_q8(x, rounding)
        out = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :2] = fp16_bytes(d)
        out[:, 2:] = qs.view(np.uint8)
        return out
