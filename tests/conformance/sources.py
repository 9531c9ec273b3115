"""llama.cpp's tree (converter, gguf-py, vocabularies, chat templates) for the tests.

``tools/llama_cpp_build.py source`` downloads the llama-cpp-python sdist from PyPI once and
unpacks it once into the qllama cache (``peers/src-<version>``); every later call, and every
later test run, reads that folder and touches no network. Nothing of llama.cpp is committed:
its files are its own (and its vocabularies are the model makers' tokenizers).

A test that needs the tree skips only when the registry cannot be reached (:class:`Unreachable`:
pip reports a broken connection, a failed name lookup or a timeout). Any other failure, such as
a missing version, a corrupted archive or a bug in the script, is an error that names pip's
output, so a broken setup cannot pass as a skip. pip runs with a short socket timeout and one
retry, so a machine without a network gives up in seconds, not after pip's default minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "tools" / "llama_cpp_build.py"

# What pip prints when it cannot reach the index or a download (urllib3's and requests'
# names for a refused or reset connection, a failed name lookup, a proxy failure, a timeout).
UNREACHABLE_MARKERS = (
    "connection broken by",
    "NewConnectionError",
    "NameResolutionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
    "Max retries exceeded",
    "Connection aborted",
    "Read timed out",
    "Network is unreachable",
)
PIP_BOUNDS = {"PIP_DEFAULT_TIMEOUT": "15", "PIP_RETRIES": "1"}


class Unreachable(RuntimeError):
    """The package registry could not be reached to download the sdist."""


def unreachable(pip_output: str) -> bool:
    """Whether pip's output says that the registry could not be reached."""
    return any(marker in pip_output for marker in UNREACHABLE_MARKERS)


def llama_cpp_source() -> Path:
    """``vendor/llama.cpp`` of the llama-cpp-python sdist, downloaded and unpacked once.

    Raises :class:`Unreachable` when the download failed for want of a network, and
    RuntimeError (with the script's output) for any other failure.
    """
    try:
        out = subprocess.run(
            [sys.executable, str(BUILD_SCRIPT), "source"],
            capture_output=True,
            text=True,
            env={**os.environ, **PIP_BOUNDS},
            timeout=900,  # an unpack of the cached archive takes seconds; a download, minutes
        )
    except subprocess.TimeoutExpired as e:
        raise Unreachable(f"the sdist did not arrive within {e.timeout} s") from None
    if out.returncode != 0:
        text = out.stdout + out.stderr
        if unreachable(text):
            raise Unreachable(f"PyPI is unreachable: {text.strip().splitlines()[-1]}")
        raise RuntimeError(f"tools/llama_cpp_build.py source failed:\n{text[-4000:]}")
    return Path(out.stdout.strip().splitlines()[-1])
