"""The base class every GGML type derives from, and the registry it fills."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np

from qllama.ggml_types import GGMLType

# How activation quantizers round exact .5 ties: "ref" is ggml's reference C code
# (quantize_row_*_ref), "simd" is what its AVX2 / NEON builds do.
Rounding = Literal["ref", "simd"]

Fields = dict[str, Any]  # named field arrays of a batch of blocks, numpy or any xp

REGISTRY: dict[str, type[QuantType]] = {}


class QuantType:
    """One GGML block format: its byte layout, how to read it, write it and widen it.

    A subclass names its type and its ``vec_dot_type`` in the class statement and is
    registered under the GGML spelling (``"Q4_K"``). It implements three classmethods:

    * ``unpack(blocks)``: ``(n_blocks, type_size)`` uint8 -> named numpy field arrays. This
      is the only place bytes are reinterpreted (the array API has no bitcast), so fp16/bf16
      scales come out as float32 and packed bits stay as uint8.
    * ``dequantize_fields(fields, xp=...)``: the fields, as arrays of namespace ``xp``,
      -> ``(n_blocks, block_size)`` float32. Array-API only, so numpy, torch, jax and
      array-api-strict give the same values.
    * ``quantize_blocks(x)``: ``(n_blocks, block_size)`` float32 -> bytes, bit-exact with
      ggml's reference quantizer (``ggml_quantize_chunk`` without importance matrix).
    """

    ggml_type: ClassVar[GGMLType]
    block_size: ClassVar[int]  # elements per block
    type_size: ClassVar[int]  # bytes per block
    vec_dot_type: ClassVar[str]  # the type ggml's CPU quantizes activations to for this weight
    roundings: ClassVar[tuple[str, ...]] = ("ref",)  # tie roundings quantize_blocks offers

    def __init_subclass__(cls, *, ggml_type: GGMLType, vec_dot_type: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if ggml_type.name in REGISTRY:
            raise RuntimeError(f"{ggml_type.name} is registered twice")
        cls.ggml_type = ggml_type
        cls.block_size, cls.type_size = ggml_type.block
        cls.vec_dot_type = vec_dot_type
        REGISTRY[ggml_type.name] = cls

    @classmethod
    def name(cls) -> str:
        return cls.ggml_type.name

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        raise NotImplementedError(f"{cls.ggml_type.name} has no unpack")

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        raise NotImplementedError(f"{cls.ggml_type.name} has no dequantize")

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        raise NotImplementedError(f"{cls.ggml_type.name} has no quantizer")

    @classmethod
    def _check_rounding(cls, rounding: str) -> None:
        if rounding not in cls.roundings:
            raise ValueError(
                f"{cls.ggml_type.name} quantizes with rounding {cls.roundings}, not {rounding!r}"
            )
