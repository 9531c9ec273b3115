"""The one place qllama reads environment variables.

They only supply defaults: an explicit argument to :func:`qllama.load`, the CLI or the
experiment runner always wins.

==========================  ===================================================
``QLLAMA_BACKEND``          numpy (default) | torch | jax | array_api_strict
``QLLAMA_DEVICE``           cpu | cuda | mps (backends that have devices)
``QLLAMA_DEQUANTIZE_ALL``   1 to dequantize every weight to f32 at load
``QLLAMA_CACHE``            where fetched models and built files are kept
==========================  ===================================================
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_BACKEND = "QLLAMA_BACKEND"
ENV_DEVICE = "QLLAMA_DEVICE"
ENV_DEQUANTIZE_ALL = "QLLAMA_DEQUANTIZE_ALL"
ENV_CACHE = "QLLAMA_CACHE"

DEFAULT_BACKEND = "numpy"


def backend(explicit: str | None = None) -> str:
    """The backend name: ``explicit``, else ``$QLLAMA_BACKEND``, else numpy."""
    return explicit or os.environ.get(ENV_BACKEND) or DEFAULT_BACKEND


def device(explicit: str | None = None) -> str | None:
    """The device: ``explicit``, else ``$QLLAMA_DEVICE``, else None (the backend's default)."""
    return explicit or os.environ.get(ENV_DEVICE) or None


def dequantize_all(explicit: bool | None = None) -> bool:
    """Whether to dequantize at load: ``explicit``, else ``$QLLAMA_DEQUANTIZE_ALL`` set and
    not ``0``/``false``/empty."""
    if explicit is not None:
        return explicit
    return os.environ.get(ENV_DEQUANTIZE_ALL, "").strip().lower() not in ("", "0", "false", "no")


def cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The cache folder: ``explicit``, else ``$QLLAMA_CACHE``, else the user cache dir."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("qllama"))


def child_environment(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment with ``extra`` on top: for a child process that must start
    with variables (a BLAS kernel choice, a thread count) set before anything is imported."""
    return {**os.environ, **extra}
