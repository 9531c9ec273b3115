"""IQ3_S: 256 weights as 64 points of a 512-point grid of 4, a sign byte per 8 values,
4-bit scales per 32."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, IntegerForm, QuantType
from qllama.quants.iq_grids import IQ3S, bit_fields, lookup, sign_factors, sign_ints
from qllama.quants.iq_search import GridSearch, ImatrixQuantizer, quantize_grid
from qllama.quants.rounding import read_fp16

SEARCH = GridSearch(
    IQ3S,
    sub=32,
    kmax=8,
    steps=range(-9, 10),
    step=0.2,
    eps=0.0,  # ggml skips only an exactly zero sub-block
    start_on_grid=False,
    refit_if_off_grid=True,
    refit_all=True,
)


class IQ3_S(ImatrixQuantizer, QuantType, ggml_type=GGMLType.IQ3_S, vec_dot_type="Q8_K"):
    """Super-block of 256 weights, 110 bytes: 64 groups of 4, signs per 8, a scale per 32::

        offset  0      2            66       74           106         110
               +------+------------+--------+------------+-----------+
               | d    | qs[64]     | qh[8]  | signs[32]  | scales[4] |
               | fp16 | index bits | bit 8  | bit j: <0  | hi:4|lo:4 |
               |      | 0-7        |        |            |           |
               +------+------------+--------+------------+-----------+

    Group ``k`` (0..7) of 32-block ``b`` is iq3s_grid point ``qs[8b+k] | bit k of qh[b] << 8``;
    value ``j`` of the 8 values ``8g..`` is signed by bit ``j`` of ``signs[g]``; ``scales[b//2]``
    holds ``s`` of 32-block ``b`` in its low (even b) or high nibble. value =
    ``(d * (1 + 2s)) * grid[j] * (-1 if bit j else 1)``, grid values 1, 3, ..., 15.

    ggml's quantizer does not advance its ``qs`` and ``signs`` pointers past an all-zero
    32-block: the later blocks' ``qs`` and ``signs`` are written one slot early and the tail
    stays zero (``qh`` and ``scales`` are in place). The bytes here are ggml's, so such a
    super-block dequantizes as ggml's does, shifted.
    """

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "d": read_fp16(blocks[:, :2]),
            "qs": blocks[:, 2:66],
            "qh": blocks[:, 66:74],
            "signs": blocks[:, 74:106],
            "scales": blocks[:, 106:110],
        }

    @classmethod
    def index(cls, fields: Fields, *, xp: Any) -> Any:
        """The grid index of each group of 4, ``(n, 64)`` int32."""
        hi = xp.astype(bit_fields(fields["qh"], 1, 8, xp=xp), xp.int32)
        return xp.astype(fields["qs"], xp.int32) | (hi << 8)

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        n = fields["qs"].shape[0]
        s = bit_fields(fields["scales"], 4, 2, xp=xp)
        db = fields["d"] * xp.astype(1 + 2 * xp.astype(s, xp.int32), xp.float32)  # (n, 8)
        grid = xp.reshape(lookup(IQ3S, cls.index(fields, xp=xp), xp=xp), (n, 32, 8))
        y = xp.reshape(grid * sign_factors(fields["signs"], parity=False, xp=xp), (n, 8, 32))
        return xp.reshape(xp.reshape(db, (n, 8, 1)) * y, (n, 256))

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        q = IQ3S.ints[cls.index(fields, xp=np)].reshape(-1, 32, 8)
        q = q * sign_ints(fields["signs"], parity=False)
        return IntegerForm(
            q=q.reshape(-1, 256),
            d=fields["d"],
            scales=2 * bit_fields(fields["scales"], 4, 2, xp=np).astype(np.int32) + 1,
            bound=15 * 31,
        )

    @classmethod
    def _quantize(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        """``quantize_row_iq3_s_impl(32)``: sigma2 = 2*sum(x*x)/256, plain signs, every group
        refitted when one was off the grid; ``d = max_scale/31`` stored times 1.033. Without
        an importance matrix the weights are ``x*x``."""
        code = quantize_grid(
            x,
            qw,
            SEARCH,
            sigma_factor=2,
            fallback="x2",
            parity=False,
            fudge=1.033,
            name="IQ3_S",
        )
        n = x.shape[0]
        index = code.index.reshape(n, 8, 8)
        qs = np.zeros((n, 8, 8), dtype=np.uint8)
        signs = np.zeros((n, 8, 4), dtype=np.uint8)
        # the live 32-blocks' qs and signs, packed one after the other (ggml's pointers)
        r, b = np.nonzero(code.live)
        slot = (np.cumsum(code.live, axis=1) - 1)[r, b]
        qs[r, slot] = index[r, b] & 255
        signs[r, slot] = code.signs.reshape(n, 8, 4)[r, b]
        hi = (index >> 8) << np.arange(8)
        out = np.empty((n, cls.type_size), dtype=np.uint8)
        out[:, :2] = code.d
        out[:, 2:66] = qs.reshape(n, 64)
        out[:, 66:74] = np.bitwise_or.reduce(hi, axis=2)
        out[:, 74:106] = signs.reshape(n, 32)
        out[:, 106:110] = code.codes[:, 0::2] | (code.codes[:, 1::2] << 4)
        # a super-block with no positive scale keeps its indices and signs, d = 0 (ggml
        # zeroes only its scales)
        return out
