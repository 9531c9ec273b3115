"""numba's options for every compiled piece of qllama (the CPU kernels, the IQ search).

One place, so that the kernels of the numpy backend and the quantizers' compiled search
(:mod:`qllama.quants.iq_search_jit`) compile alike without the quants importing a backend.
Imported only where numba is installed.
"""

from __future__ import annotations

from typing import Any

from numba import njit

from qllama.ggml_types import GGMLType

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
