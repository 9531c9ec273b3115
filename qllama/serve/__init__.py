"""``qllama serve``: loaded models behind an OpenAI-compatible HTTP API (``qllama[serve]``).

- :mod:`~qllama.serve.app`: the FastAPI application (routes, API key, limits, errors);
- :mod:`~qllama.serve.completions`: completions and chat, whole or streamed;
- :mod:`~qllama.serve.engine`: the engine thread that batches every active sequence;
- :mod:`~qllama.serve.models`: the models by name, and their hot swap;
- :mod:`~qllama.serve.schemas`, :mod:`~qllama.serve.responses`: what goes in and out;
- :mod:`~qllama.serve.runner`: uvicorn on a bound socket, or on a thread.

It computes with qllama's own model, tokenizer, chat template and sampler; docs/serving.md
says how to run it and what each endpoint takes and returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qllama.serve.app import create_app
from qllama.serve.limits import Limits
from qllama.serve.models import LoadedModel, ModelRegistry, load_model
from qllama.serve.runner import ServerThread, bind, serve_forever


def open_models(
    files: Mapping[str, str | Path], *, allowed_dirs: list[Path] | None = None, **options: Any
) -> ModelRegistry:
    """A registry holding ``files`` (name -> path), each loaded with ``options``; files may
    later be loaded on request from ``allowed_dirs`` (default: the folders of ``files``)."""
    dirs = allowed_dirs if allowed_dirs is not None else [Path(p).parent for p in files.values()]
    registry = ModelRegistry(dirs)
    try:
        for name, path in files.items():
            registry.put(load_model(name, path, **options))
    except BaseException:
        registry.close()
        raise
    return registry


__all__ = [
    "Limits",
    "LoadedModel",
    "ModelRegistry",
    "ServerThread",
    "bind",
    "create_app",
    "load_model",
    "open_models",
    "serve_forever",
]
