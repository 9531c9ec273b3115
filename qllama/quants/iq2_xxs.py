"""IQ2_XXS: 256 weights as 32 points of a 256-point grid, 7 sign bits a group, 4-bit scales."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, IntegerForm, QuantType
from qllama.quants.iq_grids import IQ2XXS, bit_fields, lookup, sign_factors, sign_ints
from qllama.quants.iq_search import (
    GridSearch,
    ImatrixQuantizer,
    quantize_grid,
    sign_scale_words,
)
from qllama.quants.rounding import read_fp16

SEARCH = GridSearch(
    IQ2XXS,
    sub=32,
    kmax=3,
    steps=range(-6, 7),
    step=0.1,
    eps=1e-15,
    start_on_grid=True,
    refit_if_off_grid=False,
    refit_all=True,
    seed_qp=True,
)


class IQ2_XXS(ImatrixQuantizer, QuantType, ggml_type=GGMLType.IQ2_XXS, vec_dot_type="Q8_K"):
    """Super-block of 256 weights, 66 bytes: eight 32-blocks of four groups of 8::

        offset  0      2                                                    66
               +------+----------------------------------------------------+
               | d    | per 32-block b, 8 bytes at 2 + 8b:                 |
               | fp16 |   grid[4]   iq2xxs_grid index of each group of 8   |
               |      |   aux (u32) bits 7l..7l+6: signs of group l (0-3)  |
               |      |             bits 28..31: the scale s               |
               +------+----------------------------------------------------+

    Value ``j`` of group ``l`` of 32-block ``b``::

        (d * (0.5 + s) * 0.25) * grid[j] * (-1 if sign bit j else 1)

    with grid values 8, 25 or 43 and sign bit 7 the parity of the 7 stored ones (every group
    has an even number of negative values). ggml needs an importance matrix to write it.
    """

    imatrix_use = "required"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        words = np.ascontiguousarray(blocks[:, 2:]).reshape(-1, 8, 8)  # per 32-block
        return {
            "d": read_fp16(blocks[:, :2]),
            "grid": words[:, :, :4],
            "aux": np.ascontiguousarray(words[:, :, 4:]).view("<i4")[..., 0].astype(np.int32),
        }

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        aux = fields["aux"]
        n = aux.shape[0]
        s = xp.astype((aux >> 28) & 15, xp.float32)
        db = (fields["d"] * (0.5 + s)) * 0.25  # (n, 8)
        signs = xp.reshape(bit_fields(aux, 7, 4, xp=xp), (n, 8, 4))
        grid = lookup(IQ2XXS, fields["grid"], xp=xp)  # (n, 8, 4, 8)
        y = xp.reshape(db, (n, 8, 1, 1)) * grid * sign_factors(signs, parity=True, xp=xp)
        return xp.reshape(y, (n, 256))

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        aux = fields["aux"]
        signs = bit_fields(aux, 7, 4, xp=np).reshape(-1, 8, 4)
        q = IQ2XXS.ints[fields["grid"]] * sign_ints(signs, parity=True)
        return IntegerForm(
            q=q.reshape(-1, 256),
            d=fields["d"],
            scales=(2 * ((aux >> 28) & 15) + 1).astype(np.int32),
            bound=43 * 31,
            row_scale=0.125,
        )

    @classmethod
    def _quantize(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        """``quantize_row_iq2_xxs_impl``: sigma2 = sum(x*x)/256, parity signs, search seeded
        by ``make_qp_quants``, every group refitted; ``d = max_scale/31``."""
        code = quantize_grid(
            x, qw, SEARCH, sigma_factor=1, fallback="", parity=True, fudge=1.0, name="IQ2_XXS"
        )
        n = x.shape[0]
        words = np.empty((n, 8, 8), dtype=np.uint8)
        words[:, :, :4] = code.index.reshape(n, 8, 4)
        words[:, :, 4:] = sign_scale_words(code.signs, code.codes).reshape(n, 8, 4)
        out = np.empty((n, cls.type_size), dtype=np.uint8)
        out[:, :2] = code.d
        out[:, 2:] = words.reshape(n, 64)
        out[code.zero] = 0
        return out
