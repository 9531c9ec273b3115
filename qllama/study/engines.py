"""Who computes a cell: qllama on one of its backends, or a peer on the same file.

Both give the measures the same few members: ``forward(ids, pos, all_logits=)``,
``generate(prompt_ids, max_new_tokens=)`` (``.ids``, ``.finish_reason``), ``tokenizer`` and
``backend.device``. The llama.cpp engine (llama-cpp-python, ``nox -s study-peers``) is llama.cpp's
own CPU arithmetic on the study's files: one more draw of the CPU arithmetic, computed by
code that shares nothing with qllama's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qllama.study.declaration import StudyError


def open_model(
    engine: str, path: Path, backend: str, options: Mapping[str, Any], threads: int
) -> Any:
    """The model a cell measures."""
    if engine == "qllama":
        from qllama.runtime.loader import load

        return load(path, backend=backend, **options)
    if engine == "llama.cpp":
        return LlamaCppModel(path, threads=threads, **options)
    raise StudyError(f"unknown engine {engine!r}")


@dataclass
class _Generation:
    ids: list[int]
    finish_reason: str


@dataclass(frozen=True)
class _Device:
    device: str = "cpu"


class LlamaCppModel:
    """llama.cpp through llama-cpp-python, as a model the measures can run.

    Every position's logits are kept (``logits_all``) so that teacher forcing reads the row
    of each step; ``forward(ids, pos)`` drops the cached positions from ``pos`` on, as
    qllama's does. Options go to ``llama_cpp.Llama`` (``type_k=0, type_v=0``: an f32 KV cache,
    like qllama's, instead of llama.cpp's f16 default).
    """

    def __init__(self, path: Path, *, threads: int, n_ctx: int = 1024, **options: Any) -> None:
        try:
            import llama_cpp
        except ImportError:
            raise StudyError(
                "the llama.cpp engine needs llama-cpp-python (nox -s study-peers installs it)"
            ) from None
        from qllama.runtime.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_gguf(path)
        self.backend = _Device()
        self.n_ctx = n_ctx
        self._llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=min(512, n_ctx),
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=True,
            verbose=False,
            **options,
        )

    def forward(self, ids: Sequence[int], pos: int = 0, *, all_logits: bool = False) -> np.ndarray:
        llm, ids = self._llm, [int(t) for t in ids]
        if not 0 <= pos <= llm.n_tokens:
            raise StudyError(f"pos {pos} is past the {llm.n_tokens} cached positions")
        if pos + len(ids) > self.n_ctx:
            raise StudyError(f"{pos + len(ids)} tokens do not fit llama.cpp's context {self.n_ctx}")
        llm.n_tokens = pos  # eval drops the cache from here on
        llm.eval(ids)
        rows = np.array(llm.scores[pos : pos + len(ids)], dtype=np.float32)
        return rows if all_logits else rows[-1]

    def generate(self, prompt: Sequence[int], *, max_new_tokens: int) -> _Generation:
        """Greedy decoding (the first maximum, as llama.cpp's greedy sampler) to a stop id."""
        stop = self.tokenizer.stop_ids
        logits = self.forward(prompt, 0)
        out: list[int] = []
        while len(out) < max_new_tokens:
            token = int(np.argmax(logits))
            out.append(token)
            if token in stop:
                return _Generation(out, "eos")
            if len(out) < max_new_tokens:
                logits = self.forward([token], len(prompt) + len(out) - 1)
        return _Generation(out, "length")
