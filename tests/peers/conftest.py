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


@pytest.fixture(scope="session")
def llama_tool(llama_bin: Path):
    """Run one of llama.cpp's tools, ``llama_tool("llama-quantize", *args, timeout=...)``.

    Their shared libraries are found in the bin folder: the build's RUNPATH names the
    temporary folder it was built in (tools/llama_cpp_build.py renames it into the cache).
    """
    import os
    import subprocess

    paths = [str(llama_bin), os.environ.get("LD_LIBRARY_PATH", "")]
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(p for p in paths if p)}

    def run(tool: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        cmd = [str(llama_bin / tool), *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)

    return run
