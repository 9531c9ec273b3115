"""IQ1_S: 256 weights as 32 points of the 2048-point ternary grid, shifted by +-1/8, 3-bit
scales per 32."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, IntegerForm, QuantType
from qllama.quants.iq1_search import onto_grid, split_s
from qllama.quants.iq_grids import IQ1S, bit_fields, lookup
from qllama.quants.iq_search import ImatrixQuantizer, importance, scale_codes
from qllama.quants.rounding import F32, read_fp16

EPS = F32(1e-12)  # GROUP_MAX_EPS_IQ1_S


class IQ1_S(ImatrixQuantizer, QuantType, ggml_type=GGMLType.IQ1_S, vec_dot_type="Q8_K"):
    """Super-block of 256 weights, 50 bytes: 32 groups of 8, a scale and a shift per 32::

        offset  0      2                 34                              50
               +------+-----------------+-------------------------------+
               | d    | qs[32]          | qh[8]  u16, one per 32-block: |
               | fp16 | index bits 0-7  |   bits 3k..3k+2  index bits   |
               |      | of each group   |                  8-10, group k |
               |      |                 |   bits 12-14     the scale s  |
               |      |                 |   bit 15         delta < 0    |
               +------+-----------------+-------------------------------+

    Value ``j`` of group ``k`` (0..3) of 32-block ``b``: iq1s_grid point
    ``qs[4b+k] | bits << 8`` (coordinates -1, 0, 1), and::

        (d * (2s + 1)) * (grid[j] + delta),   delta = -1/8 if bit 15 else +1/8

    ggml needs an importance matrix to write it.
    """

    imatrix_use = "required"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        qh = np.ascontiguousarray(blocks[:, 34:50]).view("<u2").astype(np.int32)
        return {"d": read_fp16(blocks[:, :2]), "qs": blocks[:, 2:34], "qh": qh}

    @classmethod
    def index(cls, fields: Fields, *, xp: Any) -> Any:
        """The grid index of each group, ``(n, 32)`` int32."""
        hi = bit_fields(fields["qh"], 3, 4, xp=xp)
        return xp.astype(fields["qs"], xp.int32) | (hi << 8)

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        qh = fields["qh"]
        n = qh.shape[0]
        dl = fields["d"] * xp.astype(2 * ((qh >> 12) & 7) + 1, xp.float32)  # (n, 8)
        delta = 0.125 - 0.25 * xp.astype((qh >> 15) & 1, xp.float32)  # +-1/8, exactly
        grid = xp.reshape(lookup(IQ1S, cls.index(fields, xp=xp), xp=xp), (n, 8, 32))
        y = xp.reshape(dl, (n, 8, 1)) * (grid + xp.reshape(delta, (n, 8, 1)))
        return xp.reshape(y, (n, 256))

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        qh = fields["qh"]
        grid = IQ1S.ints[cls.index(fields, xp=np)].reshape(-1, 8, 32)
        delta = np.where(qh >> 15, -1, 1).astype(np.int8)
        # eight times the value: 8*grid + sign(delta), exact; ggml adds 1/8 of the delta sums
        return IntegerForm(
            q=(8 * grid + delta[..., None]).astype(np.int8).reshape(-1, 256),
            d=fields["d"],
            scales=2 * ((qh >> 12) & 7) + 1,
            bound=9 * 15,
            isum_scale=0.125,
        )

    @classmethod
    def _quantize(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        """``quantize_row_iq1_s_impl``: sigma2 = 2*sum(x*x)/256, the exhaustive split per 32
        values, groups onto the grid; ``d = max_scale/15`` stored times 1.125."""
        n = x.shape[0]
        w = importance(x, qw, sigma_factor=2, fallback="", name="IQ1_S")
        xs, ws = x.reshape(-1, 32), w.reshape(-1, 32)
        live = np.flatnonzero(np.max(np.abs(xs), axis=1) >= EPS)
        levels, scale, shift = split_s(xs[live], ws[live])
        ok = shift != 0  # otherwise ggml treats the sub-block as zero
        live, levels, scale, shift = live[ok], levels[ok], scale[ok], shift[ok]
        neg = scale < 0
        levels = np.where(neg[:, None], 2 - levels, levels)
        scale, shift = np.abs(scale), np.where(neg, -shift, shift)
        minus = np.repeat((shift == -1)[:, None], 4, axis=1)  # every group of a 32
        index, scale = onto_grid(levels, xs[live], ws[live], scale, minus)

        scales = np.zeros(n * 8, dtype=F32)
        minus = np.zeros(n * 8, dtype=bool)
        idx = np.zeros((n * 8, 4), dtype=np.int64)
        scales[live], minus[live], idx[live] = scale, shift == -1, index
        d, codes, zero = scale_codes(scales.reshape(n, 8), levels=15, top=7, fudge=1.125)
        codes |= np.where(minus.reshape(n, 8) & ~zero[:, None], 8, 0).astype(np.uint8)
        idx = idx.reshape(n, 8, 4)
        qh = np.bitwise_or.reduce((idx >> 8) << (3 * np.arange(4)), axis=2)
        qh |= codes.astype(np.int64) << 12
        out = np.empty((n, cls.type_size), dtype=np.uint8)
        out[:, :2] = d
        out[:, 2:34] = (idx & 255).reshape(n, 32)
        out[:, 34:50] = qh.astype("<u2").view(np.uint8)
        return out
