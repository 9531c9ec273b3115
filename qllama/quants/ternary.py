"""What TQ1_0 and TQ2_0 share: ternary weights -1, 0, +1 times the block's largest |x|.

Both quantize with ``lroundf(x / amax) + 1`` in {0, 1, 2} (ties away from zero) against the
float32 ``1/amax``, and take ``amax`` with C's ``MAX``, in which a NaN replaces the running
maximum. Their dot products are one integer sum per 256-block against Q8_K:
``(float)sum * (d * y.d)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.quants.base import Fields, IntegerForm
from qllama.quants.rounding import c_int32, round_away, running_absmax, safe_reciprocal


def trits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(n, 256)`` float32 -> the float32 scale ``d = amax`` ``(n, 1)`` and the trits
    ``lroundf(x * (1/d)) + 1`` (int64; 0, 1, 2 for finite x)."""
    d = running_absmax(x)
    with np.errstate(over="ignore", invalid="ignore"):
        t = c_int32(round_away(x * safe_reciprocal(d))).astype(np.int64) + 1
    return d, t


class TernaryBlocks:
    """Dequantize and integer form of a ternary format from its ``codes`` (0..2 per element,
    ``(n, 256)`` in element order) and its fp16 ``d``: value ``(float)(q - 1) * d``, one
    integer sum per block in the dot product."""

    @classmethod
    def codes(cls, fields: Fields, *, xp: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        q = xp.astype(cls.codes(fields, xp=xp), xp.int16) - 1
        return xp.astype(q, xp.float32) * fields["d"]

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        q = (cls.codes(fields, xp=np).astype(np.int16) - 1).astype(np.int8)
        return IntegerForm(q=q, d=fields["d"], bound=1)
