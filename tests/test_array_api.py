"""qllama.array_api: the numpy namespace without the numpy submodules the array API never
names, which are still there when used."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys

import numpy as np

import qllama
from qllama.array_api import namespace

xp = namespace(np.zeros(2))
heavy = ("numpy.testing", "numpy.f2py", "numpy.polynomial", "unittest")
print(xp.__name__, *[m for m in heavy if m in sys.modules])
xp.testing.assert_array_equal(xp.asarray([1, 2]), np.array([1, 2]))  # imported now, on use
print(np.testing is sys.modules["numpy.testing"], np.polynomial.Polynomial([1, 2])(2))
"""


def test_the_numpy_namespace_imports_no_unused_submodule_and_finds_them_on_use() -> None:
    """In a process of its own (pytest itself imports numpy.testing)."""
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["array_api_compat.numpy", "True", "5.0"]
