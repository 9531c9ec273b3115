"""Real text to measure perplexity on, from a package registry, cached like the model.

No data set can be fetched from a hub here, and a text written for the project would measure
nothing real. So the corpus is a public-domain book that a package ships: Project Gutenberg's
*Botchan (Master Darling)* by Natsume Soseki, translated by Yasotaro Morri (1918, revised by
J. R. Kennedy, 1919; eBook #8868), which SentencePiece carries in its source distribution on
PyPI as ``test/botchan.txt``. The archive is downloaded with ``pip download --no-binary``
(never installed), the file is extracted while its sha256 is checked (see
:func:`qllama.model_files.fetch_source`), and it lands in the cache under ``corpora/``.

:func:`text` returns the book itself: the part between Project Gutenberg's ``*** START OF``
and ``*** END OF`` lines, without the byte-order mark, the licence and the catalogue notes
around it (they are not the book, and the licence is the same boilerplate in every eBook).
The SentencePiece copy keeps the eBook's line breaks and drops its blank lines. Provenance
and licence are in docs/perplexity.md.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qllama import defaults
from qllama.errors import FetchError
from qllama.model_files import ModelSource, fetch_source


@dataclass(frozen=True)
class Corpus:
    """A text a package ships, where its body starts and ends, and what it is."""

    source: ModelSource
    title: str
    licence: str
    start: str  # the body begins on the line after the one starting with this
    end: str  # and stops before the line starting with this


CORPORA: dict[str, Corpus] = {
    "botchan": Corpus(
        source=ModelSource(
            package="sentencepiece",
            version="0.2.0",
            member="sentencepiece-0.2.0/test/botchan.txt",
            sha256="464bd5300c24fce16fcc4555d4231a57632caae4d0090ad6aa92854a3b227ba7",
            sdist=True,
        ),
        title="Botchan (Master Darling), Natsume Soseki, tr. Yasotaro Morri; "
        "Project Gutenberg eBook #8868",
        licence="public domain in the USA (published 1918-1919); Project Gutenberg License",
        start="*** START OF",
        end="*** END OF",
    ),
}


def _corpus(name: str) -> Corpus:
    try:
        return CORPORA[name]
    except KeyError:
        raise FetchError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}") from None


def cached_path(name: str, cache: str | os.PathLike[str] | None = None) -> Path:
    """Where :func:`fetch` puts the corpus file (it may not be there yet)."""
    return defaults.cache_dir(cache) / "corpora" / name / _corpus(name).source.filename


def fetch(name: str, *, cache: str | os.PathLike[str] | None = None) -> Path:
    """Download (once) and verify the corpus ``name``; return its path in the cache."""
    return fetch_source(_corpus(name).source, cached_path(name, cache))


def body(raw: str, corpus: Corpus) -> str:
    """The text between the corpus's start and end lines (byte-order mark removed)."""
    lines = raw.lstrip("\ufeff").splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith(corpus.start)]
    ends = [i for i, line in enumerate(lines) if line.startswith(corpus.end)]
    if not starts or not ends or ends[0] <= starts[0]:
        raise FetchError(
            f"the corpus file has no {corpus.start!r} ... {corpus.end!r} lines around its body"
        )
    return "".join(lines[starts[0] + 1 : ends[0]])


def text(name: str, *, cache: str | os.PathLike[str] | None = None) -> str:
    """The body of the corpus ``name`` (fetched on first use)."""
    corpus = _corpus(name)
    return body(fetch(name, cache=cache).read_text(encoding="utf-8"), corpus)


def from_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """A text named as the CLI's ``--text`` names it: ``corpus:NAME`` (a packaged corpus) or
    the path of a UTF-8 file; with where it came from and its sha256."""
    if spec.startswith("corpus:"):
        name = spec.split(":", 1)[1]
        body_text = text(name)
        source: dict[str, Any] = {"corpus": name, "title": _corpus(name).title}
    else:
        with open(spec, encoding="utf-8", errors="replace") as f:
            body_text = f.read()
        source = {"file": os.path.basename(spec)}
    return body_text, {**source, "sha256": hashlib.sha256(body_text.encode()).hexdigest()}


__all__ = ["CORPORA", "Corpus", "body", "cached_path", "fetch", "from_spec", "text"]
