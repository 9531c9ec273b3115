"""qllama.jit: numba's array registry loaded without scipy's BLAS, which numba still finds
where a compiled function needs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys

import numpy as np

from qllama.backends.numpy.glue import router_sum_rows

router_sum_rows(np.ones((2, 3), np.float32))  # a kernel loaded, numba's registries with it
print("blas" if "scipy.linalg.cython_blas" in sys.modules else "no-blas")

import numba


@numba.njit
def dot(a, b):
    return np.dot(a, b)


print(dot(np.ones(3), np.ones(3)))
"""


def test_the_kernels_load_no_blas_and_numba_still_finds_it() -> None:
    """In a process of its own (the registry loads once a process)."""
    pytest.importorskip("numba")
    pytest.importorskip("scipy")
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["no-blas", "3.0"]
