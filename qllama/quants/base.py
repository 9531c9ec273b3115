"""The base class every GGML type derives from, and the registry it fills."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from qllama.ggml_types import GGMLType

# How activation quantizers round exact .5 ties: "ref" is ggml's reference C code
# (quantize_row_*_ref), "simd" is what its AVX2 / NEON builds do.
Rounding = Literal["ref", "simd"]

# What ggml_quantize_chunk does with an importance matrix for a type, as far as qllama
# implements it: "none" (qllama has no weighted quantizer for the type: one is refused),
# "optional", "required" (ggml aborts without one), "ignored" (quantized as without one).
ImatrixUse = Literal["none", "optional", "required", "ignored"]

Fields = dict[str, Any]  # named field arrays of a batch of blocks, numpy or any xp

REGISTRY: dict[str, type[QuantType]] = {}


@dataclass(frozen=True)
class IntegerForm:
    """``n`` weight blocks as ggml's CPU dot products see them: integers, and the floats that
    scale their exact integer sums (numpy arrays, one row per block).

    The dot product of one block with an activation block ``y`` (int8 ``y.qs``, float
    ``y.d``; Q8_1 adds ``y.s``, Q8_K ``y.bsums``) is, in integers,

    * ``sumi[s] = sum(q * y.qs)`` over the elements of sub-block ``s`` (the whole block when
      there are no ``scales``),
    * ``isum = sum_s scales[s] * sumi[s]`` and ``msum = sum_s mins[s] * sum(y.qs over s)``,

    and then in float32 ``(d*y.d)*isum + m*y.s - (dmin*y.d)*msum``, each term present when
    its fields are. ggml's generic C accumulates those over the blocks of a row in order;
    ``lanes`` and ``sumi_first`` record the two places where its order is not that one.
    """

    q: np.ndarray  # (n, block_size) int8: the integer each element enters the dot product as
    d: np.ndarray  # (n, 1) float32 block scale, as stored (fp16 widened)
    bound: int  # the largest |scales * q| the format can hold: proves the float32 sums exact
    scales: np.ndarray | None = None  # (n, n_sub) integer sub-block scales
    mins: np.ndarray | None = None  # (n, n_sub) integer sub-block mins, times ``dmin``
    dmin: np.ndarray | None = None  # (n, 1) float32
    m: np.ndarray | None = None  # (n, 1) float32 offset of Q4_1/Q5_1, times the stored ``y.s``
    # ggml's generic Q3_K..Q6_K dot products keep 8 float accumulators, element e going to
    # e % 8: integer sums per lane, (d*y.d)*isum[lane] added to its accumulator per block,
    # the accumulators added to the min terms at the end.
    lanes: int = 1
    # Q4_0's generic dot product scales as (sumi*d)*y.d, every other as (d*y.d)*sumi.
    sumi_first: bool = False
    # The IQ1 formats' integers are eight times ggml's (their 1/8 offsets made whole): it
    # scales each block's integer sum by this, (d*y.d)*(isum*isum_scale), exact in float32.
    isum_scale: float = 1.0
    # IQ2 and IQ3_XXS scale the row's float sum once at the end: row_scale * sumf.
    row_scale: float = 1.0

    @property
    def sub_size(self) -> int:
        """Elements per sub-block (the block size when there are no integer scales)."""
        n_sub = 1 if self.scales is None else self.scales.shape[1]
        return int(self.q.shape[1]) // n_sub


class QuantType:
    """One GGML block format: its byte layout, how to read it, write it and widen it.

    A subclass names its type and its ``vec_dot_type`` in the class statement and is
    registered under the GGML spelling (``"Q4_K"``). It implements these classmethods:

    * ``unpack(blocks)``: ``(n_blocks, type_size)`` uint8 -> named numpy field arrays. This
      is the only place bytes are reinterpreted (the array API has no bitcast), so fp16/bf16
      scales come out as float32 and packed bits stay as uint8.
    * ``dequantize_fields(fields, xp=...)``: the fields, as arrays of namespace ``xp``,
      -> ``(n_blocks, block_size)`` float32. Array-API only, so numpy, torch, jax and
      array-api-strict give the same values.
    * ``integer_form(fields)`` (numpy, weight formats with an integer dot product): the
      numpy fields -> :class:`IntegerForm`, what the CPU arithmetic multiplies.
    * ``quantize_blocks(x)``: ``(n_blocks, block_size)`` float32 -> bytes, bit-exact with
      ggml's reference quantizer (``ggml_quantize_chunk`` without importance matrix).
    * ``quantize_blocks_weighted(x, qw)`` (types whose ``imatrix_use`` is "optional" or
      "required"): the same with an importance matrix, ``qw`` the importance of each value.
    """

    ggml_type: ClassVar[GGMLType]
    block_size: ClassVar[int]  # elements per block
    type_size: ClassVar[int]  # bytes per block
    vec_dot_type: ClassVar[str]  # the type ggml's CPU quantizes activations to for this weight
    roundings: ClassVar[tuple[str, ...]] = ("ref",)  # tie roundings quantize_blocks offers
    imatrix_use: ClassVar[ImatrixUse] = "none"  # see ImatrixUse

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
    def integer_form(cls, fields: Fields) -> IntegerForm:
        raise NotImplementedError(f"{cls.ggml_type.name} has no integer dot product")

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        raise NotImplementedError(f"{cls.ggml_type.name} has no quantizer")

    @classmethod
    def quantize_blocks_weighted(cls, x: np.ndarray, qw: np.ndarray) -> np.ndarray:
        """``(n_blocks, block_size)`` float32 and the importance of each value (same shape)
        -> bytes, bit-exact with ``ggml_quantize_chunk`` given that importance matrix."""
        raise NotImplementedError(f"{cls.ggml_type.name} has no quantizer with an imatrix")

    @classmethod
    def _check_rounding(cls, rounding: str) -> None:
        if rounding not in cls.roundings:
            raise ValueError(
                f"{cls.ggml_type.name} quantizes with rounding {cls.roundings}, not {rounding!r}"
            )
