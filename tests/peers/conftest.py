"""Peer comparisons need llama-cpp-python (built by `nox -s peers`); skip without it."""

from __future__ import annotations

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (nox -s peers)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.peers)
