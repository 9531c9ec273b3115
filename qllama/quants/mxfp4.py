"""MXFP4: 32 E2M1 (4-bit float) weights and one shared power-of-two scale (OCP MX)."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants import fp4
from qllama.quants.base import Fields, IntegerForm, QuantType, Rounding
from qllama.quants.iq4_search import lookup, pack_nibbles_32
from qllama.quants.nibbles import split_nibbles
from qllama.quants.rounding import F32


class MXFP4(QuantType, ggml_type=GGMLType.MXFP4, vec_dot_type="Q8_0"):
    """Block of 32 weights, 17 bytes (gpt-oss's expert format)::

        offset  0      1                    17
               +------+--------------------+
               | e    | qs[16]             |
               | E8M0 | lo: 0..15          |
               |      | hi: 16..31         |
               +------+--------------------+

    value = kvalues[q] * 2**(e - 128): kvalues are the E2M1 values doubled (0, 1, 2, 3, 4,
    6, 8, 12, then the same negated, index 8 being -0), the scale halved to match. ``e`` is
    ``floor(log2(amax)) - 2 + 127``, so the largest |x| lands on 4..12 of the doubled grid.
    An importance matrix changes nothing (ggml ignores it).
    """

    imatrix_use = "ignored"  # ggml_quantize_chunk gives the same bytes with one

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        # the scale's bits become a float32 here: the array API has no bitcast
        return {"d": fp4.E8M0_HALF[blocks[:, 0]].reshape(-1, 1), "qs": blocks[:, 1:]}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        values = lookup(fp4.KVALUES.astype(F32), split_nibbles(fields["qs"], xp=xp), xp=xp)
        return values * fields["d"]  # C: x0 * d

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        return IntegerForm(
            q=fp4.KVALUES[split_nibbles(fields["qs"], xp=np)], d=fields["d"], bound=12
        )

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        """quantize_row_mxfp4_ref, every block at once."""
        cls._check_rounding(rounding)
        e = fp4.e8m0_exponent(fp4.nonnan_absmax(x, axis=1))  # (n, 1)
        lq = fp4.best_index(x, fp4.E8M0_HALF[e])
        out = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :1] = e
        out[:, 1:] = pack_nibbles_32(lq)
        return out
