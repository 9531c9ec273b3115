"""What TQ1_0 and TQ2_0 share: ternary weights -1, 0, +1 times the block's largest |x|.

Both quantize with ``lroundf(x / amax) + 1`` in {0, 1, 2} (ties away from zero) against the
float32 ``1/amax``, and take ``amax`` with C's ``MAX``, in which a NaN replaces the running
maximum. Their dot products are one integer sum per 256-block against Q8_K:
``(float)sum * (d * y.d)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.quants.base import IntegerForm
from qllama.quants.rounding import c_int32, round_away, running_absmax, safe_reciprocal


def trits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(n, 256)`` float32 -> the float32 scale ``d = amax`` ``(n, 1)`` and the trits
    ``lroundf(x * (1/d)) + 1`` (int64; 0, 1, 2 for finite x)."""
    d = running_absmax(x)
    with np.errstate(over="ignore", invalid="ignore"):
        t = c_int32(round_away(x * safe_reciprocal(d))).astype(np.int64) + 1
    return d, t


def values(codes: Any, d: Any, *, xp: Any) -> Any:
    """``(float)(q - 1) * d``: codes 0..2 (any integer dtype) and ``(n, 1)`` scales."""
    return xp.astype(xp.astype(codes, xp.int16) - 1, xp.float32) * d


def integer_form(codes: np.ndarray, d: np.ndarray) -> IntegerForm:
    """``(n, 256)`` codes 0..2 in element order and the fp16 scale, as the dot product sees
    them (one integer sum per block)."""
    return IntegerForm(q=(codes.astype(np.int16) - 1).astype(np.int8), d=d, bound=1)
