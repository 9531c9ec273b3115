"""IQ4_NL: 32 weights on 16 non-linear levels, one fp16 scale."""

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
)
from qllama.quants.nibbles import split_nibbles
from qllama.quants.rounding import F32, fp16_bytes, read_fp16

# ggml's two IQ4_NL quantizers differ: ggml_quantize_chunk (llama-quantize) searches 15 trial
# scales; quantize_row_iq4_nl_ref (the CPU's from_float, used when ggml writes an IQ4_NL
# tensor itself, e.g. a KV cache) searches none
NTRY_CHUNK = 7
NTRY_REF = -1


class IQ4_NL(QuantType, ggml_type=GGMLType.IQ4_NL, vec_dot_type="Q8_0"):
    """Block of 32 weights, 18 bytes::

        offset  0      2                    18
               +------+--------------------+
               | d    | qs[16]             |
               | fp16 | lo: 0..15          |
               |      | hi: 16..31         |
               +------+--------------------+

    qs[j] holds the level index of element j in its low nibble and of element j+16 in its
    high one; value = d * kvalues[q], with kvalues = -127, -104, -83, -65, -49, -35, -22,
    -10, 1, 13, 25, 38, 53, 69, 89, 113. ``d`` is usually negative (the search prefers it).
    """

    imatrix_use = "optional"

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {"d": read_fp16(blocks[:, :2]), "qs": blocks[:, 2:]}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        # C: d * kvalues_iq4nl[q]
        return fields["d"] * lookup(KVALUES.astype(F32), split_nibbles(fields["qs"], xp=xp), xp=xp)

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        q = KVALUES[split_nibbles(fields["qs"], xp=np)]
        return IntegerForm(q=q, d=fields["d"], bound=127)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        cls._check_rounding(rounding)
        return _quantize(x, None, NTRY_CHUNK)

    @classmethod
    def quantize_blocks_weighted(cls, x: np.ndarray, qw: np.ndarray) -> np.ndarray:
        return _quantize(x, qw, NTRY_CHUNK)


def quantize_row_ref(x: np.ndarray) -> np.ndarray:
    """``(n, 32)`` float32 blocks -> IQ4_NL bytes as ``quantize_row_iq4_nl_ref`` (the CPU's
    ``from_float``) writes them: no trial scales, the levels of the first fit.

    ggml leaves an all-zero block's nibbles uninitialised there (its scale is 0, so they
    decode to 0 whatever they hold); they are written as 0 here.
    """
    return _quantize(np.asarray(x, dtype=F32), None, NTRY_REF)


def _quantize(x: np.ndarray, qw: np.ndarray | None, ntry: int) -> np.ndarray:
    """``quantize_row_iq4_nl_impl(32, 32, ...)`` for every block at once."""
    w = block_weights(x, qw)
    xt = np.ascontiguousarray(x.T)
    d, zero, first = search_scales(xt, np.ascontiguousarray(w.T), ntry)
    # one block per super-block: the scale is stored as it is, and with trials the levels
    # are refitted to its float32 value (a zero scale refits every level to 1/0 -> index 8)
    lq = levels_for(xt, d).T if ntry > 0 else np.where(zero[:, None], 0, first.T)
    out = np.empty((x.shape[0], IQ4_NL.type_size), dtype=np.uint8)
    out[:, :2] = fp16_bytes(d.reshape(-1, 1))
    out[:, 2:] = pack_nibbles_32(lq.astype(np.uint8))
    return out
