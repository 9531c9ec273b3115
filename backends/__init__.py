"""Backends: who computes the quantized matmuls, in which arithmetic, on which device.

============  =============================  =========================================
name          arithmetic                     devices
============  =============================  =========================================
numpy         CPU: activations quantized to  cpu
              the weight's vec_dot_type,
              integer block dot products
torch         GPU: float32 activations,      cpu, cuda, mps
              weights dequantized per matmul
jax           GPU (as torch), jit-compiled   cpu, gpu
array_api_    GPU (as torch), for testing    cpu
strict        that the model is portable
============  =============================  =========================================

Every backend also has the ``dequantize_all`` mode (weights widened to float32 once, at load).
A third-party package adds a backend with an entry point in the group ``qllama.backends``
(``name = "package.module:Class"``); the class follows :class:`qllama.backends.base.Backend`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from typing import Any

from qllama import defaults
from qllama.backends.base import Backend, QuantTensor
from qllama.errors import BackendError

# name -> (module:class, the package it needs)
BUILTIN: dict[str, tuple[str, str]] = {
    "numpy": ("qllama.backends.numpy.dispatch:NumpyBackend", "numpy"),
    "torch": ("qllama.backends.torch:TorchBackend", "torch"),
    "jax": ("qllama.backends.jax:JaxBackend", "jax"),
    "array_api_strict": ("qllama.backends.strict:StrictBackend", "array_api_strict"),
}

ENTRY_POINT_GROUP = "qllama.backends"


def available() -> dict[str, str]:
    """Every known backend name -> where it lives (built-in and installed plugins)."""
    names = {name: target for name, (target, _) in BUILTIN.items()}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        names.setdefault(ep.name, ep.value)
    return names


def _load_class(name: str) -> type:
    known = available()
    if name not in known:
        raise BackendError(f"unknown backend {name!r}; available: {', '.join(known)}")
    if name in BUILTIN:
        package = BUILTIN[name][1]
        if importlib.util.find_spec(package) is None:
            raise BackendError(
                f"backend {name} needs the package {package!r}; install it with "
                f"pip install 'qllama[{package}]'"
            )
    module, _, cls = known[name].partition(":")
    loaded: type = getattr(importlib.import_module(module), cls)
    return loaded


def get_backend(
    name: str | None = None,
    *,
    device: str | None = None,
    dequantize_all: bool | None = None,
    **options: Any,
) -> Backend:
    """Build a backend. Unset arguments come from ``QLLAMA_BACKEND``, ``QLLAMA_DEVICE`` and
    ``QLLAMA_DEQUANTIZE_ALL`` (see :mod:`qllama.defaults`); explicit ones win."""
    cls = _load_class(defaults.backend(name))
    backend = cls(
        device=defaults.device(device),
        dequantize_all=defaults.dequantize_all(dequantize_all),
        **options,
    )
    return backend


__all__ = ["BUILTIN", "Backend", "QuantTensor", "available", "get_backend"]
