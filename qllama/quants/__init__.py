"""GGML block formats: one class per type, and the functions that dispatch on a type name.

>>> import numpy as np
>>> from qllama import quants
>>> x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
>>> q = quants.quantize(x, "Q8_0")           # (rows, row_bytes) uint8, as llama.cpp writes it
>>> q.shape
(2, 34)
>>> y = quants.dequantize(q, "Q8_0", (2, 32))  # float32, any array API namespace via xp=
>>> float(abs(y - x).max()) < 0.005
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from qllama.array_api import namespace
from qllama.errors import ImatrixError, TensorShapeError, UnsupportedTensorTypeError
from qllama.ggml_types import GGMLType

# Importing a type's module registers its class.
from qllama.quants import (  # noqa: F401
    bf16,
    f16,
    f32,
    iq1_m,
    iq1_s,
    iq2_s,
    iq2_xs,
    iq2_xxs,
    iq3_s,
    iq3_xxs,
    q2_k,
    q3_k,
    q4_0,
    q4_1,
    q4_k,
    q5_0,
    q5_1,
    q5_k,
    q6_k,
    q8_0,
    q8_1,
    q8_k,
)
from qllama.quants.base import REGISTRY, Fields, QuantType, Rounding

__all__ = [
    "REGISTRY",
    "QuantType",
    "dequantize",
    "get",
    "quantize",
    "supported",
    "unpack",
]

# Quantize at most this many elements at a time: K-quant searches hold a few dozen
# temporaries the size of their input.
_CHUNK_ELEMENTS = 1 << 22


def supported() -> list[str]:
    """Names of the GGML types qllama can quantize and dequantize."""
    return list(REGISTRY)


def get(qtype: str | int | GGMLType) -> type[QuantType]:
    """The class of a GGML type, by name (``"Q4_K"``), id or :class:`GGMLType`."""
    try:
        t = GGMLType[qtype] if isinstance(qtype, str) else GGMLType(qtype)
    except (KeyError, ValueError):
        raise UnsupportedTensorTypeError(f"unknown GGML type {qtype!r}") from None
    if t.name not in REGISTRY:
        raise UnsupportedTensorTypeError(
            f"GGML type {t.name} is valid but qllama does not support it; supported: "
            + ", ".join(REGISTRY)
        )
    return REGISTRY[t.name]


def _rows(x: np.ndarray) -> np.ndarray:
    """Any array -> 2-D (rows, row length)."""
    if x.ndim == 0:
        raise TensorShapeError("cannot quantize a scalar")
    return x.reshape(-1, x.shape[-1])


def quantize(
    x: Any,
    qtype: str | int | GGMLType,
    *,
    rounding: Rounding = "ref",
    imatrix: Any = None,
) -> np.ndarray:
    """Quantize float rows to GGML blocks, bit-exact with ``ggml_quantize_chunk``.

    ``x`` has shape ``(..., n)``, rows along the last axis; ``n`` must be a multiple of the
    type's block size. Returns uint8 of shape ``(rows, row_bytes)``. ``rounding="simd"``
    selects the tie rounding of ggml's AVX2/NEON activation quantizers where it differs.
    ``imatrix``: the importance of each of the ``n`` columns (``(n,)`` float32, the same for
    every row, as llama-quantize passes it), for the types that use one
    (``quants.get(qtype).imatrix_use``); a type that requires one refuses to go without.
    """
    cls = get(qtype)
    rows = _rows(np.asarray(x, dtype=np.float32))
    n = rows.shape[1]
    if n % cls.block_size:
        raise TensorShapeError(
            f"row length {n} is not a multiple of the {cls.ggml_type.name} block size "
            f"{cls.block_size}"
        )
    qw = _imatrix(imatrix, cls, n)
    blocks = rows.reshape(-1, cls.block_size)
    step = max(1, _CHUNK_ELEMENTS // cls.block_size)
    out = np.empty((blocks.shape[0], cls.type_size), dtype=np.uint8)
    per_row = n // cls.block_size
    for start in range(0, blocks.shape[0], step):
        chunk = np.ascontiguousarray(blocks[start : start + step])
        if qw is None:
            out[start : start + step] = cls.quantize_blocks(chunk, rounding=rounding)
        else:
            cls._check_rounding(rounding)
            # block b of the flattened rows is block b % per_row of its row
            weights = qw[np.arange(start, start + chunk.shape[0]) % per_row]
            out[start : start + step] = cls.quantize_blocks_weighted(chunk, weights)
    return out.reshape(rows.shape[0], n // cls.block_size * cls.type_size)


def _imatrix(imatrix: Any, cls: type[QuantType], n: int) -> np.ndarray | None:
    """The checked importance matrix as ``(n // block_size, block_size)`` float32, or None
    when there is none or the type ignores it."""
    name = cls.ggml_type.name
    if imatrix is None:
        if cls.imatrix_use == "required":
            raise ImatrixError(
                f"{name} needs an importance matrix (ggml aborts without one); pass imatrix="
            )
        return None
    if cls.imatrix_use == "none":
        raise ImatrixError(f"qllama cannot quantize {name} with an importance matrix")
    if cls.imatrix_use == "ignored":
        return None
    qw = np.asarray(imatrix, dtype=np.float32)
    if qw.shape != (n,):
        raise ImatrixError(f"the importance matrix has shape {qw.shape}; {name} rows need ({n},)")
    if not np.all(np.isfinite(qw)):
        raise ImatrixError("the importance matrix has NaN or infinite values")
    if np.any(qw < 0):  # a mean of squares; ggml's searches take square roots of weights
        raise ImatrixError("the importance matrix has negative values")
    return qw.reshape(-1, cls.block_size)


def _blocks(data: Any, cls: type[QuantType], shape: Sequence[int]) -> np.ndarray:
    """Raw bytes -> ``(n_blocks, type_size)`` uint8, checked against ``shape``."""
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    row = shape[-1] if shape else 1
    if row % cls.block_size:
        raise TensorShapeError(
            f"row length {row} is not a multiple of the {cls.ggml_type.name} block size "
            f"{cls.block_size}"
        )
    raw = (
        np.frombuffer(data, dtype=np.uint8)
        if isinstance(data, bytes | bytearray | memoryview)
        else np.asarray(data)
    )
    if raw.dtype != np.uint8:
        raise TypeError(f"quantized data must be uint8 bytes, got {raw.dtype}")
    expected = n // cls.block_size * cls.type_size
    if raw.size != expected:
        raise TensorShapeError(
            f"{cls.ggml_type.name} data for shape {shape} needs {expected} bytes, got {raw.size}"
        )
    return raw.reshape(-1, cls.type_size)


def unpack(data: Any, qtype: str | int | GGMLType, shape: Sequence[int]) -> Fields:
    """The named numpy field arrays of the blocks of a tensor of ``shape``."""
    cls = get(qtype)
    return cls.unpack(_blocks(data, cls, shape))


def dequantize(
    data: Any,
    qtype: str | int | GGMLType,
    shape: Sequence[int],
    *,
    xp: Any = None,
    device: Any = None,
) -> Any:
    """GGML bytes -> float32 array of ``shape`` (numpy order, rows last) in namespace ``xp``.

    ``xp`` is an array namespace, library module or name (default numpy); ``device`` is
    passed to ``xp.asarray``. Values are identical in every namespace.
    """
    cls = get(qtype)
    xp = namespace(xp)
    fields = cls.unpack(_blocks(data, cls, shape))
    fields = {
        k: xp.asarray(v, device=device) if device is not None else xp.asarray(v)
        for k, v in fields.items()
    }
    return xp.reshape(cls.dequantize_fields(fields, xp=xp), tuple(int(s) for s in shape))
