"""Computing an importance matrix as llama-imatrix does (its file formats: qllama.gguf.imatrix).

The text is tokenized as llama.cpp does (BOS per the vocabulary, special tokens not parsed),
cut into chunks of ``n_ctx`` tokens (at least two are needed), each chunk run as a sequence of
its own with its first token replaced by BOS where the vocabulary adds one, and every matmul
with at least 16 activation rows whose weight is named ``blk.*`` (and ``output.weight`` with
``process_output``) adds ``x[t, j]**2`` row by row in float32 to its sums, as llama-imatrix's
callback does (:class:`Collector`, a backend wrapping another); every experts' product
(``mul_mat_id``), whatever its rows, adds each row to the sums of the expert it went to.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from qllama.array_api import to_numpy
from qllama.backends import get_backend
from qllama.backends.base import Backend, expert_matmul
from qllama.errors import ImatrixError
from qllama.gguf.imatrix import DEFAULT_CTX, MIN_ROWS, Entry, ImportanceMatrix
from qllama.runtime.loader import load
from qllama.runtime.tokenizer import Tokenizer

F32 = np.float32


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
        # experts (mul_mat_id): per weight, one row of sums and one count per expert
        self.expert_sums: dict[str, np.ndarray] = {}
        self.expert_counts: dict[str, np.ndarray] = {}
        self.name = f"imatrix({inner.name})"

    def __getattr__(self, attr: str) -> Any:  # xp, device, dequantize_all, asarray, supports
        return getattr(self.inner, attr)

    def prepare(self, tensor: Any) -> _Named:
        return _Named(tensor.name, tensor.shape, self.inner.prepare(tensor))

    def embedding(self, ids: Any, w: _Named) -> Any:
        return self.inner.embedding(ids, w.inner)

    def matmul(self, x: Any, w: _Named) -> Any:
        if collected(w.name, process_output=self.process_output) and x.shape[0] >= MIN_ROWS:
            rows = np.asarray(to_numpy(x), dtype=F32)
            acc = self.sums.setdefault(w.name, np.zeros(rows.shape[1], F32))
            for sq in rows * rows:  # C: acc[j] += x[j]*x[j], one row after another
                acc += sq
            self.counts[w.name] = self.counts.get(w.name, 0) + rows.shape[0]
            if not np.isfinite(acc).all():
                raise ImatrixError(f"non-finite activations entering '{w.name}'")
        return self.inner.matmul(x, w.inner)

    def expert_matmul(self, x: Any, experts: Sequence[_Named], selected: Any) -> Any:
        """ggml's mul_mat_id, collected as llama-imatrix collects it (moe_kv_recipes.md 2.7):
        whatever the number of rows, each (slot, token) pair, slots outer, adds its row's
        squares to the sums of the expert it was routed to, and 1 to that expert's count."""
        name = experts[0].name
        if collected(name, process_output=self.process_output):
            rows = np.asarray(to_numpy(x), dtype=F32)  # (T, K) or (T, k, K)
            ids = np.asarray(to_numpy(selected))  # (T, k)
            acc = self.expert_sums.setdefault(name, np.zeros((len(experts), rows.shape[-1]), F32))
            counts = self.expert_counts.setdefault(name, np.zeros(len(experts), np.int64))
            for s in range(ids.shape[1]):
                for t in range(ids.shape[0]):
                    row = rows[t] if rows.ndim == 2 else rows[t, s]
                    acc[ids[t, s]] += row * row
                    counts[ids[t, s]] += 1
            if not np.isfinite(acc).all():
                raise ImatrixError(f"non-finite activations entering '{name}'")
        return expert_matmul(self.inner, x, [w.inner for w in experts], selected)


def tokenize(tokenizer: Any, text: str) -> list[int]:
    """The corpus's tokens as llama-imatrix gets them: ``common_tokenize(text,
    add_special=true, parse_special=false)``, the whole text at once (``tokenizer``: a
    model's, or a :class:`~qllama.runtime.tokenizer.Tokenizer`)."""
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
    for name in sorted(backend.expert_sums):  # one slice and one count per expert
        entries[name] = Entry(backend.expert_sums[name].copy(), backend.expert_counts[name].copy())
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
    # the corpus first: a short one is refused before the model is built
    tokens = tokenize(Tokenizer.from_gguf(path), text)
    _check_length(len(tokens), n_ctx, skip_chunks)
    inner = get_backend(backend) if backend is None or isinstance(backend, str) else backend
    collector = Collector(inner, process_output=process_output)
    # a Backend by delegation (__getattr__), which the protocol's static check cannot see
    model = load(path, backend=cast(Backend, collector), n_ctx=n_ctx, **load_options)
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


__all__ = ["Collector", "collected", "compute", "from_corpus", "tokenize"]
