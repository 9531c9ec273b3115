"""Importance matrices: llama.cpp's two file formats (computing one: qllama.measure.importance).

An importance matrix holds, for every weight matrix W of a model, the sum over a corpus of the
squared activations entering each of W's input columns (``in_sum2``), and how many tokens
were summed (``counts``; one per expert slice of a 3-D weight). llama-quantize divides one by
the other and hands the per-column means to ggml, whose quantizers weight their error by them
(:func:`qllama.quants.quantize`'s ``imatrix``).

Formats (read both, write both; refuse malformed files with :class:`ImatrixError`):

* GGUF (llama-imatrix's default): ``general.type = "imatrix"``, ``imatrix.datasets`` (strings),
  ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (u32); per weight, in name order, the F32
  tensors ``W.in_sum2`` (ne ``[n_per_row, n_mat]``, raw sums) and ``W.counts`` (ne ``[1,
  n_mat]``, token counts). llama-quantize requires the three ``imatrix.*`` keys.
* legacy ``.dat``: int32 count of entries; per entry (names sorted, entries with no data
  left out) int32 name length, the name, int32 ``ncall``, int32 ``nval``, ``nval`` float32
  values = ``(sum / count) * ncall``; then optionally int32 chunk count, int32 length and the
  dataset's name. llama-quantize divides the values by ``ncall``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qllama.atomic import atomic_write
from qllama.errors import GGUFError, ImatrixError
from qllama.ggml_types import GGMLType, ValueType
from qllama.gguf.reader import MAGIC, GGUFValue, read_gguf
from qllama.gguf.writer import GGUFWriter

F32 = np.float32
SUM_SUFFIX = ".in_sum2"
COUNT_SUFFIX = ".counts"
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
MIN_ROWS = 16  # llama-imatrix ignores matmuls of fewer activation rows
DEFAULT_CTX = 512  # llama-imatrix's default --ctx-size
_NAME_LIMIT = 1 << 16  # longest tensor name a legacy file may declare


@dataclass
class Entry:
    """One weight's data as the file holds it.

    GGUF: ``sums`` ``(n_mat, n_per_row)`` raw sums of squares, ``counts`` ``(n_mat,)``
    tokens summed. Legacy: ``sums`` ``(1, nval)`` the stored values, ``counts`` ``[ncall]``.
    """

    sums: np.ndarray
    counts: np.ndarray


@dataclass
class ImportanceMatrix:
    """An importance matrix: its entries by weight name, and the file's metadata."""

    entries: dict[str, Entry]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    legacy: bool = False

    def means(self) -> dict[str, np.ndarray]:
        """Per weight, what llama-quantize passes to ggml: ``n_mat * n_per_row`` float32.

        GGUF: ``sums / count`` per slice (float32 division; a slice with no tokens becomes
        all 1.0). Legacy: ``values / ncall`` (the values as they are when ``ncall`` is 0).
        """
        out = {}
        for name, e in self.entries.items():
            if self.legacy:
                ncall = int(e.counts[0]) if e.counts.size else 0
                v = e.sums / F32(ncall) if ncall > 0 else e.sums.copy()
            else:
                c = e.counts.astype(F32)[:, None]
                with np.errstate(divide="ignore", invalid="ignore"):
                    v = np.where(c > 0, e.sums / np.where(c > 0, c, F32(1)), F32(1))
            out[name] = np.ascontiguousarray(v, dtype=F32).reshape(-1)
        return out

    def for_tensors(self, tensors: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """:meth:`means`, checked against a model's weights (name -> numpy shape).

        Every name must be one of the model's tensors, with ``n_per_row * n_mat`` values
        (``n_mat`` the number of expert slices of a 3-D weight, else 1); llama-quantize
        throws on a wrong length too (not for ``token_embd.weight``, which it then quantizes
        without) and quietly ignores unknown names, which qllama refuses instead.
        """
        means = self.means()
        unknown = sorted(n for n in means if n not in tensors)
        if unknown:
            shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            raise ImatrixError(
                f"the importance matrix has {len(unknown)} entries that match no tensor of "
                f"the model: {shown}"
            )
        out = {}
        for name, v in means.items():
            shape = tensors[name]
            want = shape[-1] * (shape[0] if len(shape) == 3 else 1)
            if v.size != want:
                if name == "token_embd.weight":  # llama-quantize: quantized without one
                    continue
                raise ImatrixError(
                    f"importance matrix entry '{name}' has {v.size} values; the tensor of "
                    f"shape {list(shape)} needs {want}"
                )
            out[name] = v
        return out


# --- reading ------------------------------------------------------------------------------------


def read_imatrix(path: str | os.PathLike[str]) -> ImportanceMatrix:
    """Read an importance matrix in either format (GGUF by its magic, else legacy ``.dat``)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ImatrixError(
            f"cannot open importance matrix {os.fspath(path)!r}: {e.strerror}"
        ) from None
    if head == MAGIC:
        return _read_gguf(path)
    return _read_legacy(Path(path).read_bytes(), os.fspath(path))


def _finite(name: str, v: np.ndarray, what: str) -> None:
    if not np.isfinite(v).all():
        raise ImatrixError(f"importance matrix entry '{name}' has non-finite {what}")


def _read_gguf(path: str | os.PathLike[str]) -> ImportanceMatrix:
    try:
        f = read_gguf(path)
    except GGUFError as e:
        raise ImatrixError(f"{os.fspath(path)}: not a valid GGUF importance matrix: {e}") from None
    with f:
        kind = f.get("general.type")
        if kind is not None and kind != "imatrix":
            raise ImatrixError(
                f"{os.fspath(path)} is a GGUF of general.type {kind!r}, not an imatrix"
            )
        missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in f.kv]
        if missing:
            raise ImatrixError(f"{os.fspath(path)}: missing imatrix metadata {', '.join(missing)}")
        ds = f.kv[KEY_DATASETS]
        if ds.type != ValueType.ARRAY or ds.elem_type != ValueType.STRING:
            raise ImatrixError(f"{KEY_DATASETS} must be an array of strings, not {ds.type.name}")
        counts_meta = {}
        for key in (KEY_CHUNK_COUNT, KEY_CHUNK_SIZE):
            v = f.kv[key]
            if v.type != ValueType.UINT32:
                raise ImatrixError(f"{key} must be a UINT32, not {v.type.name}")
            counts_meta[key] = int(v.value)
        pairs: dict[str, dict[str, Any]] = {}
        for t in f:
            for suffix in (SUM_SUFFIX, COUNT_SUFFIX):
                if t.name.endswith(suffix) and len(t.name) > len(suffix):
                    pairs.setdefault(t.name[: -len(suffix)], {})[suffix] = t
                    break
            else:
                raise ImatrixError(
                    f"tensor '{t.name}' is neither a {SUM_SUFFIX} nor a {COUNT_SUFFIX}"
                )
        if not pairs:
            raise ImatrixError(f"{os.fspath(path)}: no data (no tensors)")
        entries = {}
        for name in sorted(pairs):
            p = pairs[name]
            if len(p) != 2:
                raise ImatrixError(f"mismatched sums and counts for '{name}'")
            s, c = p[SUM_SUFFIX], p[COUNT_SUFFIX]
            if s.ggml_type != GGMLType.F32 or c.ggml_type != GGMLType.F32:
                raise ImatrixError(f"sums and counts for '{name}' must be F32")
            n_mat = c.n_elements
            if n_mat < 1 or s.n_elements % n_mat or s.n_elements == 0:
                raise ImatrixError(
                    f"'{name}': {s.n_elements} sums do not divide into {n_mat} count(s)"
                )
            sums = f.tensor_data(s.name).view("<f4").astype(F32).reshape(n_mat, -1)
            raw_counts = f.tensor_data(c.name).view("<f4").astype(F32)
            _finite(name, sums, "sums")
            _finite(name, raw_counts, "counts")
            if (raw_counts < 0).any():
                raise ImatrixError(f"importance matrix entry '{name}' has negative counts")
            # C: std::lround, halves away from zero
            counts = np.floor(raw_counts.astype(np.float64) + 0.5).astype(np.int64)
            entries[name] = Entry(sums, counts)
        return ImportanceMatrix(
            entries,
            datasets=[str(x) for x in ds.value],
            chunk_count=counts_meta[KEY_CHUNK_COUNT],
            chunk_size=counts_meta[KEY_CHUNK_SIZE],
        )


class _Bytes:
    """A bounds-checked reader of a legacy imatrix file."""

    def __init__(self, data: bytes, path: str) -> None:
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ImatrixError(
                f"{self.path}: truncated legacy imatrix: {what} needs {n} bytes at offset "
                f"{self.pos}, {len(self.data) - self.pos} left"
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def i32(self, what: str) -> int:
        return int(struct.unpack("<i", self.take(4, what))[0])

    @property
    def left(self) -> int:
        return len(self.data) - self.pos


def _read_legacy(data: bytes, path: str) -> ImportanceMatrix:
    r = _Bytes(data, path)
    n_entries = r.i32("the entry count")
    if n_entries < 1:
        raise ImatrixError(
            f"{path}: not an importance matrix (GGUF, or legacy with {n_entries} entries)"
        )
    if n_entries > len(data) // 16:  # each entry takes at least 16 bytes
        raise ImatrixError(f"{path}: {n_entries} entries cannot fit in {len(data)} bytes")
    entries: dict[str, Entry] = {}
    for i in range(n_entries):
        size = r.i32(f"entry {i}'s name length")
        if not 0 < size <= _NAME_LIMIT:
            raise ImatrixError(f"{path}: entry {i} has a name of {size} bytes")
        try:
            name = r.take(size, f"entry {i}'s name").decode("utf-8")
        except UnicodeDecodeError:
            raise ImatrixError(f"{path}: entry {i}'s name is not UTF-8") from None
        ncall = r.i32(f"entry {name}'s ncall")
        nval = r.i32(f"entry {name}'s value count")
        if nval < 1:
            raise ImatrixError(f"{path}: entry '{name}' has {nval} values")
        values = np.frombuffer(r.take(4 * nval, f"entry {name}'s values"), "<f4").astype(F32)
        _finite(name, values, "values")
        if name in entries:
            raise ImatrixError(f"{path}: entry '{name}' appears twice")
        entries[name] = Entry(values.reshape(1, -1), np.array([ncall], np.int64))
    m = ImportanceMatrix(entries, legacy=True)
    if r.left:  # the optional trailer: chunk count, then the dataset's name
        m.chunk_count = r.i32("the chunk count")
        if r.left:
            size = r.i32("the dataset name's length")
            if size > 0:
                m.datasets.append(r.take(size, "the dataset name").decode("utf-8", "replace"))
        if r.left:
            raise ImatrixError(f"{path}: {r.left} bytes after the end of the legacy imatrix")
    return m


# --- writing ------------------------------------------------------------------------------------


def write_imatrix(
    path: str | os.PathLike[str], m: ImportanceMatrix, *, fmt: str | None = None
) -> None:
    """Write ``m`` as llama-imatrix does: GGUF (``fmt="gguf"``, the default unless the path
    ends in ``.dat``) or legacy (``"dat"``, from a GGUF-style matrix: raw sums and counts)."""
    fmt = fmt or ("dat" if os.fspath(path).endswith(".dat") else "gguf")
    if fmt not in ("gguf", "dat"):
        raise ImatrixError(f"imatrix format must be 'gguf' or 'dat', not {fmt!r}")
    if m.legacy:
        raise ImatrixError("a legacy matrix holds normalised values; write it from raw sums")
    if fmt == "gguf":
        _write_gguf(path, m)
    else:
        _write_legacy(path, m)


def _write_gguf(path: str | os.PathLike[str], m: ImportanceMatrix) -> None:
    w = GGUFWriter()
    w.add("general.type", "imatrix")
    w.add(KEY_DATASETS, GGUFValue(ValueType.ARRAY, list(m.datasets), ValueType.STRING))
    w.add(KEY_CHUNK_COUNT, GGUFValue(ValueType.UINT32, int(m.chunk_count)))
    w.add(KEY_CHUNK_SIZE, GGUFValue(ValueType.UINT32, int(m.chunk_size)))
    for name in sorted(m.entries):
        e = m.entries[name]
        n_mat = e.counts.size
        w.add_tensor(name + SUM_SUFFIX, np.ascontiguousarray(e.sums, F32).reshape(n_mat, -1), "F32")
        w.add_tensor(name + COUNT_SUFFIX, e.counts.astype(F32).reshape(n_mat, 1), "F32")
    w.write(path)


def _write_legacy(path: str | os.PathLike[str], m: ImportanceMatrix) -> None:
    if m.chunk_size < 1:
        raise ImatrixError("a legacy imatrix needs the chunk size (ncall = tokens / chunk size)")
    names = sorted(n for n, e in m.entries.items() if (e.counts != 0).any())
    parts = [struct.pack("<i", len(names))]
    for name in names:
        e = m.entries[name]
        raw = name.encode()
        # C: ceiling division of the largest count by the chunk size, in int
        ncall = (int(e.counts.max()) + m.chunk_size - 1) // m.chunk_size
        count = np.repeat(e.counts.astype(F32), e.sums.shape[1])
        value = e.sums.reshape(-1).astype(F32)
        empty = count == 0  # a slice with no data is written as 1
        value = np.where(empty, F32(1), value)
        count = np.where(empty, F32(1), count)
        parts += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, value.size)]
        parts.append(((value / count) * F32(ncall)).astype("<f4").tobytes())
    dataset = (m.datasets[-1] if m.datasets else "").encode()
    parts.append(struct.pack("<ii", m.chunk_count, len(dataset)) + dataset)
    with atomic_write(path) as f:
        f.write(b"".join(parts))


__all__ = [
    "DEFAULT_CTX",
    "MIN_ROWS",
    "Entry",
    "ImportanceMatrix",
    "read_imatrix",
    "write_imatrix",
]
