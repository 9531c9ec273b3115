"""IQ3_XXS: 256 weights as 64 points of a 256-point grid of 4, 7 sign bits per 8 values,
4-bit scales per 32."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, IntegerForm, QuantType
from qllama.quants.iq_grids import IQ3XXS, bit_fields, lookup, sign_factors, sign_ints
from qllama.quants.iq_search import (
    GridSearch,
    ImatrixQuantizer,
    quantize_grid,
    sign_scale_words,
)
from qllama.quants.rounding import read_fp16

SEARCH = GridSearch(
    IQ3XXS,
    sub=32,
    kmax=8,
    steps=range(-15, 16),
    step=0.2,
    eps=1e-8,
    start_on_grid=True,
    refit_if_off_grid=True,
    refit_all=False,
)


class IQ3_XXS(ImatrixQuantizer, QuantType, ggml_type=GGMLType.IQ3_XXS, vec_dot_type="Q8_K"):
    """Super-block of 256 weights, 98 bytes: 64 groups of 4, signs per 8, a scale per 32::

        offset  0      2                          66                              98
               +------+--------------------------+-------------------------------+
               | d    | qs[64]                   | aux[8]  u32, one per 32-block:|
               | fp16 | iq3xxs_grid index of     |   bits 7l..7l+6 signs of the  |
               |      | each group of 4          |   8 values 8l.. (l = 0..3)    |
               |      |                          |   bits 28..31 the scale s     |
               +------+--------------------------+-------------------------------+

    Value ``j`` of group ``g`` (values ``4g .. 4g+3``) of 32-block ``b``::

        (d * (0.5 + s) * 0.5) * grid[j] * (-1 if its sign bit else 1)

    grid values 4, 12, ..., 52, 62; the 8th sign bit of each 8 is the parity of the 7 stored.
    """

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        aux = np.ascontiguousarray(blocks[:, 66:98]).view("<i4").astype(np.int32)
        return {"d": read_fp16(blocks[:, :2]), "qs": blocks[:, 2:66], "aux": aux}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        aux = fields["aux"]
        n = aux.shape[0]
        s = xp.astype((aux >> 28) & 15, xp.float32)
        db = (fields["d"] * (0.5 + s)) * 0.5  # (n, 8)
        signs = xp.reshape(bit_fields(aux, 7, 4, xp=xp), (n, 8, 4))
        grid = xp.reshape(lookup(IQ3XXS, fields["qs"], xp=xp), (n, 8, 4, 8))
        y = xp.reshape(db, (n, 8, 1, 1)) * grid * sign_factors(signs, parity=True, xp=xp)
        return xp.reshape(y, (n, 256))

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        aux = fields["aux"]
        signs = bit_fields(aux, 7, 4, xp=np).reshape(-1, 8, 4)
        q = IQ3XXS.ints[fields["qs"]].reshape(-1, 8, 4, 8) * sign_ints(signs, parity=True)
        return IntegerForm(
            q=q.reshape(-1, 256),
            d=fields["d"],
            scales=(2 * ((aux >> 28) & 15) + 1).astype(np.int32),
            bound=62 * 31,
            row_scale=0.25,
        )

    @classmethod
    def _quantize(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        """``quantize_row_iq3_xxs_impl(256)``: sigma2 = 2*sum(x*x)/256, parity signs,
        off-grid groups refitted; ``d = max_scale/31`` stored times 1.0125. Without an
        importance matrix the weights are ``x*x``."""
        code = quantize_grid(
            x,
            qw,
            SEARCH,
            sigma_factor=2,
            fallback="x2",
            parity=True,
            fudge=1.0125,
            name="IQ3_XXS",
        )
        n = x.shape[0]
        out = np.empty((n, cls.type_size), dtype=np.uint8)
        out[:, :2] = code.d
        out[:, 2:66] = code.index
        out[:, 66:98] = sign_scale_words(code.signs, code.codes)
        out[code.zero] = 0
        return out
