"""IQ2_XS: 256 weights as 32 points of a 512-point grid, 7 sign bits a group, 4-bit scales
per 16."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, IntegerForm, QuantType
from qllama.quants.iq_grids import IQ2XS, bit_fields, lookup, sign_factors, sign_ints
from qllama.quants.iq_search import GridSearch, ImatrixQuantizer, quantize_grid
from qllama.quants.rounding import read_fp16

SEARCH = GridSearch(
    IQ2XS,
    sub=16,
    kmax=3,
    steps=range(-9, 10),
    step=0.1,
    eps=1e-15,
    start_on_grid=True,
    refit_if_off_grid=True,
    refit_all=False,
)


class IQ2_XS(ImatrixQuantizer, QuantType, ggml_type=GGMLType.IQ2_XS, vec_dot_type="Q8_K"):
    """Super-block of 256 weights, 74 bytes: 32 groups of 8, a scale per 16::

        offset  0      2                                  66            74
               +------+----------------------------------+-------------+
               | d    | qs[32]  u16, one per group of 8: | scales[8]   |
               | fp16 |   bits 0-8   iq2xs_grid index    | hi:4 | lo:4 |
               |      |   bits 9-15  7 sign bits         |             |
               +------+----------------------------------+-------------+

    ``scales[b]`` holds the scale ``s`` of values ``32b .. 32b+15`` in its low nibble and of
    ``32b+16 .. 32b+31`` in its high one. Value ``j`` of group ``g``::

        (d * (0.5 + s) * 0.25) * grid[j] * (-1 if sign bit j else 1)

    grid values 8, 25, 43; sign bit 7 is the parity of the 7 stored ones. ggml needs an
    importance matrix to write it.
    """

    imatrix_use = "required"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        qs = np.ascontiguousarray(blocks[:, 2:66]).view("<u2").astype(np.int32)
        return {"d": read_fp16(blocks[:, :2]), "qs": qs, "scales": blocks[:, 66:74]}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        qs = fields["qs"]
        n = qs.shape[0]
        s = xp.astype(bit_fields(fields["scales"], 4, 2, xp=xp), xp.float32)
        db = (fields["d"] * (0.5 + s)) * 0.25  # (n, 16)
        grid = lookup(IQ2XS, qs & 511, xp=xp)  # (n, 32, 8)
        y = xp.reshape(grid * sign_factors(qs >> 9, parity=True, xp=xp), (n, 16, 16))
        return xp.reshape(xp.reshape(db, (n, 16, 1)) * y, (n, 256))

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        qs = fields["qs"]
        q = IQ2XS.ints[qs & 511] * sign_ints(qs >> 9, parity=True)
        return IntegerForm(
            q=q.reshape(-1, 256),
            d=fields["d"],
            scales=2 * bit_fields(fields["scales"], 4, 2, xp=np).astype(np.int32) + 1,
            bound=43 * 31,
            row_scale=0.125,
        )

    @classmethod
    def _quantize(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        """``quantize_row_iq2_xs_impl``: sigma2 = sum(x*x)/256, parity signs, 16-value
        sub-blocks, off-grid groups refitted; ``d = max_scale/31``."""
        code = quantize_grid(
            x, qw, SEARCH, sigma_factor=1, fallback="", parity=True, fudge=1.0, name="IQ2_XS"
        )
        n = x.shape[0]
        qs = code.index.astype(np.uint16) | ((code.signs & 127).astype(np.uint16) << 9)
        out = np.empty((n, cls.type_size), dtype=np.uint8)
        out[:, :2] = code.d
        out[:, 2:66] = qs.astype("<u2").view(np.uint8)
        out[:, 66:74] = code.codes[:, 0::2] | (code.codes[:, 1::2] << 4)
        out[code.zero] = 0
        return out
