"""Write GGUF files: metadata of every value type, tensors of every GGML type, aligned.

The file is written to a temporary name and renamed, so a reader never sees half of it.
Tensor data can be given as arrays or as callables that produce them, which lets a quantizer
stream a model through one tensor at a time.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from qllama.atomic import atomic_write
from qllama.errors import TensorShapeError
from qllama.ggml_types import VALUE_FORMATS, GGMLType, ValueType
from qllama.gguf.reader import DEFAULT_ALIGNMENT, MAGIC, GGUFValue, _align, read_gguf

TensorData = np.ndarray | Callable[[], np.ndarray]

# numpy dtype -> GGUF type, for inferring array element types
_DTYPE_VALUE_TYPES = {
    np.dtype(np.uint8): ValueType.UINT8,
    np.dtype(np.int8): ValueType.INT8,
    np.dtype(np.uint16): ValueType.UINT16,
    np.dtype(np.int16): ValueType.INT16,
    np.dtype(np.uint32): ValueType.UINT32,
    np.dtype(np.int32): ValueType.INT32,
    np.dtype(np.float32): ValueType.FLOAT32,
    np.dtype(np.bool_): ValueType.BOOL,
    np.dtype(np.uint64): ValueType.UINT64,
    np.dtype(np.int64): ValueType.INT64,
    np.dtype(np.float64): ValueType.FLOAT64,
}


def infer_value(value: Any) -> GGUFValue:
    """Wrap a plain value with the GGUF type a reader would expect for it.

    bool -> BOOL, int -> INT32 (INT64 when it does not fit), float -> FLOAT32, str -> STRING,
    a list of str -> string array, a numpy array -> an array of its dtype, any other list ->
    a numpy array of it. Pass a :class:`GGUFValue` to choose the type yourself.
    """
    if isinstance(value, GGUFValue):
        return value
    if isinstance(value, bool | np.bool_):
        return GGUFValue(ValueType.BOOL, bool(value))
    if isinstance(value, int | np.integer):
        v = int(value)
        return GGUFValue(ValueType.INT32 if -(2**31) <= v < 2**31 else ValueType.INT64, v)
    if isinstance(value, float | np.floating):
        return GGUFValue(ValueType.FLOAT32, float(value))
    if isinstance(value, str):
        return GGUFValue(ValueType.STRING, value)
    if isinstance(value, list | tuple) and value and all(isinstance(v, str) for v in value):
        return GGUFValue(ValueType.ARRAY, list(value), ValueType.STRING)
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.dtype not in _DTYPE_VALUE_TYPES:
        raise TypeError(
            f"cannot store {type(value).__name__} of dtype {arr.dtype} in GGUF metadata"
        )
    return GGUFValue(ValueType.ARRAY, arr, _DTYPE_VALUE_TYPES[arr.dtype])


def _pack_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _pack_value(v: GGUFValue) -> bytes:
    if v.type == ValueType.STRING:
        return _pack_string(v.value)
    if v.type != ValueType.ARRAY:
        return struct.pack(VALUE_FORMATS[v.type], v.value)
    if v.elem_type is None or v.elem_type == ValueType.ARRAY:
        raise TypeError("an array value needs a non-array element type")
    head = struct.pack("<iQ", v.elem_type, len(v.value))
    if v.elem_type == ValueType.STRING:
        return head + b"".join(_pack_string(s) for s in v.value)
    fmt = VALUE_FORMATS[v.elem_type]
    return head + np.asarray(v.value).astype(np.dtype(fmt[1]).newbyteorder("<")).tobytes()


@dataclass
class _PendingTensor:
    name: str
    shape: tuple[int, ...]  # numpy order
    ggml_type: GGMLType
    data: TensorData
    nbytes: int


class GGUFWriter:
    """Collect metadata and tensors, then :meth:`write` them as one GGUF file.

    >>> w = GGUFWriter()
    >>> w.add("general.architecture", "llama")
    >>> w.add_tensor("x.weight", np.zeros((2, 32), np.float32), "F32")
    >>> w.write(path)  # doctest: +SKIP
    """

    def __init__(self, *, alignment: int = DEFAULT_ALIGNMENT, version: int = 3) -> None:
        self.version = version
        self.kv: dict[str, GGUFValue] = {}
        self.tensors: list[_PendingTensor] = []
        if alignment != DEFAULT_ALIGNMENT:
            self.add("general.alignment", GGUFValue(ValueType.UINT32, alignment))

    @property
    def alignment(self) -> int:
        """``general.alignment`` if set (it must be a u32 power of two), else 32."""
        v = self.kv.get("general.alignment")
        if v is None:
            return DEFAULT_ALIGNMENT
        a = int(v.value)
        if v.type != ValueType.UINT32 or a <= 0 or a & (a - 1):
            raise ValueError(f"general.alignment must be a UINT32 power of two, not {v}")
        return a

    def add(self, key: str, value: Any) -> None:
        """Set a metadata key; a plain value's type is inferred (see :func:`infer_value`)."""
        if not key:
            raise ValueError("metadata keys cannot be empty")
        self.kv[key] = infer_value(value)

    def add_tensor(
        self,
        name: str,
        data: TensorData,
        ggml_type: str | GGMLType,
        shape: Sequence[int] | None = None,
    ) -> None:
        """Add a tensor of ``shape`` (numpy order, rows last) stored as ``ggml_type``.

        ``data`` is the stored bytes (uint8) or, for F32/F16 and the like, an array of that
        dtype; or a zero-argument callable returning either, called once while writing.
        ``shape`` defaults to the array's shape, and is required for quantized bytes.
        """
        gtype = ggml_type if isinstance(ggml_type, GGMLType) else GGMLType[ggml_type]
        if any(t.name == name for t in self.tensors):
            raise ValueError(f"tensor '{name}' added twice")
        if shape is None:
            raw_bytes = np.asarray(data).dtype == np.uint8 and gtype.block.type_size != 1
            if callable(data) or raw_bytes:
                raise ValueError(f"tensor '{name}': give the shape of quantized or lazy data")
            shape = np.asarray(data).shape
        shape = tuple(int(s) for s in shape)
        block = gtype.block
        row = shape[-1] if shape else 1
        if row % block.block_size:
            raise TensorShapeError(
                f"tensor '{name}': rows of {row} are not a multiple of the {gtype.name} block "
                f"size {block.block_size}"
            )
        n = int(np.prod(shape, dtype=object)) if shape else 1
        self.tensors.append(_PendingTensor(name, shape, gtype, data, gtype.nbytes(n)))

    def _header(self, alignment: int) -> bytes:
        parts = [MAGIC, struct.pack("<Iqq", self.version, len(self.tensors), len(self.kv))]
        for key, v in self.kv.items():
            parts += [_pack_string(key), struct.pack("<i", v.type), _pack_value(v)]
        offset = 0
        for t in self.tensors:
            ne = tuple(reversed(t.shape)) or (1,)
            parts += [
                _pack_string(t.name),
                struct.pack(f"<I{len(ne)}q", len(ne), *ne),
                struct.pack("<iQ", t.ggml_type, offset),
            ]
            offset += _align(t.nbytes, alignment)
        return b"".join(parts)

    def _tensor_bytes(self, t: _PendingTensor) -> np.ndarray:
        data = t.data() if callable(t.data) else t.data
        arr = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if arr.nbytes != t.nbytes:
            raise TensorShapeError(
                f"tensor '{t.name}' ({t.ggml_type.name} {list(t.shape)}) needs {t.nbytes} bytes, "
                f"its data has {arr.nbytes}"
            )
        return arr

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the file atomically (temporary name, then rename)."""
        with atomic_write(path) as f:
            self.write_to(f)

    def write_to(self, f: IO[bytes]) -> None:
        """Write the GGUF to an open binary stream."""
        alignment = self.alignment
        header = self._header(alignment)
        f.write(header)
        f.write(b"\0" * (_align(len(header), alignment) - len(header)))
        for t in self.tensors:
            f.write(self._tensor_bytes(t).data)
            f.write(b"\0" * (_align(t.nbytes, alignment) - t.nbytes))


def copy_metadata(src: Any, dst: GGUFWriter, *, skip: Sequence[str] = ()) -> None:
    """Copy every metadata value of a :class:`~qllama.gguf.reader.GGUFFile`, types included."""
    for key, v in src.kv.items():
        if key not in skip:
            dst.add(key, v)


def rewrite(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, drop: Sequence[str] = ()
) -> None:
    """Copy a GGUF file without the metadata keys ``drop`` (every other value with its type,
    every tensor byte for byte): a file as a converter that did not write those keys made it."""
    f = read_gguf(src)
    w = GGUFWriter(alignment=f.alignment)
    copy_metadata(f, w, skip=drop)
    for t in f:
        w.add_tensor(t.name, f.tensor_data(t.name), t.ggml_type, t.shape)
    w.write(dst)


__all__ = ["GGUFWriter", "copy_metadata", "infer_value", "rewrite"]
