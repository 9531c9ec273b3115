"""ggml's scalar arithmetic, reproduced in numpy float32.

ggml's reference quantizers are sequential C loops in float32. To give the same bytes, sums
run in index order (``np.cumsum`` is sequential, ``np.sum`` is pairwise), products keep C's
left-to-right grouping, and each of ggml's two rounding functions has its own helper here.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def nearest_int(x: np.ndarray) -> np.ndarray:
    """ggml ``nearest_int``: the 1.5*2**23 magic-number trick, i.e. round half to even."""
    return np.rint(np.asarray(x, dtype=F32)).astype(np.int32)


def round_away(x: np.ndarray) -> np.ndarray:
    """C ``roundf``: round half away from zero, as float32."""
    x = np.asarray(x, dtype=F32)
    a = np.abs(x)
    fl = np.floor(a)
    # 2*(a - fl) is exact, so its floor is 1 exactly when the fraction is >= 0.5
    return np.copysign(fl + np.floor(2 * (a - fl)), x).astype(F32)


def fp16(x: np.ndarray) -> np.ndarray:
    """Round to IEEE half (nearest even) and widen back, as ggml's stored scales are read."""
    return np.asarray(x, dtype=F32).astype(np.float16).astype(F32)


def fp16_bytes(x: np.ndarray) -> np.ndarray:
    """float32 ``(n, 1)`` -> the ``(n, 2)`` little-endian bytes of its fp16 rounding."""
    return np.asarray(x, dtype=F32).astype("<f2").reshape(-1, 1).view(np.uint8)


def read_fp16(raw: np.ndarray) -> np.ndarray:
    """``(n, 2)`` uint8 -> ``(n, 1)`` float32 (f16 -> f32 is exact)."""
    return np.ascontiguousarray(raw).view("<f2").astype(F32)


def read_fp32(raw: np.ndarray) -> np.ndarray:
    """``(n, 4)`` uint8 -> ``(n, 1)`` float32."""
    return np.ascontiguousarray(raw).view("<f4").astype(F32)


def seq_sum(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Float32 sum in index order along ``axis`` (a C ``for`` loop's ``+=``)."""
    x = np.asarray(x, dtype=F32)
    if x.shape[axis] == 0:
        return np.zeros(np.delete(x.shape, axis), dtype=F32)
    return np.take(np.cumsum(x, axis=axis, dtype=F32), -1, axis=axis)


def safe_reciprocal(d: np.ndarray) -> np.ndarray:
    """``d ? 1/d : 0`` in float32."""
    d = np.asarray(d, dtype=F32)
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1) / d, F32(0)).astype(F32)


def first_absmax(x: np.ndarray) -> np.ndarray:
    """The signed value of largest magnitude per row, the first one on ties (ggml's scans)."""
    idx = np.argmax(np.abs(x), axis=-1)[..., None]
    return np.take_along_axis(x, idx, axis=-1)
