"""numba's options for every compiled piece of qllama (the CPU kernels, the IQ search).

One place, so that the kernels of the numpy backend and the quantizers' compiled search
(:mod:`qllama.quants.iq_search_jit`) compile alike without the quants importing a backend.
Imported only where numba is installed.
"""

from __future__ import annotations

import sys
from typing import Any

from numba import njit

from qllama.ggml_types import GGMLType


def _without_scipy_blas() -> None:
    """Load numba's array registry without scipy's BLAS. When numba first compiles or loads a
    function, its ``numba.np.arraymath`` asks whether ``np.dot`` could call BLAS by importing
    ``scipy.linalg.cython_blas``, which loads scipy's OpenBLAS: 8 MB more resident after a
    decode step, for the life of the process (docs/bench-moe.md). No compiled piece of qllama
    calls BLAS, so the question is answered no while that module loads; numba's ``np.dot``
    (and what else needs BLAS) still finds it later, when it compiles one. Nothing is done
    where the registry is already loaded."""
    if "numba.np.arraymath" in sys.modules:
        return
    from numba.np import linalg

    def no_blas() -> None:
        raise ImportError("qllama's kernels call no BLAS")

    ensure_blas, linalg.ensure_blas = linalg.ensure_blas, no_blas
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        linalg.ensure_blas = ensure_blas


_without_scipy_blas()

# Cached on disk; IEEE division (x/0 is inf or NaN, as in C), not Python's exception.
JIT: dict[str, Any] = {"cache": True, "error_model": "numpy"}
INLINE: dict[str, Any] = {**JIT, "inline": "always"}


def named_kernel(kernel: Any, family: str, fmt: int, parallel: bool) -> Any:
    """Compile ``kernel`` under a name of its own, ``{family}_{type}[_serial]``: numba's disk
    cache is keyed by the function's name and signature (not by ``parallel``), and by its
    closure's values (an int here: a dispatcher there would make it uncacheable)."""
    name = f"{family}_{GGMLType(fmt).name}{'' if parallel else '_serial'}"
    kernel.__name__ = kernel.__qualname__ = name
    return njit(**JIT, parallel=parallel)(kernel)
