"""TQ2_0: 256 ternary weights, 2 bits each (2.06 bits a weight)."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants import ternary
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.rounding import fp16_bytes, read_fp16

_SHIFTS = np.array([0, 2, 4, 6], dtype=np.int64)


class TQ2_0(ternary.TernaryBlocks, QuantType, ggml_type=GGMLType.TQ2_0, vec_dot_type="Q8_K"):
    """Super-block of 256 ternary weights, 66 bytes; ``d`` comes last::

        offset 0                                      64     66
              +--------------------------------------+------+
              | qs[64]: four 2-bit codes a byte      | d    |
              |                                      | fp16 |
              +--------------------------------------+------+

    Element ``e = 128h + 32l + m`` is bits ``2l, 2l+1`` of ``qs[32h + m]``; value =
    (q - 1) * d with q in 0..2 (3 is never written), d = the block's largest |x|. An
    importance matrix changes nothing (ggml ignores it).
    """

    imatrix_use = "ignored"  # ggml_quantize_chunk gives the same bytes with one

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {"qs": blocks[:, :64], "d": read_fp16(blocks[:, 64:66])}

    @classmethod
    def codes(cls, fields: Fields, *, xp: Any) -> Any:
        """The 2-bit code of each element, ``(n, 256)`` uint8 in element order."""
        qs = fields["qs"]
        n = qs.shape[0]
        q = xp.reshape(qs, (n, 2, 1, 32))
        return xp.reshape(xp.concat([(q >> (2 * j)) & 3 for j in range(4)], axis=2), (n, 256))

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        """quantize_row_tq2_0_ref, every block at once."""
        cls._check_rounding(rounding)
        n = x.shape[0]
        d, t = ternary.trits(x)
        runs = ((t & 3).reshape(n, 2, 4, 32)) << _SHIFTS[:, None]  # C: q += (xi & 3) << 2l
        out = np.empty((n, cls.type_size), dtype=np.uint8)
        out[:, :64] = (runs.sum(axis=2) & 0xFF).reshape(n, 64).astype(np.uint8)
        out[:, 64:66] = fp16_bytes(d)
        return out
