"""TQ1_0: 256 ternary weights packed five to a byte in base 3 (1.69 bits a weight)."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants import ternary
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.rounding import fp16_bytes, read_fp16

_POW3 = (1, 3, 9, 27, 81)


class TQ1_0(ternary.TernaryBlocks, QuantType, ggml_type=GGMLType.TQ1_0, vec_dot_type="Q8_K"):
    """Super-block of 256 ternary weights, 54 bytes; ``d`` comes last::

        offset 0                      32              48      52     54
              +----------------------+---------------+-------+------+
              | qs[32]: 5 trits each | qs[16]: 5 each| qh[4] | d    |
              | elements m + 32n     | 160 + m + 16n | 4 each| fp16 |
              +----------------------+---------------+-------+------+

    A byte holds trits t0..t4 (t0 the most significant base-3 digit), stored as
    ``ceil(q * 256 / 243)`` for ``q = ((((t0*3 + t1)*3 + t2)*3 + t3)*3 + t4)``, so that trit
    n is ``((uint8)(byte * 3**n) * 3) >> 8``. ``qs[m]`` (m < 32) holds elements ``m + 32n``,
    ``qs[32 + m]`` (m < 16) elements ``160 + m + 16n`` (n < 5), ``qh[j]`` elements
    ``240 + j + 4n`` (n < 4; its fifth digit is 0). value = (t - 1) * d, d = the block's
    largest |x|. An importance matrix changes nothing (ggml ignores it).
    """

    imatrix_use = "ignored"  # ggml_quantize_chunk gives the same bytes with one

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {"qs": blocks[:, :48], "qh": blocks[:, 48:52], "d": read_fp16(blocks[:, 52:54])}

    @classmethod
    def codes(cls, fields: Fields, *, xp: Any) -> Any:
        """The trit (0..2) of each element, ``(n, 256)`` int32 in element order."""
        n = fields["qs"].shape[0]

        def digits(b: Any, count: int) -> Any:  # (n, k) bytes -> (n, count, k) trits
            b = xp.astype(b, xp.int32)
            return xp.stack([(((b * p) & 255) * 3) >> 8 for p in _POW3[:count]], axis=1)

        return xp.concat(
            [
                xp.reshape(digits(fields["qs"][:, :32], 5), (n, 160)),
                xp.reshape(digits(fields["qs"][:, 32:], 5), (n, 80)),
                xp.reshape(digits(fields["qh"], 4), (n, 16)),
            ],
            axis=1,
        )

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        """quantize_row_tq1_0_ref, every block at once."""
        cls._check_rounding(rounding)
        n = x.shape[0]
        d, t = ternary.trits(x)

        def pack(trits: np.ndarray) -> np.ndarray:
            # (n, digits, k) -> (n, k): base 3 in a wrapping uint8, then ceil(q * 256 / 243)
            q = np.zeros(trits.shape[::2], dtype=np.int64)
            for i in range(trits.shape[1]):
                q = (q * 3 + trits[:, i]) & 0xFF
            if trits.shape[1] == 4:
                q = (q * 3) & 0xFF  # qh: the first value moves to the most significant trit
            return ((q * 256 + 242) // 243 & 0xFF).astype(np.uint8)

        out = np.empty((n, cls.type_size), dtype=np.uint8)
        out[:, :32] = pack(t[:, :160].reshape(n, 5, 32))
        out[:, 32:48] = pack(t[:, 160:240].reshape(n, 5, 16))
        out[:, 48:52] = pack(t[:, 240:].reshape(n, 4, 4))
        out[:, 52:54] = fp16_bytes(d)
        return out
