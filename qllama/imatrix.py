"""Importance matrices: llama.cpp's two file formats, and computing one as llama-imatrix does.

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

Computing (:func:`compute`): the text is tokenized as llama.cpp does (BOS per the vocabulary,
special tokens not parsed), cut into chunks of ``n_ctx`` tokens (at least two are needed), each
chunk run as a sequence of its own with its first token replaced by BOS where the vocabulary
adds one, and every matmul with at least 16 activation rows whose weight is named ``blk.*``
(and ``output.weight`` with ``process_output``) adds ``x[t, j]**2`` row by row in float32 to
its sums, as llama-imatrix's callback does.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qllama.atomic import atomic_write
from qllama.errors import GGUFError, ImatrixError
from qllama.ggml_types import GGMLType, ValueType
from qllama.gguf_reader import MAGIC, GGUFValue, read_gguf
from qllama.gguf_writer import GGUFWriter

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


# --- computing ----------------------------------------------------------------------------------


def collected(name: str, *, process_output: bool) -> bool:
    """Whether llama-imatrix collects the activations entering weight ``name``."""
    return name.startswith("blk.") or (process_output and name == "output.weight")


@dataclass
class _Named:
    """A prepared weight and its name (what the collector needs to file an activation)."""

    name: str
    shape: tuple[int, int]
    inner: Any


class Collector:
    """A backend that computes with another and files the activations of its matmuls.

    Load a model on it (``qllama.load(path, backend=Collector(inner))``); every matmul of a
    collected weight (:func:`collected`) with at least 16 rows adds each row's squares to the
    weight's float32 sums, in row order, and the row count to its count.
    """

    def __init__(self, inner: Any, *, process_output: bool = False) -> None:
        self.inner = inner
        self.process_output = process_output
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}
        self.name = f"imatrix({inner.name})"

    def __getattr__(self, attr: str) -> Any:  # xp, device, dequantize_all, asarray, supports
        return getattr(self.inner, attr)

    def prepare(self, tensor: Any) -> _Named:
        return _Named(tensor.name, tensor.shape, self.inner.prepare(tensor))

    def embedding(self, ids: Any, w: _Named) -> Any:
        return self.inner.embedding(ids, w.inner)

    def matmul(self, x: Any, w: _Named) -> Any:
        if collected(w.name, process_output=self.process_output) and x.shape[0] >= MIN_ROWS:
            from qllama.array_api import to_numpy

            rows = np.asarray(to_numpy(x), dtype=F32)
            acc = self.sums.setdefault(w.name, np.zeros(rows.shape[1], F32))
            for sq in rows * rows:  # C: acc[j] += x[j]*x[j], one row after another
                acc += sq
            self.counts[w.name] = self.counts.get(w.name, 0) + rows.shape[0]
            if not np.isfinite(acc).all():
                raise ImatrixError(f"non-finite activations entering '{w.name}'")
        return self.inner.matmul(x, w.inner)


def tokenize(tokenizer: Any, text: str) -> list[int]:
    """The corpus's tokens as llama-imatrix gets them: ``common_tokenize(text,
    add_special=true, parse_special=false)``, the whole text at once (``tokenizer``: a
    model's, or a :class:`~qllama.tokenizer.Tokenizer`)."""
    from qllama.tokenizer import Tokenizer

    vocab = getattr(tokenizer, "tokenizer", tokenizer).vocab
    return Tokenizer(vocab, max_chars=max(len(text), 1)).encode(text, special=False)


def _check_length(n_tokens: int, n_ctx: int, skip_chunks: int = 0) -> None:
    if n_ctx < 1:
        raise ImatrixError(f"n_ctx must be positive, not {n_ctx}")
    if skip_chunks < 0:
        raise ImatrixError(f"skip_chunks must be 0 or more, not {skip_chunks}")
    if skip_chunks and (skip_chunks + 2) * n_ctx >= n_tokens:
        # llama-imatrix --chunk: refused unless more than two chunks are left after the skip
        raise ImatrixError(
            f"the corpus has {n_tokens} tokens; after skipping {skip_chunks} chunks of "
            f"{n_ctx} too few are left (llama-imatrix needs more than 2 * n_ctx)"
        )
    if n_tokens < 2 * n_ctx:
        raise ImatrixError(
            f"the corpus has {n_tokens} tokens; llama-imatrix needs at least 2 * n_ctx = "
            f"{2 * n_ctx}"
        )


def compute(
    model: Any,
    text: str | Iterable[int],
    *,
    n_ctx: int = DEFAULT_CTX,
    n_chunks: int | None = None,
    skip_chunks: int = 0,
    dataset: str | None = None,
    progress: Any = None,
) -> ImportanceMatrix:
    """The importance matrix of ``model`` (loaded on a :class:`Collector`) over a corpus.

    ``text`` is the corpus (or its token ids); chunks of ``n_ctx`` tokens, at most
    ``n_chunks`` of them, after the first ``skip_chunks`` (llama-imatrix ``--chunk``: a
    calibration text kept apart from an evaluation on the corpus's start). ``dataset`` names
    the corpus in the file (llama-imatrix writes its ``-f`` path). ``progress(i, n)`` is
    called before each chunk.
    """
    backend = model.backend
    if not isinstance(backend, Collector):
        raise ImatrixError("load the model on an imatrix.Collector to compute an imatrix")
    tokens = tokenize(model, text) if isinstance(text, str) else [int(t) for t in text]
    _check_length(len(tokens), n_ctx, skip_chunks)
    tokens = tokens[skip_chunks * n_ctx :]
    n_chunk = len(tokens) // n_ctx
    if n_chunks is not None and n_chunks >= 0:
        n_chunk = min(n_chunk, n_chunks)
    bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None
    for i in range(n_chunk):
        if progress is not None:
            progress(i, n_chunk)
        chunk = tokens[i * n_ctx : (i + 1) * n_ctx]
        if bos is not None:
            chunk[0] = bos  # llama-imatrix: the first token of every chunk becomes BOS
        model.forward(chunk, 0, all_logits=True)  # every position, as llama-imatrix asks
    entries = {
        name: Entry(
            backend.sums[name].reshape(1, -1).copy(), np.array([backend.counts[name]], np.int64)
        )
        for name in sorted(backend.sums)
    }
    chunk_count = max((c // n_ctx for c in backend.counts.values()), default=0)
    return ImportanceMatrix(
        entries,
        datasets=[dataset] if dataset else [],
        chunk_count=chunk_count,
        chunk_size=n_ctx,
    )


def from_corpus(
    path: str | os.PathLike[str],
    text: str,
    *,
    backend: Any = None,
    n_ctx: int = DEFAULT_CTX,
    n_chunks: int | None = None,
    skip_chunks: int = 0,
    process_output: bool = False,
    dataset: str | None = None,
    progress: Any = None,
    **load_options: Any,
) -> ImportanceMatrix:
    """Load the model at ``path`` on ``backend`` (default numpy: the CPU arithmetic, as
    llama-imatrix computes) and :func:`compute` its importance matrix over ``text``."""
    from qllama.backends import get_backend
    from qllama.loader import load
    from qllama.tokenizer import Tokenizer

    # the corpus first: a short one is refused before the model is built
    tokens = tokenize(Tokenizer.from_gguf(path), text)
    _check_length(len(tokens), n_ctx, skip_chunks)
    inner = get_backend(backend) if backend is None or isinstance(backend, str) else backend
    collector = Collector(inner, process_output=process_output)
    model = load(path, backend=collector, n_ctx=n_ctx, **load_options)
    try:
        return compute(
            model,
            tokens,
            n_ctx=n_ctx,
            n_chunks=n_chunks,
            skip_chunks=skip_chunks,
            dataset=dataset,
            progress=progress,
        )
    finally:
        model.source.close()


__all__ = [
    "Collector",
    "Entry",
    "ImportanceMatrix",
    "collected",
    "compute",
    "from_corpus",
    "read_imatrix",
    "tokenize",
    "write_imatrix",
]
