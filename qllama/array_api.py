"""Array-namespace plumbing: the one place that turns "numpy", a module or an array into ``xp``.

Model and format code take ``xp`` as an argument and call only the array API standard through
it; this module resolves what a caller passed (a name, a library module or an array) into the
standard namespace of that library, using array-api-compat where the library needs it.
"""

from __future__ import annotations

import importlib
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
