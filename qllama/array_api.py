"""Array-namespace plumbing: the one place that turns "numpy", a module or an array into ``xp``.

Model and format code take ``xp`` as an argument and call only the array API standard through
it; this module resolves what a caller passed (a name, a library module or an array) into the
standard namespace of that library, using array-api-compat where the library needs it.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, TypeAlias

import array_api_compat

# The array API standard has no static type of its own: these names say what an ``Any``
# stands for in the model's and the backends' signatures.
Array: TypeAlias = Any  # an array of the backend's namespace (numpy, torch, jax, strict)
Namespace: TypeAlias = Any  # an array API namespace (``xp``)
Weight: TypeAlias = Any  # a 2-D weight as its backend's ``prepare`` returned it

_LIBRARIES = {
    "numpy": "numpy",
    "torch": "torch",
    "jax": "jax.numpy",
    "array_api_strict": "array_api_strict",
    "array-api-strict": "array_api_strict",
}


class _Deferred(types.ModuleType):
    """One of numpy's submodules, imported when something first looks inside it."""

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module(self.__name__), name)


def _numpy_compat_without_submodules() -> None:
    """Import array-api-compat's numpy namespace without the numpy submodules the array API
    never names. It copies numpy's namespace with ``from numpy import *``, which imports every
    submodule numpy 2 otherwise loads on first use: ``numpy.testing`` (and ``unittest``),
    ``numpy.f2py``, ``numpy.ma``, ``numpy.polynomial``, ``numpy.random``...: 10 MB more
    resident in every process that runs the numpy backend (docs/bench-glue.md). They are
    copied as stand-ins that import the real submodule when used. Nothing is done where the
    namespace is already imported."""
    if "array_api_compat.numpy" in sys.modules:
        return
    import numpy

    # numpy's submodules not imported yet, less those array-api-compat wraps or imports
    skip = {"linalg", "fft", "typing", "dtypes", "exceptions"}
    names = [
        n
        for n in getattr(numpy, "__all__", ())
        if n not in vars(numpy) and n not in skip and f"numpy.{n}" not in sys.modules
    ]
    for n in names:
        setattr(numpy, n, _Deferred(f"numpy.{n}"))
    try:
        import array_api_compat.numpy  # noqa: F401
    finally:
        for n in names:  # numpy's own lazy import again (unless one was imported meanwhile)
            if isinstance(vars(numpy).get(n), _Deferred):
                delattr(numpy, n)


_numpy_compat_without_submodules()


def namespace(xp: Any = None) -> Namespace:
    """The array API namespace for ``xp``: None (numpy), a library name, a module or an array."""
    if xp is None:
        xp = "numpy"
    if isinstance(xp, str):
        if xp not in _LIBRARIES:
            raise ValueError(f"unknown array library {xp!r}; known: {sorted(set(_LIBRARIES))}")
        xp = importlib.import_module(_LIBRARIES[xp])
    if array_api_compat.is_array_api_obj(xp):
        return array_api_compat.array_namespace(xp)
    # a module: ask it for a scalar array and take that array's namespace
    return array_api_compat.array_namespace(xp.asarray(0))


def to_numpy(x: Array) -> Any:
    """A numpy copy (or view) of any array, for output and comparison."""
    import numpy as np

    if array_api_compat.is_torch_array(x):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except (TypeError, ValueError, RuntimeError):
        # array-api-strict refuses __array__; go through DLPack
        return np.from_dlpack(x)
