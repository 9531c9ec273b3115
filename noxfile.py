"""Sessions: tests, lint, and (as the project grows) experiments, reference, bench, fuzz.

``nox -s tests`` is what CI runs; ``nox -l`` lists everything.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

# torch 2.13.0 is the CPU build on this project's machines; a looser pin pulls a CUDA
# build of several GB. The package itself asks only for "torch>=2.2" so a Mac gets MPS.
TORCH = "torch==2.13.0"


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (slow tests excluded; `nox -s tests -- -m slow` runs them)."""
    session.install(TORCH)
    session.install(".[dev,torch,jax]")
    args = session.posargs or ["-m", "not slow"]
    session.run("pytest", *args)


LLAMA_CPP = "llama-cpp-python==0.3.36"
# the native build (AMX) crashes on these machines; AVX2/AVX-512 without AMX works
LLAMA_CPP_CMAKE = (
    "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"
)


@nox.session
def peers(session: nox.Session) -> None:
    """Compare with llama.cpp: quantizer bytes, tokenizer ids (builds llama-cpp-python, ~6 min)."""
    session.install(TORCH)
    session.install(".[dev,torch,reference]")
    session.install(LLAMA_CPP, env={"CMAKE_ARGS": LLAMA_CPP_CMAKE})
    session.run("pytest", "tests/peers", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (check and format) and mypy."""
    session.install(TORCH)
    session.install(".[dev,torch]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "qllama", "backends")
