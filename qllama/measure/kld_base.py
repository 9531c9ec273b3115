"""Base files for KL divergence: a base model's log-probabilities over a corpus, on disk.

A base is written one window at a time while the corpus is scored and read back one window at
a time while another model is compared with it, so memory stays at one window's rows however
long the corpus is (50k tokens over a 262k vocabulary would be 26 GB of float32 log-probs in
memory). Files are written to a temporary name and renamed when the last window is in; an
interrupted run leaves nothing behind (:func:`qllama.atomic.atomic_write`).

Two formats, chosen by what the smallest reported KLD must resolve (docs/perplexity.md
measures each one's floor):

* ``llama``: ``llama-perplexity --kl-divergence-base``'s own file, byte for byte, so either
  tool reads the other's base. Header ``"_logits_"``, uint32 ``n_ctx``, int32 ``n_vocab``,
  int32 ``n_chunk``, int32 tokens ``[n_chunk * n_ctx]``; then per scored position
  ``nv = 2 * ((n_vocab + 1) // 2) + 4`` uint16: two float32 (``scale``, ``min_log_prob``)
  and each token's log-prob as ``round((logit - min_logit) / scale)``, where ``min_logit``
  is floored at ``max_logit - 16`` and anything at or below it is 0. One step is
  ``16 / 65535 = 2.4e-4`` nats at most, and KL sums skip log-probs at or below -16: a
  KLD below about 1e-4 is not resolved (llama.cpp's README: 5e-4 on Llama-3-8B).
* ``f32``: qllama's file: the base model's float32 logits themselves, unchanged, with a JSON
  header that records where the base came from; log-probs are taken in float64 when read, so
  storage loses nothing. Twice the size of ``llama`` (49k vocabulary: 197 KB per scored
  position, 1 GB for 5k positions): for corpora of a few thousand positions.

float16 log-probs, the same size as ``llama``, are not offered: a float16 step is 2.4e-4 at
|log p| = 0.5 and grows with |log p|, and on random logits they resolve KL ten times worse
than llama.cpp's scaled uint16.

Per-token values against a base (:meth:`BaseFile.token_values`) follow the format: for
``llama`` they are llama-perplexity's float32 arithmetic on the decoded uint16 values (same
top on the decoded values, KL over log-probs above -16), so both tools give the same numbers
from the same logits; for ``f32`` they are the exact float64 values of
:func:`qllama.measure.metrics.token_values` over the whole vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from qllama.atomic import atomic_write
from qllama.errors import QllamaError
from qllama.measure import metrics

FORMATS = ("llama", "f32")
LLAMA_MAGIC = b"_logits_"
QLLAMA_MAGIC = b"_qlbase_"
QLLAMA_VERSION = 1
FLOOR = 16.0  # llama.cpp keeps log-probs down to max - 16 nats and skips them below -16
ROW_BLOCK = 32  # rows decoded and compared at once: bounds the float32 temporaries


class BaseFileError(QllamaError):
    """A base file is malformed, truncated, or does not fit the model or the windows."""


def scored(n_ctx: int) -> int:
    """Positions scored per window: ``n_ctx/2 ... n_ctx-2`` (llama-perplexity's rule)."""
    return n_ctx - 1 - n_ctx // 2


def llama_row_width(n_vocab: int) -> int:
    """uint16 per scored position in llama.cpp's format."""
    return 2 * ((n_vocab + 1) // 2) + 4


# --- llama.cpp's uint16 log-probs -------------------------------------------------------------


def encode_llama(logits: np.ndarray) -> np.ndarray:
    """Rows of logits ``(n, vocab)`` as llama.cpp's uint16 rows ``(n, nv)``, with its float32
    arithmetic (``log_softmax`` with a ``uint16 *`` in tools/perplexity/perplexity.cpp)."""
    z = np.asarray(logits, dtype=np.float32)
    n, n_vocab = z.shape
    out = np.zeros((n, llama_row_width(n_vocab)), dtype=np.uint16)
    hi = z.max(axis=1)
    lo = np.maximum(z.min(axis=1), hi - np.float32(FLOOR))
    sum_exp = np.exp(z - hi[:, None]).sum(axis=1, dtype=np.float64)  # expf, summed in double
    log_sum_exp = np.log(sum_exp).astype(np.float32)
    min_log_prob = (lo - hi) - log_sum_exp
    scale = (hi - lo) / np.float32(65535)
    head = np.stack([scale, min_log_prob], axis=1).astype("<f4")  # (n, 2)
    out[:, :4] = head.view("<u2")
    with np.errstate(divide="ignore"):
        inv = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    q = np.rint(inv[:, None] * (z - lo[:, None]))  # nearest_int: ties to even
    out[:, 4 : 4 + n_vocab] = np.where(z > lo[:, None], q, 0).astype(np.uint16)
    return out


def decode_llama(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """llama.cpp's uint16 rows back to float32 log-probs ``scale * q + min_log_prob``."""
    head = np.ascontiguousarray(rows[:, :4]).view("<f4")  # (n, 2)
    q = rows[:, 4 : 4 + n_vocab].astype(np.float32)
    return head[:, :1] * q + head[:, 1:2]


def llama_token_values(
    rows: np.ndarray, logits: np.ndarray, tokens: np.ndarray
) -> metrics.TokenValues:
    """llama-perplexity's per-token values of ``logits`` against uint16 base rows, in its
    float32 arithmetic (``log_softmax`` with a ``kl_divergence_result &``)."""
    z = np.asarray(logits, dtype=np.float32)
    n, n_vocab = z.shape
    tokens = np.asarray(tokens, dtype=np.int64)
    at = np.arange(n)
    hi = z.max(axis=1)
    sum_exp = np.exp(z - hi[:, None]).sum(axis=1, dtype=np.float64)
    log_sum_exp = np.log(sum_exp).astype(np.float32)
    nll = (hi + log_sum_exp) - z[at, tokens]
    base = decode_llama(rows, n_vocab)
    nll_base = -base[at, tokens]
    shift = (hi + log_sum_exp)[:, None]
    with np.errstate(under="ignore"):
        terms = np.exp(base) * ((base - z) + shift)
    kld = np.where(base > -np.float32(FLOOR), terms, np.float32(0)).sum(axis=1, dtype=np.float64)
    dp = np.exp(-nll) - np.exp(-nll_base)
    return metrics.TokenValues(
        kld=kld.astype(np.float32).astype(np.float64),  # llama.cpp keeps each value as a float
        dp=dp.astype(np.float64),
        same=np.argmax(z, axis=1) == np.argmax(base, axis=1),
        nll_test=nll.astype(np.float64),
        nll_ref=nll_base.astype(np.float64),
    )


# --- the header ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """What a base file says about itself."""

    fmt: str
    n_ctx: int
    n_vocab: int
    n_chunk: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def row_dtype(self) -> np.dtype:
        return np.dtype({"llama": "<u2", "f32": "<f4"}[self.fmt])

    @property
    def row_items(self) -> int:
        return llama_row_width(self.n_vocab) if self.fmt == "llama" else self.n_vocab

    @property
    def chunk_bytes(self) -> int:
        return scored(self.n_ctx) * self.row_items * self.row_dtype.itemsize

    def encode(self) -> bytes:
        """The bytes before the tokens."""
        if self.fmt == "llama":
            return LLAMA_MAGIC + struct.pack("<Iii", self.n_ctx, self.n_vocab, self.n_chunk)
        doc = {
            "version": QLLAMA_VERSION,
            "format": self.fmt,
            "n_ctx": self.n_ctx,
            "n_vocab": self.n_vocab,
            "n_chunk": self.n_chunk,
            "meta": self.meta,
        }
        text = json.dumps(doc, sort_keys=True).encode()
        text += b" " * (-(len(QLLAMA_MAGIC) + 4 + len(text)) % 8)  # tokens start 8-aligned
        return QLLAMA_MAGIC + struct.pack("<I", len(text)) + text


def _read_exact(f: IO[bytes], n: int, what: str, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise BaseFileError(f"{path}: truncated in {what} ({len(data)} of {n} bytes)")
    return data


def _read_header(f: IO[bytes], path: Path) -> Header:
    magic = _read_exact(f, 8, "the magic", path)
    if magic == LLAMA_MAGIC:
        n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", _read_exact(f, 12, "the header", path))
        header = Header("llama", n_ctx, n_vocab, n_chunk)
    elif magic == QLLAMA_MAGIC:
        (length,) = struct.unpack("<I", _read_exact(f, 4, "the header length", path))
        if length > 1 << 20:
            raise BaseFileError(f"{path}: a header of {length} bytes is not a base file's")
        try:
            doc = json.loads(_read_exact(f, length, "the header", path))
            header = Header(
                str(doc["format"]),
                int(doc["n_ctx"]),
                int(doc["n_vocab"]),
                int(doc["n_chunk"]),
                dict(doc.get("meta", {})),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise BaseFileError(f"{path}: unreadable header: {e}") from None
        if doc.get("version") != QLLAMA_VERSION or header.fmt != "f32":
            raise BaseFileError(
                f"{path}: base format {doc.get('format')!r} version "
                f"{doc.get('version')!r} is not one qllama reads"
            )
    else:
        raise BaseFileError(f"{path} does not look like a base file (magic {magic!r})")
    if header.n_ctx < 3 or header.n_vocab < 1 or header.n_chunk < 1:
        raise BaseFileError(
            f"{path}: n_ctx {header.n_ctx}, n_vocab {header.n_vocab}, n_chunk {header.n_chunk}"
        )
    return header


# --- writing and reading ------------------------------------------------------------------------


class BaseWriter:
    """Write a base window by window; the file appears, complete, when the block ends.

    ``tokens`` are the ``n_chunk * n_ctx`` tokens of the windows as the text gave them
    (llama.cpp stores them before it puts BOS at each window's start).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fmt: str,
        *,
        n_ctx: int,
        n_vocab: int,
        tokens: np.ndarray,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if fmt not in FORMATS:
            raise BaseFileError(f"base format must be one of {FORMATS}, not {fmt!r}")
        tokens = np.asarray(tokens, dtype="<i4").reshape(-1)
        if tokens.size == 0 or tokens.size % n_ctx:
            raise BaseFileError(f"{tokens.size} tokens are not whole windows of {n_ctx}")
        self.path = Path(path)
        self.header = Header(fmt, n_ctx, n_vocab, tokens.size // n_ctx, meta or {})
        self._tokens = tokens
        self._written = 0
        self._file: IO[bytes] | None = None

    def __enter__(self) -> BaseWriter:
        self._context = atomic_write(self.path)
        self._file = self._context.__enter__()
        self._file.write(self.header.encode())
        self._file.write(self._tokens.tobytes())
        return self

    def write(self, logits: np.ndarray) -> None:
        """The base model's logits at one window's scored positions, ``(scored, n_vocab)``."""
        h = self.header
        if self._file is None:
            raise BaseFileError("BaseWriter.write outside its with-block")
        if logits.shape != (scored(h.n_ctx), h.n_vocab):
            raise BaseFileError(
                f"a window's logits must be {(scored(h.n_ctx), h.n_vocab)}, not {logits.shape}"
            )
        if self._written >= h.n_chunk:
            raise BaseFileError(f"the base holds {h.n_chunk} windows; this is one more")
        for r in range(0, logits.shape[0], ROW_BLOCK):
            block = logits[r : r + ROW_BLOCK]
            rows = encode_llama(block) if h.fmt == "llama" else block  # f32: the logits
            self._file.write(np.ascontiguousarray(rows, dtype=h.row_dtype).tobytes())
        self._written += 1

    def __exit__(self, kind: Any, value: Any, tb: Any) -> bool:
        self._file = None
        if kind is None and self._written != self.header.n_chunk:
            error = BaseFileError(
                f"{self.path}: {self._written} of {self.header.n_chunk} windows written"
            )
            self._context.__exit__(BaseFileError, error, None)  # removes the temporary file
            raise error
        return bool(self._context.__exit__(kind, value, tb))  # renames only on success


@dataclass
class BaseFile:
    """An open base file: its header, its tokens, and its windows one at a time."""

    path: Path
    header: Header
    tokens: np.ndarray  # (n_chunk, n_ctx) int32, as the text gave them
    offset: int  # where the first window's rows start

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> BaseFile:
        """Read and check the header and tokens (the rows stay on disk)."""
        path = Path(path)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                header = _read_header(f, path)
                n = header.n_chunk * header.n_ctx
                if f.tell() + 4 * n + header.n_chunk * header.chunk_bytes != size:
                    raise BaseFileError(
                        f"{path} is {size} bytes; its header ({header.n_chunk} windows of "
                        f"{header.n_ctx}, vocabulary {header.n_vocab}, {header.fmt}) needs "
                        f"{f.tell() + 4 * n + header.n_chunk * header.chunk_bytes}"
                    )
                tokens = np.frombuffer(_read_exact(f, 4 * n, "the tokens", path), dtype="<i4")
                offset = f.tell()
        except OSError as e:
            raise BaseFileError(f"cannot read base file {path}: {e.strerror or e}") from None
        if tokens.size and (tokens.min() < 0 or tokens.max() >= header.n_vocab):
            raise BaseFileError(f"{path}: a token id is outside [0, {header.n_vocab})")
        return cls(path, header, tokens.reshape(header.n_chunk, header.n_ctx), offset)

    def rows(self, chunk: int) -> np.ndarray:
        """The stored rows of window ``chunk``: ``(scored, row_items)`` of the format's dtype."""
        h = self.header
        if not 0 <= chunk < h.n_chunk:
            raise BaseFileError(f"{self.path} has windows 0..{h.n_chunk - 1}, not {chunk}")
        with open(self.path, "rb") as f:
            f.seek(self.offset + chunk * h.chunk_bytes)
            data = _read_exact(f, h.chunk_bytes, f"window {chunk}", self.path)
        return np.frombuffer(data, dtype=h.row_dtype).reshape(scored(h.n_ctx), h.row_items)

    def token_values(
        self, chunk: int, logits: np.ndarray, tokens: np.ndarray
    ) -> metrics.TokenValues:
        """Per-token values of ``logits`` (a window's scored positions) against this base."""
        rows = self.rows(chunk)
        parts = []
        for r in range(0, rows.shape[0], ROW_BLOCK):
            block, z, t = (
                rows[r : r + ROW_BLOCK],
                logits[r : r + ROW_BLOCK],
                tokens[r : r + ROW_BLOCK],
            )
            if self.header.fmt == "llama":
                parts.append(llama_token_values(block, z, t))
            else:
                parts.append(metrics.token_values(metrics.log_softmax(block), z, t))
        return metrics.TokenValues.concat(parts)

    def head(self, n: int) -> BaseFile:
        """The same file seen as its first ``n`` windows."""
        if not 1 <= n <= self.header.n_chunk:
            raise BaseFileError(f"{self.path} has {self.header.n_chunk} windows, not {n}")
        header = dataclasses.replace(self.header, n_chunk=n)
        return dataclasses.replace(self, header=header, tokens=self.tokens[:n])


__all__ = [
    "FORMATS",
    "BaseFile",
    "BaseFileError",
    "BaseWriter",
    "Header",
    "decode_llama",
    "encode_llama",
    "llama_token_values",
    "scored",
]
