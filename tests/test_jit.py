"""qllama.jit: numba's array registry loaded without scipy's BLAS, which numba still finds
where a compiled function needs it; LLVM's clean pages given back after each compile or load,
and what is compiled after still right."""

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


SMAPS = """\
7f0000000000-7f0000300000 r--p 00000000 08:01 11 /venv/llvmlite/binding/libllvmlite.so
Rss:                1024 kB
Private_Dirty:         0 kB
7f0000300000-7f0005300000 r-xp 00300000 08:01 11 /venv/llvmlite/binding/libllvmlite.so
Rss:               51200 kB
Shared_Dirty:          0 kB
Private_Dirty:         0 kB
7f0005300000-7f0005400000 r--p 05300000 08:01 11 /venv/llvmlite/binding/libllvmlite.so
Rss:                1792 kB
Private_Dirty:      1792 kB
7f0005400000-7f0005500000 rw-p 05400000 08:01 11 /venv/llvmlite/binding/libllvmlite.so
Private_Dirty:       156 kB
7f0006000000-7f0006100000 r-xp 00000000 08:01 12 /a dir with spaces/libllvmlite.so
Private_Dirty:         0 kB
7f0007000000-7f0007100000 r-xp 00000000 08:01 13 /venv/numpy/_multiarray_umath.so
Private_Dirty:         0 kB
7f0008000000-7f0008100000 rw-p 00000000 00:00 0
Private_Dirty:       512 kB
"""


def test_only_the_librarys_clean_read_only_mappings_are_given_back() -> None:
    """Not the data the loader relocated (dirty, though read-only now), not what is
    writable, not another library; a path with spaces is still the library's."""
    pytest.importorskip("numba")
    from qllama.jit import _clean_ranges

    mb = 1 << 20
    assert _clean_ranges("libllvmlite", SMAPS) == [
        (0x7F0000000000, 3 * mb),
        (0x7F0000300000, 80 * mb),
        (0x7F0006000000, 1 * mb),
    ]
    assert _clean_ranges("libllvmlite", "") == []


PAGES = """
import numpy as np

import qllama.jit as jit
from qllama.backends.numpy.glue import router_sum_rows


def resident_kb():
    smaps = jit.read_smaps()
    ranges = set(jit._clean_ranges("libllvmlite", smaps))
    return sum(m.kb.get("Rss", 0) for m in jit.mappings(smaps) if (m.start, m.length) in ranges)


print(resident_kb())
router_sum_rows(np.ones((2, 3), np.float32))  # a cached kernel loaded (or compiled)
print(resident_kb())


@jit.njit(cache=False)
def triple(a):
    return a * 3


print(triple(np.arange(3.0)).tolist(), resident_kb(), bool(jit._COMPILER_PAGES.ranges))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise: Linux only")
def test_llvms_pages_are_given_back_and_what_compiles_after_is_right() -> None:
    """In a process of its own: after ``import numba``, after a kernel loads and after a
    fresh compile, none of LLVM's clean pages is resident, and the compiled code runs."""
    pytest.importorskip("numba")
    run = subprocess.run([sys.executable, "-c", PAGES], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    *resident, result = run.stdout.strip().splitlines()
    assert result.startswith("[0.0, 3.0, 6.0] ")
    *after_compile, found = result.split()[3:]
    assert found == "True", "madvise refused, or no LLVM library found"
    assert [*resident, *after_compile] == ["0", "0", "0"]


INNER = """
from numba import njit


@njit(cache=True, inline="always")
def g(x):
    return x + {step}
"""

OUTER = """
from numba import njit

from qllama.probe_inner import g


@njit(cache=True)
def f(x):
    return g(x)
"""

RUN = """
import importlib.util
import sys

import qllama.jit  # noqa: F401  (qllama's cache locators)

for name in ("inner", "outer"):
    spec = importlib.util.spec_from_file_location(f"qllama.probe_{name}", f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
print(sys.modules["qllama.probe_outer"].f(1))
"""


def test_a_cached_kernel_is_recompiled_when_a_file_it_inlines_changes(tmp_path) -> None:
    """numba stamps a cached function by its own file; a qllama kernel's stamp also covers its
    directory (and the shared tables), so an edit of a function it inlines is not served
    from the cache as the old machine code."""
    pytest.importorskip("numba")
    (tmp_path / "outer.py").write_text(OUTER)

    def run(step: int) -> str:
        (tmp_path / "inner.py").write_text(INNER.format(step=step))
        done = subprocess.run(
            [sys.executable, "-c", RUN], capture_output=True, text=True, cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    assert run(1) == "2"
    assert list((tmp_path / "__pycache__").glob("outer.f-*.nbi"))  # f came from the cache...
    assert run(2) == "3"  # ...and was compiled again for the new g
    assert run(2) == "3"
