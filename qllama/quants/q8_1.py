"""Q8_1: 32 int8 values, an fp16 scale and the fp16 scaled sum of the values."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.f16 import ggml_fp16_bytes
from qllama.quants.nibbles import c_int32
from qllama.quants.rounding import F32, read_fp16, round_away, safe_reciprocal


def _maxps(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """C ``p > q ? p : q``, which is also x86 ``maxps``: the second operand wins on NaN."""
    return np.where(p > q, p, q)


def _ref_absmax(a: np.ndarray) -> np.ndarray:
    """``amax = MAX(amax, fabsf(v))`` in index order from 0: a NaN resets the running max."""
    nan = np.isnan(a)
    n = a.shape[1]
    last_nan = np.where(nan.any(axis=1), n - 1 - np.argmax(nan[:, ::-1], axis=1), -1)[:, None]
    after = np.arange(n) > last_nan
    amax = np.max(np.where(after, a, F32(0)), axis=1, keepdims=True)
    return np.where(last_nan == n - 1, a[:, -1:], amax)


def _simd_absmax(a: np.ndarray) -> np.ndarray:
    """The AVX2 kernel's max: four 8-lane ``maxps``, then a fixed lane reduction tree."""
    r = a.reshape(-1, 4, 8)
    m = _maxps(_maxps(_maxps(r[:, 0], r[:, 1]), r[:, 2]), r[:, 3])
    m4 = _maxps(m[:, 4:], m[:, :4])
    m2 = _maxps(m4[:, :2], m4[:, 2:])
    return _maxps(m2[:, :1], m2[:, 1:])


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
        a = np.abs(x)
        # C's float arithmetic overflows and makes NaNs silently (tiny or NaN blocks); so do we
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            if rounding == "ref":
                # quantize_row_q8_1_ref: roundf (ties away) with id = 1/d from the f32 d
                d = _ref_absmax(a) / F32(127)
                qs = c_int32(round_away(x * safe_reciprocal(d))).astype(np.int8)
                total = np.sum(qs, axis=1, keepdims=True, dtype=np.int32)  # the stored int8
                s = total.astype(F32) * d
            else:
                # AVX2 quantize_row_q8_1: id = 127/amax, _mm256_round_ps (ties to even); the
                # int32 lanes are summed (wrapping) and packed with saturation
                amax = _simd_absmax(a)
                d = amax / F32(127)
                iscale = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
                q32 = c_int32(np.rint(x * iscale))
                total = np.sum(q32, axis=1, keepdims=True, dtype=np.int32)
                qs = np.clip(q32, -128, 127).astype(np.int8)
                s = d * total.astype(F32)
        out = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :2] = ggml_fp16_bytes(d)
        out[:, 2:4] = ggml_fp16_bytes(s)
        out[:, 4:] = qs.view(np.uint8)
        return out
