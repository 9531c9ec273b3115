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


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (check and format) and mypy."""
    session.install(TORCH)
    session.install(".[dev,torch]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "qllama", "backends")
