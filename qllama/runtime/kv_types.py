"""What a KV cache stores and how attention reads it: llama.cpp's ``type_k`` / ``type_v`` and
flash attention, named by one string (``kv_precision``).

========================  =====================================================================
``kv_precision``          meaning
========================  =====================================================================
``"f32"``                 float32 keys and values, float32 attention (the default)
``"f16"``                 llama.cpp's default f16 cache without flash attention (``-fa off``):
                          K and V stored as f16, Q and the probabilities rounded to f16
``"f16-flash"``           the f16 cache read as llama-perplexity's flash attention reads a batch
                          of 64 queries or more (the tiled kernel), whatever the batch
``"K/V"``                 ``type_k`` K, ``type_v`` V, no flash attention (``"q8_0/f16"``); one
                          name means both (``"bf16"``)
``"K/V,fa"``              the same with flash attention (``-fa on``): llama.cpp's kernel for each
                          call (one_chunk, tiled; see :mod:`qllama.runtime.kv_attention`)
``"K/V,fa=N"``            the same, llama.cpp run with ``N`` threads: its split-KV decode kernel
                          (F16 K and V, one query, 512 cells or more) depends on that count
========================  =====================================================================

Types: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1 (``common/arg.cpp``'s list), as
``-ctk`` / ``-ctv`` spell them. llama.cpp's refusals are qllama's: a quantized V cache needs flash
attention, and a quantized type's block must divide the head size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qllama import quants
from qllama.errors import BackendError
from qllama.ggml_types import GGMLType
from qllama.quants.base import Rounding

CACHE_TYPES: dict[str, GGMLType] = {
    name: GGMLType[name.upper()]
    for name in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
}
FLOAT_TYPES = ("f32", "f16", "bf16")
LEGACY = ("f32", "f16", "f16-flash")  # the original three names, whose numbers stay put
FLASH_SUFFIX = ",fa"
GRAMMAR = (
    "KV cache precision must be one of "
    + ", ".join(LEGACY)
    + " or TYPE, TYPE_K/TYPE_V, either followed by ',fa' (flash attention) or ',fa=N' (and"
    " llama.cpp's N threads)"
)
# llama.cpp rotates a quantized cache's rows by a Hadamard transform when the head size is a
# multiple of this (src/llama-kv-cache.cpp: attn_rot_k / attn_rot_v)
ROTATION_MIN = 64


@dataclass(frozen=True)
class KVSpec:
    """A cache's key and value types and whether flash attention reads them."""

    type_k: str
    type_v: str
    flash: bool = False
    tiled: bool = False  # "f16-flash": the tiled kernel's arithmetic for every batch
    threads: int | None = None  # llama.cpp's thread count, for its split-KV kernel

    @property
    def name(self) -> str:
        """The spec as ``kv_precision`` spells it."""
        if self.tiled:
            return "f16-flash"
        types = self.type_k if self.type_k == self.type_v else f"{self.type_k}/{self.type_v}"
        threads = f"={self.threads}" if self.threads else ""
        return types + (FLASH_SUFFIX + threads if self.flash else "")

    @property
    def legacy(self) -> bool:
        """Whether the float attention of the three original precisions computes it (float
        K and V of one type, no flash attention or the always-tiled one)."""
        return self.tiled or (
            not self.flash and self.type_k == self.type_v and self.type_k in ("f32", "f16")
        )

    def quantized(self, which: str) -> bool:
        """Whether the keys (``"k"``) or values (``"v"``) are stored in a block format."""
        return (self.type_k if which == "k" else self.type_v) not in FLOAT_TYPES


def parse(spec: str) -> KVSpec:
    """``kv_precision`` -> :class:`KVSpec`, refusing unknown types and a quantized V cache
    without flash attention (llama.cpp: "quantized V cache requires flash_attn")."""
    if not isinstance(spec, str):
        raise BackendError(f"{GRAMMAR}, not {spec!r}")
    if spec == "f16-flash":
        return KVSpec("f16", "f16", flash=True, tiled=True)
    types, flash, threads = spec, False, None
    head, sep, count = spec.rpartition(FLASH_SUFFIX + "=")
    if sep:  # ",fa=N"
        if not count.isdigit() or int(count) < 1:
            raise BackendError(f"{GRAMMAR}, not {spec!r}: ',fa=N' needs a thread count N >= 1")
        types, flash, threads = head, True, int(count)
    elif spec.endswith(FLASH_SUFFIX):
        types, flash = spec[: -len(FLASH_SUFFIX)], True
    parts = types.split("/")
    if len(parts) > 2 or not all(parts):
        raise BackendError(f"{GRAMMAR}, not {spec!r}")
    unknown = [p for p in parts if p not in CACHE_TYPES]
    if unknown:
        raise BackendError(
            f"{GRAMMAR}, not {spec!r}: unknown cache type {unknown[0]!r} (llama.cpp's are "
            + ", ".join(CACHE_TYPES)
            + ")"
        )
    k, v = parts[0], parts[-1]
    out = KVSpec(k, v, flash=flash, threads=threads)
    if out.quantized("v") and not flash:
        raise BackendError(
            f"kv_precision {spec!r}: quantized V cache requires flash_attn (llama.cpp refuses "
            f"it too); add ',fa': {k}/{v},fa"
        )
    return out


def check_geometry(spec: KVSpec, head_dim: int, head_dim_v: int) -> None:
    """Refuse a block type whose block does not divide the head size (llama.cpp's check)."""
    for which, t, hd in (("K", spec.type_k, head_dim), ("V", spec.type_v, head_dim_v)):
        block = CACHE_TYPES[t].block[0]
        if hd % block:
            raise BackendError(
                f"kv_precision {spec.name!r}: the {which} cache's {t} blocks of {block} do not "
                f"divide the head size {hd}"
            )


def rotation_size(spec: KVSpec, which: str, head_dim: int) -> int:
    """The Hadamard block llama.cpp rotates the keys or values by, 0 for none: quantized
    caches with head sizes a multiple of 64; K by the largest power of two dividing its head
    size, V by 64 (``build_input_k_rot`` / ``build_input_v_rot``)."""
    if not spec.quantized(which) or head_dim % ROTATION_MIN:
        return 0
    if which == "v":
        return ROTATION_MIN
    return head_dim & -head_dim  # the largest power of two dividing it (>= 64 here)


F32 = np.float32


def round_to(t: str, x: np.ndarray) -> np.ndarray:
    """``x`` rounded to float type ``t`` (f32: itself), as float32."""
    if t == "f32":
        return np.asarray(x, dtype=F32)
    g = CACHE_TYPES[t]
    return np.asarray(quants.dequantize(quants.quantize(x, g), g, x.shape), dtype=F32)


def from_float(
    t: str, rows: np.ndarray, rounding: Rounding
) -> tuple[np.ndarray | None, np.ndarray]:
    """What a cache of type ``t`` stores for float32 ``rows`` (n, d): the bytes (None for a
    float type) and the values they hold, as ``type_traits_cpu[t].from_float`` writes them
    (Q8_0: the arch quantizer, ``rounding``; IQ4_NL: ``quantize_row_iq4_nl_ref``; the others
    their ``_ref``)."""
    if t in ("f32", "f16", "bf16"):
        return None, round_to(t, rows)
    g = CACHE_TYPES[t]
    if g == GGMLType.IQ4_NL:
        from qllama.quants.iq4_nl import quantize_row_ref

        raw = quantize_row_ref(rows.reshape(-1, g.block[0])).reshape(rows.shape[0], -1)
    else:
        fmt = quants.get(g)
        raw = quants.quantize(rows, g, rounding=rounding if rounding in fmt.roundings else "ref")
    return raw, np.asarray(quants.dequantize(raw, g, rows.shape), dtype=F32)
