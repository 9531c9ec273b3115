"""The enumerations of the GGUF format: value types, GGML tensor types, llama file types.

Numbers are ggml's own (``include/gguf.h``, ``include/ggml.h``, ``include/llama.h``). The block
table covers every type ggml defines, so the reader can lay out and validate files that hold
types qllama cannot compute with; :mod:`qllama.quants` says which it can.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

QK_K = 256  # elements in a K-quant super-block


class ValueType(enum.IntEnum):
    """Type tag of a GGUF metadata value (``enum gguf_type``)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct format of each fixed-size value type (little-endian)
VALUE_FORMATS: dict[ValueType, str] = {
    ValueType.UINT8: "<B",
    ValueType.INT8: "<b",
    ValueType.UINT16: "<H",
    ValueType.INT16: "<h",
    ValueType.UINT32: "<I",
    ValueType.INT32: "<i",
    ValueType.FLOAT32: "<f",
    ValueType.BOOL: "<B",
    ValueType.UINT64: "<Q",
    ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
}

INTEGER_VALUE_TYPES = frozenset(
    {
        ValueType.UINT8,
        ValueType.INT8,
        ValueType.UINT16,
        ValueType.INT16,
        ValueType.UINT32,
        ValueType.INT32,
        ValueType.UINT64,
        ValueType.INT64,
    }
)
FLOAT_VALUE_TYPES = frozenset({ValueType.FLOAT32, ValueType.FLOAT64})


class BlockShape(NamedTuple):
    block_size: int  # elements per block
    type_size: int  # bytes per block


class GGMLType(enum.IntEnum):
    """GGML tensor type id (``enum ggml_type``)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42

    @property
    def block(self) -> BlockShape:
        return GGML_BLOCKS[self]

    def nbytes(self, n: int) -> int:
        """Bytes of ``n`` elements; ``n`` must be a multiple of the block size."""
        b = GGML_BLOCKS[self]
        return n // b.block_size * b.type_size


# Rows are written as arithmetic over the block's fields, as ggml-common.h lays them out.
GGML_BLOCKS: dict[GGMLType, BlockShape] = {
    GGMLType.F32: BlockShape(1, 4),
    GGMLType.F16: BlockShape(1, 2),
    GGMLType.Q4_0: BlockShape(32, 2 + 16),
    GGMLType.Q4_1: BlockShape(32, 2 + 2 + 16),
    GGMLType.Q5_0: BlockShape(32, 2 + 4 + 16),
    GGMLType.Q5_1: BlockShape(32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: BlockShape(32, 2 + 32),
    GGMLType.Q8_1: BlockShape(32, 2 + 2 + 32),  # gguf-py 0.19 still says 40 (old f32 d, s)
    GGMLType.Q2_K: BlockShape(QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    GGMLType.Q3_K: BlockShape(QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    GGMLType.Q4_K: BlockShape(QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType.Q5_K: BlockShape(QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GGMLType.Q6_K: BlockShape(QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    GGMLType.Q8_K: BlockShape(QK_K, 4 + QK_K + QK_K // 16 * 2),
    GGMLType.IQ2_XXS: BlockShape(QK_K, 2 + QK_K // 4),
    GGMLType.IQ2_XS: BlockShape(QK_K, 2 + QK_K // 4 + QK_K // 32),
    GGMLType.IQ3_XXS: BlockShape(QK_K, 2 + QK_K // 4 + QK_K // 8),
    GGMLType.IQ1_S: BlockShape(QK_K, 2 + QK_K // 8 + QK_K // 16),
    GGMLType.IQ4_NL: BlockShape(32, 2 + 16),
    GGMLType.IQ3_S: BlockShape(QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    GGMLType.IQ2_S: BlockShape(QK_K, 2 + QK_K // 4 + QK_K // 16),
    GGMLType.IQ4_XS: BlockShape(QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
    GGMLType.I8: BlockShape(1, 1),
    GGMLType.I16: BlockShape(1, 2),
    GGMLType.I32: BlockShape(1, 4),
    GGMLType.I64: BlockShape(1, 8),
    GGMLType.F64: BlockShape(1, 8),
    GGMLType.IQ1_M: BlockShape(QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    GGMLType.BF16: BlockShape(1, 2),
    GGMLType.TQ1_0: BlockShape(QK_K, 2 + 4 * 13),
    GGMLType.TQ2_0: BlockShape(QK_K, 2 + 64),
    GGMLType.MXFP4: BlockShape(32, 1 + 16),
    GGMLType.NVFP4: BlockShape(64, 4 + 32),
    GGMLType.Q1_0: BlockShape(128, 2 + 128 // 8),
    GGMLType.Q2_0: BlockShape(64, 2 + 64 // 4),
}


class FileType(enum.IntEnum):
    """``general.file_type``: what llama.cpp's quantizer was asked for (``enum llama_ftype``)."""

    ALL_F32 = 0
    MOSTLY_F16 = 1
    MOSTLY_Q4_0 = 2
    MOSTLY_Q4_1 = 3
    MOSTLY_Q8_0 = 7
    MOSTLY_Q5_0 = 8
    MOSTLY_Q5_1 = 9
    MOSTLY_Q2_K = 10
    MOSTLY_Q3_K_S = 11
    MOSTLY_Q3_K_M = 12
    MOSTLY_Q3_K_L = 13
    MOSTLY_Q4_K_S = 14
    MOSTLY_Q4_K_M = 15
    MOSTLY_Q5_K_S = 16
    MOSTLY_Q5_K_M = 17
    MOSTLY_Q6_K = 18
    MOSTLY_IQ2_XXS = 19
    MOSTLY_IQ2_XS = 20
    MOSTLY_Q2_K_S = 21
    MOSTLY_IQ3_XS = 22
    MOSTLY_IQ3_XXS = 23
    MOSTLY_IQ1_S = 24
    MOSTLY_IQ4_NL = 25
    MOSTLY_IQ3_S = 26
    MOSTLY_IQ3_M = 27
    MOSTLY_IQ2_S = 28
    MOSTLY_IQ2_M = 29
    MOSTLY_IQ4_XS = 30
    MOSTLY_IQ1_M = 31
    MOSTLY_BF16 = 32
    MOSTLY_TQ1_0 = 36
    MOSTLY_TQ2_0 = 37
    MOSTLY_MXFP4_MOE = 38
    MOSTLY_NVFP4 = 39
    MOSTLY_Q1_0 = 40
    MOSTLY_Q2_0 = 41

    @property
    def label(self) -> str:
        """The name llama-quantize takes on its command line: ``Q4_K_M``, ``F32``."""
        return self.name.removeprefix("MOSTLY_").removeprefix("ALL_")


def file_type_name(value: object) -> str:
    """A ``general.file_type`` value as llama-quantize names it (``15`` is ``Q4_K_M``), or
    what is wrong with it."""
    if value is None:
        return "no general.file_type"
    try:
        return FileType(int(value)).label  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return f"general.file_type {value!r}, not one llama.cpp defines"
