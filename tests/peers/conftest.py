"""Peer comparisons need llama-cpp-python (built by `nox -s peers`); without it they are not
collected at all."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("llama_cpp") else ["test_*.py"]


@pytest.fixture(scope="session")
def llama_bin(request: pytest.FixtureRequest) -> Path:
    """The bin folder of llama.cpp's tools, as `nox -s peers` built them (--llama-bin)."""
    given = request.config.getoption("--llama-bin")
    if not given:
        pytest.skip("llama.cpp's tools are not given (--llama-bin; nox -s peers builds them)")
    return Path(given)
