"""IQ4_XS: 256 weights in eight 32-blocks on IQ4_NL's 16 levels, 6-bit block scales."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, IntegerForm, QuantType, Rounding
from qllama.quants.iq4_search import (
    KVALUES,
    block_weights,
    levels_for,
    lookup,
    pack_nibbles_32,
    search_scales,
    super_scale,
)
from qllama.quants.nibbles import split_nibbles
from qllama.quants.rounding import F32, fp16_bytes, read_fp16

NTRY = 7  # trial scales per block: ggml_quantize_chunk and the CPU's from_float alike


class IQ4_XS(QuantType, ggml_type=GGMLType.IQ4_XS, vec_dot_type="Q8_K"):
    """Super-block of 256 weights (eight 32-blocks), 136 bytes::

        offset  0      2          4            8                                    136
               +------+----------+------------+------------------------------------+
               | d    | scales_h | scales_l[4]| qs[128]  level indices, 4 bits     |
               | fp16 | u16      | 4 bits x 8 | (IQ4_NL's nibble order per 32)     |
               +------+----------+------------+------------------------------------+

    Block ``b``'s 6-bit scale ``ls`` has its low four bits in nibble ``b % 2`` of
    ``scales_l[b // 2]`` and its top two at bits ``2b, 2b+1`` of ``scales_h``::

        scales_l[i]   bit 7..4: ls[2i+1] & 15    bit 3..0: ls[2i] & 15
        scales_h      bits 2b+1..2b: ls[b] >> 4

    ``qs[16b + j]`` holds element ``32b + j`` in its low nibble and ``32b + 16 + j`` in its
    high one. value = (d * (ls - 32)) * kvalues[q]. An all-zero super-block stores
    ``d = -0.0`` (bytes 00 80).
    """

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "d": read_fp16(blocks[:, 0:2]),
            "scales_h": blocks[:, 2:4],
            "scales_l": blocks[:, 4:8],
            "qs": blocks[:, 8:136],
        }

    @classmethod
    def scales(cls, fields: Fields, *, xp: Any) -> Any:
        """The eight 6-bit block scales ``ls`` (``(n, 8)`` uint8, stored with offset 32)."""
        sl = fields["scales_l"]
        low = xp.reshape(xp.stack([sl & 15, sl >> 4], axis=2), (sl.shape[0], 8))
        sh = fields["scales_h"]  # u16 little-endian: blocks 0-3 in byte 0, 4-7 in byte 1
        high = xp.concat(
            [(sh[:, 0:1] >> (2 * b)) & 3 for b in range(4)]
            + [(sh[:, 1:2] >> (2 * b)) & 3 for b in range(4)],
            axis=1,
        )
        return low | (high << 4)

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        n = fields["qs"].shape[0]
        ls = xp.astype(cls.scales(fields, xp=xp), xp.float32) - 32.0
        dl = xp.reshape(fields["d"] * ls, (n, 8, 1))  # C: dl = d * (ls - 32)
        qs = xp.reshape(fields["qs"], (n * 8, 16))
        values = lookup(KVALUES.astype(F32), split_nibbles(qs, xp=xp), xp=xp)
        return xp.reshape(dl * xp.reshape(values, (n, 8, 32)), (n, 256))

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        n = fields["qs"].shape[0]
        q = KVALUES[split_nibbles(fields["qs"].reshape(n * 8, 16), xp=np)]
        ls = cls.scales(fields, xp=np).astype(F32) - F32(32)
        # eight 32-blocks, each scaled in float: ((d*y.d) * (ls - 32)) * sumi
        return IntegerForm(
            q=q, d=np.repeat(fields["d"], 8, axis=0), post=ls.reshape(n * 8, 1), bound=127
        )

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        return _quantize(x, None)

    @classmethod
    def quantize_blocks_weighted(cls, x: np.ndarray, qw: np.ndarray) -> np.ndarray:
        return _quantize(x, qw)


def _quantize(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """``quantize_row_iq4_nl_impl(256, 32, ...)`` for every super-block at once."""
    nsb = x.shape[0]
    w = block_weights(x, qw).reshape(nsb * 8, 32)
    xt = np.ascontiguousarray(x.reshape(nsb * 8, 32).T)  # (32, blocks): element-major
    scales, _, _ = search_scales(xt, np.ascontiguousarray(w.T), NTRY)
    d, ls = super_scale(scales.reshape(nsb, 8))
    # each block's levels against its stored 6-bit scale times the float32 (not fp16) d
    lq = levels_for(xt, (d * ls.astype(F32)).reshape(-1)).T.reshape(nsb, 8, 32)
    code = (ls + 32).astype(np.uint8)
    out = np.empty((nsb, IQ4_XS.type_size), dtype=np.uint8)
    out[:, 0:2] = fp16_bytes(d)
    high = (code >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))
    out[:, 2:4] = np.bitwise_or.reduce(high, axis=1).astype("<u2").reshape(-1, 1).view(np.uint8)
    out[:, 4:8] = (code[:, 0::2] & 15) | ((code[:, 1::2] & 15) << 4)
    out[:, 8:] = pack_nibbles_32(lq.reshape(nsb * 8, 32)).reshape(nsb, 128)
    return out
