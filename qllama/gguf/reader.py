"""A validating GGUF reader over a read-only mmap.

GGUF files come from strangers, so every count, length, type id, dimension and offset is
checked before anything sized by it is allocated or looped over (the checklist of
``docs/security.md``), arithmetic on sizes uses Python ints, and every failure is a
:class:`~qllama.errors.GGUFError` naming the field, its byte offset, the value and the limit.
Tensor data is never copied: :meth:`GGUFFile.tensor_data` returns a read-only view of the map.

Layout (all little-endian)::

    header   "GGUF" | version u32 | n_tensors i64 | n_kv i64
    kv       key string | type i32 | value             (n_kv times)
    tensors  name string | n_dims u32 | ne i64[n_dims] | ggml type i32 | offset u64
    padding  to general.alignment (default 32), counted from the start of the GGUF
    data     tensor bytes, each at its offset, each padded to the alignment

A string is a u64 length and that many UTF-8 bytes; an array is an element type i32, a count
u64 and the elements.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qllama.errors import (
    GGUFDuplicateError,
    GGUFFormatError,
    GGUFLayoutError,
    GGUFLimitError,
    GGUFMagicError,
    GGUFOpenError,
    GGUFSizeError,
    GGUFTruncatedError,
    GGUFTypeError,
    GGUFVersionError,
    TensorShapeError,
)
from qllama.ggml_types import VALUE_FORMATS, GGMLType, ValueType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 20  # larger values only serve to blow up padding arithmetic
MAX_DIMS = 4
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64 with the terminating NUL
MAX_KEY_BYTES = 65535
MAX_STRING_BYTES = 64 << 20
MAX_ARRAY_ELEMENTS = 1 << 30
INT64_MAX = (1 << 63) - 1

HEADER_BYTES = 24
MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, 1-byte key, type, 1-byte value
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 4 + 8  # name length, 1-byte name, n_dims=0, type, offset

_NUMPY_DTYPES: dict[ValueType, str] = {
    ValueType.UINT8: "<u1",
    ValueType.INT8: "<i1",
    ValueType.UINT16: "<u2",
    ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4",
    ValueType.INT32: "<i4",
    ValueType.FLOAT32: "<f4",
    ValueType.BOOL: "<u1",
    ValueType.UINT64: "<u8",
    ValueType.INT64: "<i8",
    ValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class GGUFValue:
    """A metadata value with its GGUF type; arrays keep their element type.

    ``value`` is a Python ``int``, ``float``, ``bool`` or ``str``; a string array is a
    ``list[str]``; a numeric or bool array is a 1-D numpy array.
    """

    type: ValueType
    value: Any
    elem_type: ValueType | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GGUFValue):
            return NotImplemented
        if (self.type, self.elem_type) != (other.type, other.elem_type):
            return False
        if isinstance(self.value, np.ndarray) or isinstance(other.value, np.ndarray):
            a, b = np.asarray(self.value), np.asarray(other.value)
            return a.shape == b.shape and a.tobytes() == b.tobytes()
        return bool(self.value == other.value)

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lies and what it is. ``ne`` is GGUF order (``ne[0]`` varies fastest)."""

    name: str
    ne: tuple[int, ...]
    ggml_type: GGMLType
    offset: int  # from the start of the data section
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order: ``ne`` reversed, so rows are the last axis."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


class _Cursor:
    """Bounds-checked sequential reads from a buffer; offsets are absolute in the buffer."""

    def __init__(self, buf: Any, pos: int, end: int) -> None:
        self.buf = buf
        self.pos = pos
        self.end = end

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.remaining:
            raise GGUFTruncatedError(
                f"{what} at offset {self.pos} needs {n} bytes but the file has {self.remaining} "
                "left (truncated file?)"
            )

    def scalar(self, vtype: ValueType, what: str) -> Any:
        fmt = VALUE_FORMATS[vtype]
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return int(self.scalar(ValueType.UINT32, what))

    def i32(self, what: str) -> int:
        return int(self.scalar(ValueType.INT32, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(ValueType.UINT64, what))

    def i64(self, what: str) -> int:
        return int(self.scalar(ValueType.INT64, what))

    def raw_string(self, what: str, cap: int, limit_error: type[Exception]) -> bytes:
        start = self.pos
        n = self.u64(f"length of {what}")
        if n > cap:
            raise limit_error(f"{what} at offset {start} has length {n}, over the limit of {cap}")
        self.need(n, what)
        b = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return b

    def string(self, what: str, cap: int | None = None) -> str:
        start = self.pos
        raw = self.raw_string(what, MAX_STRING_BYTES if cap is None else cap, GGUFLimitError)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(
                f"{what} at offset {start} is not valid UTF-8 "
                f"(byte {e.start}: {raw[e.start : e.start + 4]!r})"
            ) from None


def _value_type(code: int, what: str, offset: int) -> ValueType:
    try:
        return ValueType(code)
    except ValueError:
        raise GGUFTypeError(
            f"{what} at offset {offset} has unknown value type {code} (known: 0..12)"
        ) from None


def _check_bool(v: int, what: str, offset: int) -> bool:
    if v not in (0, 1):
        raise GGUFFormatError(f"{what} at offset {offset} is a bool of value {v}, not 0 or 1")
    return bool(v)


def _read_value(cur: _Cursor, vtype: ValueType, key: str) -> GGUFValue:
    """One metadata value of type ``vtype`` (the type tag has been read)."""
    what = f"value of key '{key}'"
    start = cur.pos
    if vtype == ValueType.STRING:
        return GGUFValue(vtype, cur.string(what))
    if vtype != ValueType.ARRAY:
        v = cur.scalar(vtype, what)
        if vtype == ValueType.BOOL:
            v = _check_bool(v, what, start)
        return GGUFValue(vtype, v)

    # array: element type, count, elements; nested arrays are refused (no recursion)
    elem = _value_type(cur.i32(f"array type of key '{key}'"), f"array of key '{key}'", start)
    if elem == ValueType.ARRAY:
        raise GGUFTypeError(
            f"key '{key}' at offset {start} is an array of arrays (nested arrays unsupported)"
        )
    count_at = cur.pos
    count = cur.u64(f"array length of key '{key}'")
    if count > MAX_ARRAY_ELEMENTS:
        raise GGUFLimitError(
            f"array of key '{key}' at offset {count_at} has {count} elements, over the limit of "
            f"{MAX_ARRAY_ELEMENTS}"
        )
    # the smallest an element can be: its fixed size, or a string's 8-byte length
    min_size = 8 if elem == ValueType.STRING else struct.calcsize(VALUE_FORMATS[elem])
    if count * min_size > cur.remaining:
        raise GGUFSizeError(
            f"array of key '{key}' at offset {count_at} declares {count} elements of at least "
            f"{min_size} bytes but the file has {cur.remaining} bytes left"
        )
    if elem == ValueType.STRING:
        items = [cur.string(f"element {i} of key '{key}'") for i in range(count)]
        return GGUFValue(vtype, items, elem)
    dtype = np.dtype(_NUMPY_DTYPES[elem])
    arr = np.frombuffer(cur.buf, dtype=dtype, count=count, offset=cur.pos).copy()
    if elem == ValueType.BOOL:
        bad = np.flatnonzero(arr > 1)
        if bad.size:
            raise GGUFFormatError(
                f"element {bad[0]} of bool array '{key}' at offset {cur.pos + int(bad[0])} is "
                f"{arr[bad[0]]}, not 0 or 1"
            )
        arr = arr.astype(bool)
    cur.pos += count * dtype.itemsize
    return GGUFValue(vtype, arr, elem)


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class GGUFFile:
    """A parsed, validated GGUF: metadata, tensor infos, and views of the tensor bytes.

    Build one with :func:`read_gguf` (a path, mapped read-only) or :meth:`from_buffer`. Views
    returned by :meth:`tensor_data` keep the map alive; :meth:`close` releases it when no view
    is left.
    """

    def __init__(
        self,
        buf: Any,
        *,
        start: int = 0,
        path: Path | None = None,
        owner: mmap.mmap | None = None,
    ) -> None:
        self.path = path
        self._buf = buf
        self._owner = owner
        self.start = start
        self.kv: dict[str, GGUFValue] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse(_Cursor(buf, start, len(buf)))

    @classmethod
    def from_buffer(cls, buf: Any, *, start: int = 0) -> GGUFFile:
        """Parse a GGUF held in memory (``bytes``, ``memoryview``...) from byte ``start``."""
        return cls(buf, start=start)

    # -- parsing ---------------------------------------------------------------------------

    def _parse(self, cur: _Cursor) -> None:
        cur.need(HEADER_BYTES, "header")
        magic = bytes(cur.buf[cur.pos : cur.pos + 4])
        if magic != MAGIC:
            shown = "".join(chr(c) if 32 <= c < 127 else "?" for c in magic)
            raise GGUFMagicError(
                f"not a GGUF file: magic is '{shown}' ({magic.hex()}), expected 'GGUF'"
            )
        cur.pos += 4
        version = cur.u32("version")
        if version & 0xFFFF == 0 and version:
            raise GGUFVersionError(
                f"version field is {version:#010x}: a byte-swapped (big-endian) GGUF, which "
                "qllama does not read"
            )
        if version not in VERSIONS:
            raise GGUFVersionError(
                f"GGUF version {version} unsupported; supported {VERSIONS[0]}..{VERSIONS[-1]}"
            )
        self.version = version
        counts = {}
        for what in ("tensor count", "metadata count"):
            at = cur.pos
            counts[what] = n = cur.i64(what)
            if n < 0:
                raise GGUFLimitError(f"{what} at offset {at} is {n}, below 0")
        n_tensors, n_kv = counts["tensor count"], counts["metadata count"]
        need = n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES
        if need > cur.remaining:
            raise GGUFSizeError(
                f"header declares {n_tensors} tensors and {n_kv} metadata pairs, at least {need} "
                f"bytes, but the file has {cur.remaining} bytes after the header"
            )
        self._parse_kv(cur, n_kv)
        self.alignment = self._parse_alignment()
        self._parse_tensor_infos(cur, n_tensors)
        self.data_offset = self.start + _align(cur.pos - self.start, self.alignment)
        self._check_layout(cur.end)

    def _parse_kv(self, cur: _Cursor, n_kv: int) -> None:
        seen: dict[str, int] = {}
        for i in range(n_kv):
            at = cur.pos
            raw = cur.raw_string(f"key of metadata pair {i}", MAX_KEY_BYTES, GGUFFormatError)
            if not raw:
                raise GGUFFormatError(f"key of metadata pair {i} at offset {at} is empty")
            try:
                key = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise GGUFFormatError(
                    f"key of metadata pair {i} at offset {at} is not valid UTF-8: {raw[:32]!r}"
                ) from None
            if key in seen:
                raise GGUFDuplicateError(f"duplicate key '{key}' at offsets {seen[key]} and {at}")
            seen[key] = at
            type_at = cur.pos
            vtype = _value_type(cur.i32(f"type of key '{key}'"), f"key '{key}'", type_at)
            self.kv[key] = _read_value(cur, vtype, key)

    def _parse_alignment(self) -> int:
        v = self.kv.get("general.alignment")
        if v is None:
            return DEFAULT_ALIGNMENT
        if v.type != ValueType.UINT32:
            raise GGUFTypeError(
                f"key 'general.alignment' must be of type UINT32, not {v.type.name}"
            )
        a = int(v.value)
        if a == 0 or a & (a - 1):
            raise GGUFLayoutError(f"general.alignment is {a}, not a power of two")
        if a > MAX_ALIGNMENT:
            raise GGUFLimitError(f"general.alignment is {a}, over the limit of {MAX_ALIGNMENT}")
        return a

    def _parse_tensor_infos(self, cur: _Cursor, n_tensors: int) -> None:
        for i in range(n_tensors):
            at = cur.pos
            name = cur.string(f"name of tensor {i}", cap=MAX_KEY_BYTES)
            if not name:
                raise GGUFFormatError(f"name of tensor {i} at offset {at} is empty")
            if len(name.encode()) > MAX_NAME_BYTES:
                raise GGUFLimitError(
                    f"name of tensor {i} at offset {at} is {len(name.encode())} bytes, over the "
                    f"limit of {MAX_NAME_BYTES}"
                )
            if name in self.tensors:
                raise GGUFDuplicateError(
                    f"duplicate tensor name '{name}' (tensor {i}, offset {at})"
                )
            what = f"tensor '{name}'"
            dims_at = cur.pos
            n_dims = cur.u32(f"n_dims of {what}")
            if n_dims > MAX_DIMS:
                raise GGUFLimitError(
                    f"{what} at offset {dims_at} has n_dims {n_dims}, over the limit of {MAX_DIMS}"
                )
            ne = []
            for j in range(n_dims):
                d_at = cur.pos
                d = cur.i64(f"dimension {j} of {what}")
                if d < 0:
                    raise GGUFLayoutError(
                        f"dimension {j} of {what} at offset {d_at} is {d}, below 0"
                    )
                ne.append(d)
            n = 1
            for d in ne:
                n *= d
            if n > INT64_MAX:
                raise GGUFLimitError(f"{what} has shape {ne}: {n} elements, over the int64 limit")
            type_at = cur.pos
            code = cur.i32(f"type of {what}")
            try:
                gtype = GGMLType(code)
            except ValueError:
                raise GGUFTypeError(
                    f"{what} at offset {type_at} has unknown GGML type {code}"
                ) from None
            block = gtype.block
            row = ne[0] if ne else 1
            if row % block.block_size:
                raise TensorShapeError(
                    f"{what} of type {gtype.name} has rows of {row} elements, not a multiple of "
                    f"its block size {block.block_size}"
                )
            nbytes = gtype.nbytes(n)
            if nbytes > INT64_MAX:
                raise GGUFLimitError(f"{what} has {nbytes} bytes of data, over the int64 limit")
            offset = cur.u64(f"data offset of {what}")
            self.tensors[name] = TensorInfo(name, tuple(ne), gtype, offset, nbytes)

    def _check_layout(self, end: int) -> None:
        """Tensors lie back to back, each at the padded end of the one before (as llama.cpp
        requires), and inside the file. That rules out gaps, overlap and misalignment at once."""
        expected = 0
        for t in self.tensors.values():
            if t.offset % self.alignment:
                raise GGUFLayoutError(
                    f"tensor '{t.name}' has offset {t.offset}, not a multiple of the alignment "
                    f"{self.alignment}"
                )
            if t.offset != expected:
                raise GGUFLayoutError(
                    f"tensor '{t.name}' has offset {t.offset}, expected {expected} "
                    "(tensors must lie in order, without gaps or overlap)"
                )
            begin = self.data_offset + t.offset
            if begin + t.nbytes > end:
                raise GGUFTruncatedError(
                    f"data of tensor '{t.name}' spans bytes [{begin}, {begin + t.nbytes}) but the "
                    f"file ends at {end} (truncated file?)"
                )
            expected += _align(t.nbytes, self.alignment)

    # -- access ----------------------------------------------------------------------------

    @property
    def metadata(self) -> dict[str, Any]:
        """Plain values by key (strings, numbers, lists of strings, numpy arrays)."""
        return {k: v.value for k, v in self.kv.items()}

    def get(self, key: str, default: Any = None) -> Any:
        v = self.kv.get(key)
        return default if v is None else v.value

    @property
    def architecture(self) -> str | None:
        arch = self.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"no tensor '{name}' in {self.path or 'the file'}") from None

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the file (no copy)."""
        t = self.tensor(name)
        view = np.frombuffer(
            self._buf, dtype=np.uint8, count=t.nbytes, offset=self.data_offset + t.offset
        )
        view.flags.writeable = False
        return view

    def read_tensor(self, name: str, start: int, out: np.ndarray) -> None:
        """Bytes ``[start, start + out.size)`` of the tensor into ``out`` (uint8, contiguous):
        read from the file where this is a file's map, so that the map's pages stay untouched
        (a check of every byte leaves the process's resident set as it was); else copied
        from the buffer."""
        t = self.tensor(name)
        if start < 0 or start + out.size > t.nbytes:
            raise ValueError(
                f"bytes [{start}, {start + out.size}) lie outside tensor '{name}' "
                f"({t.nbytes} bytes)"
            )
        at = self.data_offset + t.offset + start
        if self.path is None or self._owner is None:
            out[:] = np.frombuffer(self._buf, dtype=np.uint8, count=out.size, offset=at)
            return
        with open(self.path, "rb") as f:
            f.seek(at)
            got = f.readinto(out.data)
        if got != out.size:
            raise GGUFTruncatedError(
                f"tensor '{name}': read {got} of {out.size} bytes at {at} of {self.path}"
            )

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)

    def close(self) -> None:
        """Release the map; if views are still alive it is released when they are."""
        if self._owner is not None:
            try:
                self._owner.close()
            except BufferError:
                pass  # live views hold it; the mmap object closes when they are collected

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = str(self.path) if self.path else "<buffer>"
        return f"GGUFFile({where!r}, v{self.version}, {len(self.kv)} keys, {len(self)} tensors)"


def _open_error(message: str, errno: int | None) -> GGUFOpenError:
    e = GGUFOpenError(message)
    e.errno = errno
    return e


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and validate a GGUF file; tensor data stays on disk behind a read-only map."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise _open_error(f"cannot open {path}: {e.strerror}", e.errno) from None
    if stat.S_ISDIR(st.st_mode):
        raise GGUFOpenError(f"{path} is a directory, not a GGUF file")
    if not stat.S_ISREG(st.st_mode):
        raise GGUFOpenError(f"{path} is not a regular file")
    if st.st_size < HEADER_BYTES:
        raise GGUFTruncatedError(f"header needs {HEADER_BYTES} bytes, {path} has {st.st_size}")
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise _open_error(f"cannot map {path}: {e.strerror}", e.errno) from None
    try:
        return GGUFFile(mm, path=path, owner=mm)
    except BaseException:
        mm.close()
        raise
