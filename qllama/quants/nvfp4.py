"""NVFP4: 64 E2M1 (4-bit float) weights in four 16-blocks, each with a UE4M3 scale."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants import fp4
from qllama.quants.base import Fields, IntegerForm, QuantType, Rounding
from qllama.quants.iq4_search import lookup
from qllama.quants.nibbles import split_nibbles
from qllama.quants.rounding import F32


class NVFP4(QuantType, ggml_type=GGMLType.NVFP4, vec_dot_type="Q8_0"):
    """Block of 64 weights (four sub-blocks of 16), 36 bytes::

        offset  0                 4                                        36
               +-----------------+----------------------------------------+
               | d[4]  UE4M3     | qs[32]: 8 bytes per sub-block s        |
               | one per 16      | qs[8s+j] lo: 16s+j   hi: 16s+8+j       |
               +-----------------+----------------------------------------+

    value = kvalues[q] * ue4m3(d[s]) / 2, with MXFP4's doubled E2M1 values (so the halved
    scale). No second-level per-tensor scale: ggml's format is the blocks alone. UE4M3:
    4 exponent bits (bias 7), 3 mantissa bits, 0x00 and 0x7F are 0; the quantizer never
    writes 0x78..0x7D (everything from 248 up becomes 0x7E = 448). An importance matrix
    changes nothing (ggml ignores it); llama.cpp has no file type that quantizes to NVFP4.
    """

    imatrix_use = "ignored"  # ggml_quantize_chunk gives the same bytes with one

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        # the scales' bits become float32 here: the array API has no bitcast
        return {"d": fp4.UE4M3_HALF[blocks[:, :4]], "qs": blocks[:, 4:]}

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        n = fields["qs"].shape[0]
        qs = xp.reshape(fields["qs"], (n * 4, 8))
        values = lookup(fp4.KVALUES.astype(F32), split_nibbles(qs, xp=xp), xp=xp)
        d = xp.reshape(fields["d"], (n * 4, 1))
        return xp.reshape(values * d, (n, 64))  # C: v0 * d

    @classmethod
    def integer_form(cls, fields: Fields) -> IntegerForm:
        n = fields["qs"].shape[0]
        q = fp4.KVALUES[split_nibbles(fields["qs"].reshape(n * 4, 8), xp=np)]
        # four 16-blocks, each its own scale against the Q8_0 block it lies in
        return IntegerForm(q=q, d=fields["d"].reshape(n * 4, 1), bound=12)

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        """quantize_row_nvfp4_ref, every block at once."""
        cls._check_rounding(rounding)
        n = x.shape[0]
        sub = x.reshape(n * 4, 16)
        code = fp4.ue4m3_code(fp4.nonnan_absmax(sub, axis=1) / F32(6))  # (4n, 1)
        lq = fp4.best_index(sub, fp4.UE4M3_HALF[code])
        out = np.empty((n, cls.type_size), dtype=np.uint8)
        out[:, :4] = code.reshape(n, 4)
        out[:, 4:] = (lq[:, :8] | (lq[:, 8:] << 4)).reshape(n, 32)
        return out
