"""IQ2_S: 256 weights as 32 points of a 1024-point grid, a sign byte a group, 4-bit scales
per 16."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, IntegerForm, QuantType
from qllama.quants.iq_grids import IQ2S, bit_fields, lookup, sign_factors, sign_ints
from qllama.quants.iq_search import GridSearch, ImatrixQuantizer, quantize_grid
from qllama.quants.rounding import read_fp16

SEARCH = GridSearch(
    IQ2S,
    sub=16,
    kmax=3,
    steps=range(-9, 10),
    step=0.1,
    eps=1e-8,
    start_on_grid=True,
    refit_if_off_grid=True,
    refit_all=False,
)


class IQ2_S(ImatrixQuantizer, QuantType, ggml_type=GGMLType.IQ2_S, vec_dot_type="Q8_K"):
    """Super-block of 256 weights, 82 bytes: 32 groups of 8, a scale per 16::

        offset  0      2            34           66       74          82
               +------+------------+------------+--------+-----------+
               | d    | qs[32]     | signs[32]  | qh[8]  | scales[8] |
               | fp16 | index bits | bit j: <0  |        | hi:4|lo:4 |
               |      | 0-7        |            |        |           |
               +------+------------+------------+--------+-----------+

    Group ``g`` (values ``8g .. 8g+7``) is iq2s_grid point ``qs[g] | hi << 8`` with
    ``hi = (qh[g // 4] >> 2*(g % 4)) & 3``, signed by ``signs[g]``; ``scales`` as in IQ2_XS.
    value = ``(d * (0.5 + s) * 0.25) * grid[j] * (-1 if bit j else 1)``, grid values 8, 25, 43.
    """

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "d": read_fp16(blocks[:, :2]),
            "qs": blocks[:, 2:34],
            "signs": blocks[:, 34:66],
            "qh": blocks[:, 66:74],
            "scales": blocks[:, 74:82],
        }

    @classmethod
    def index(cls, fields: Fields, *, xp: Any) -> Any:
        """The grid index of each group, ``(n, 32)`` int32."""
        hi = xp.astype(bit_fields(fields["qh"], 2, 4, xp=xp), xp.int32)
        return xp.astype(fields["qs"], xp.int32) | (hi << 8)

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        n = fields["qs"].shape[0]
        s = xp.astype(bit_fields(fields["scales"], 4, 2, xp=xp), xp.float32)
        db = (fields["d"] * (0.5 + s)) * 0.25  # (n, 16)
        grid = lookup(IQ2S, cls.index(fields, xp=xp), xp=xp)  # (n, 32, 8)
        y = xp.reshape(grid * sign_factors(fields["signs"], parity=False, xp=xp), (n, 16, 16))
        return xp.reshape(xp.reshape(db, (n, 16, 1)) * y, (n, 256))

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        q = IQ2S.ints[cls.index(fields, xp=np)] * sign_ints(fields["signs"], parity=False)
        return IntegerForm(
            q=q.reshape(-1, 256),
            d=fields["d"],
            scales=2 * bit_fields(fields["scales"], 4, 2, xp=np).astype(np.int32) + 1,
            bound=43 * 31,
            row_scale=0.125,
        )

    @classmethod
    def _quantize(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        """``quantize_row_iq2_s_impl``: sigma2 = 2*sum(x*x)/256, plain signs, 16-value
        sub-blocks, off-grid groups refitted; ``d = max_scale/31`` stored times 0.9875.
        Without an importance matrix the weights are ``0.25*sigma2 + x*x``."""
        code = quantize_grid(
            x,
            qw,
            SEARCH,
            sigma_factor=2,
            fallback="sigma",
            parity=False,
            fudge=0.9875,
            name="IQ2_S",
        )
        n = x.shape[0]
        hi = (code.index >> 8).reshape(n, 8, 4) << (2 * np.arange(4))
        out = np.empty((n, cls.type_size), dtype=np.uint8)
        out[:, :2] = code.d
        out[:, 2:34] = code.index & 255
        out[:, 34:66] = code.signs
        out[:, 66:74] = np.bitwise_or.reduce(hi, axis=2)
        out[:, 74:82] = code.codes[:, 0::2] | (code.codes[:, 1::2] << 4)
        # a super-block with no positive scale keeps its indices and signs, d = 0 (ggml
        # zeroes only its scales)
        return out
