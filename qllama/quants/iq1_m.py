"""IQ1_M: 256 weights as 32 points of the 2048-point ternary grid, a +-1/8 shift per 8
values, 3-bit scales per 16, and the fp16 scale spread over the scales' top nibbles."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, IntegerForm, QuantType
from qllama.quants.iq1_search import X_M, X_P, onto_grid, split_m
from qllama.quants.iq_grids import IQ1S, bit_fields, lookup
from qllama.quants.iq_search import ImatrixQuantizer, importance, scale_codes
from qllama.quants.rounding import F32, c_sum, fp16_bits

EPS = F32(1e-7)  # GROUP_MAX_EPS_IQ1_M
# qh bits of the two groups of a 16-block whose delta is -1/8, per combination (+,+) ...
MASKS = np.array([0x00, 0x80, 0x08, 0x88], dtype=np.uint8)


class IQ1_M(ImatrixQuantizer, QuantType, ggml_type=GGMLType.IQ1_M, vec_dot_type="Q8_K"):
    """Super-block of 256 weights, 56 bytes: 32 groups of 8, a scale per 16, no separate d::

        offset  0                 32                    48                      56
               +-----------------+---------------------+-----------------------+
               | qs[32]          | qh[16], one per 16: | sc[4]  u16:           |
               | index bits 0-7  |   bits 0-2 index    |   bits 3i..3i+2 the   |
               | of each group   |     8-10, group 0   |   scale s of 16-block |
               |                 |   bit 3 delta<0, g0 |   4c + i (i = 0..3)   |
               |                 |   bits 4-6, bit 7:  |   bits 12-15 nibble c |
               |                 |     the same, g1    |   of d's fp16 bits    |
               +-----------------+---------------------+-----------------------+

    ``d`` is the fp16 ``(sc[0] >> 12) | (sc[1] >> 12) << 4 | (sc[2] >> 12) << 8 |
    (sc[3] >> 12) << 12``. Value ``j`` of group ``g`` (16-block ``g // 2``): iq1s_grid point
    ``qs[g] | bits << 8`` (coordinates -1, 0, 1) and::

        (d * (2s + 1)) * (grid[j] + delta),   delta = -1/8 if its qh bit else +1/8
    """

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        sc = np.ascontiguousarray(blocks[:, 48:56]).view("<u2").astype(np.int32)
        bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00)
        bits |= sc[:, 3] & 0xF000
        d = bits.astype(np.uint16).view("<f2").astype(F32).reshape(-1, 1)
        return {"d": d, "qs": blocks[:, :32], "qh": blocks[:, 32:48], "sc": sc}

    @classmethod
    def index(cls, fields: Fields, *, xp: Any) -> Any:
        """The grid index of each group, ``(n, 32)`` int32."""
        hi = bit_fields(xp.astype(fields["qh"], xp.int32), 3, 2, stride=4, xp=xp)
        return xp.astype(fields["qs"], xp.int32) | (hi << 8)

    @classmethod
    def scales(cls, sc: Any, *, xp: Any) -> Any:
        """``(n, 4)`` u16 words -> the 3-bit scale of each 16-block, ``(n, 16)``."""
        return bit_fields(sc, 3, 4, xp=xp)

    @classmethod
    def negative(cls, qh: Any, *, xp: Any) -> Any:
        """Whether each group's delta is -1/8, ``(n, 32)`` bool."""
        return bit_fields(qh >> 3, 1, 2, stride=4, xp=xp) == 1

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        n = fields["qs"].shape[0]
        s = cls.scales(fields["sc"], xp=xp)
        dl = fields["d"] * xp.astype(2 * s + 1, xp.float32)  # (n, 16)
        minus = xp.astype(cls.negative(fields["qh"], xp=xp), xp.float32)
        delta = 0.125 - 0.25 * minus  # (n, 32): +-1/8, exactly
        grid = lookup(IQ1S, cls.index(fields, xp=xp), xp=xp)  # (n, 32, 8)
        y = xp.reshape(grid + xp.reshape(delta, (n, 32, 1)), (n, 16, 16))
        return xp.reshape(xp.reshape(dl, (n, 16, 1)) * y, (n, 256))

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        grid = IQ1S.ints[cls.index(fields, xp=np)]  # (n, 32, 8)
        delta = np.where(cls.negative(fields["qh"], xp=np), -1, 1).astype(np.int8)
        return IntegerForm(
            q=(8 * grid + delta[..., None]).astype(np.int8).reshape(-1, 256),
            d=fields["d"],
            scales=2 * cls.scales(fields["sc"], xp=np) + 1,
            bound=9 * 15,
            isum_scale=0.125,
        )

    @classmethod
    def _quantize(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        """``quantize_row_iq1_m_impl``: sigma2 = 2*sum(x*x)/256, the split per 16 values with
        a delta per 8, groups onto the grid, then one least-squares ``d`` for the whole
        super-block under the coded scales, stored times 1.1125. Without an importance matrix
        the weights are ``x*x``."""
        n = x.shape[0]
        w = importance(x, qw, sigma_factor=2, fallback="x2", name="IQ1_M")
        xs, ws = x.reshape(-1, 16), w.reshape(-1, 16)
        live = np.flatnonzero(np.max(np.abs(xs), axis=1) >= EPS)
        levels, scale, combo = split_m(xs[live], ws[live])
        ok = combo >= 0  # otherwise ggml treats the sub-block as zero
        live, levels, scale, combo = live[ok], levels[ok], scale[ok], combo[ok]
        neg = scale < 0
        levels = np.where(neg[:, None], 2 - levels, levels)
        scale, combo = np.abs(scale), np.where(neg, 3 - combo, combo)
        index, scale = onto_grid(levels, xs[live], ws[live], scale, _minus(combo))

        scales = np.zeros(n * 16, dtype=F32)
        combos = np.zeros(n * 16, dtype=np.int64)
        idx = np.zeros((n * 16, 2), dtype=np.int64)
        scales[live], combos[live], idx[live] = scale, combo, index
        _, codes, zero = scale_codes(scales.reshape(n, 16), levels=15, top=7, fudge=1.0)
        combos = combos.reshape(n, 16)
        # the refit of d over all 256 values, zero 16-blocks included (index 0, (+,+))
        lv = IQ1S.points[idx.reshape(n, 32)]  # (n, 32, 8)
        minus = _minus(combos.reshape(-1)).reshape(n, 32, 1).astype(np.int64)
        q = np.stack([X_P, X_M])[minus, lv]
        q = q.reshape(n, 16, 16) * (2 * codes.astype(F32) + 1)[..., None]
        wq = w * q.reshape(n, 256)
        sumqx = c_sum(np.ascontiguousarray((wq * x).T))
        sumq2 = c_sum(np.ascontiguousarray((wq * q.reshape(n, 256)).T))
        d0 = np.max(scales.reshape(n, 16), axis=1, initial=F32(0)) / F32(15)
        with np.errstate(all="ignore"):
            d = np.where(sumq2 > 0, sumqx / sumq2, d0)
        dbits = fp16_bits(d * F32(1.1125)).astype(np.int64)

        sc = np.bitwise_or.reduce(
            codes.astype(np.int64).reshape(n, 4, 4) << (3 * np.arange(4)), axis=2
        )
        sc |= (dbits[:, None] >> (4 * np.arange(4)) & 0xF) << 12
        sc[zero] = 0  # ggml stops before the scales: they stay as zeroed
        idx = idx.reshape(n, 16, 2)
        hi = ((idx[:, :, 0] >> 8) | ((idx[:, :, 1] >> 8) << 4)).astype(np.uint8)
        qh = hi | np.where(zero[:, None], 0, MASKS[combos]).astype(np.uint8)
        out = np.empty((n, cls.type_size), dtype=np.uint8)
        out[:, :32] = (idx & 255).reshape(n, 32)
        out[:, 32:48] = qh
        out[:, 48:56] = sc.astype("<u2").view(np.uint8)
        return out


def _minus(combo: np.ndarray) -> np.ndarray:
    """Whether each of the two groups of each 16-block has delta -1/8, ``(m, 2)``: group 0
    for combinations 2 and 3, group 1 for 1 and 3."""
    return np.stack([combo >= 2, combo % 2 == 1], axis=1)
