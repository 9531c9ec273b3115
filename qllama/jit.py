"""numba's options for every compiled piece of qllama (the CPU kernels, the IQ search).

One place, so that the kernels of the numpy backend and the quantizers' compiled search
(:mod:`qllama.quants.iq_search_jit`) compile alike without the quants importing a backend.
Importing it also stamps numba's disk cache of qllama's functions by the files they inline
(:func:`_stamped`). Imported only where numba is installed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numba import njit
from numba.core import event

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


_MADV_DONTNEED = 4  # Linux's value (asm-generic/mman-common.h)


class _CompilerPages(event.Listener):
    """Gives LLVM's code back to the system each time numba is done compiling or loading
    kernels. Loading a cached kernel runs LLVM, whose library (llvmlite's: 80 MB of code, 66 MB
    of constants) then stays resident: 35 MB after ``import numba``, about 69 MB once a model's
    kernels are loaded, which is most of what numba's JIT costs beyond the weights
    (docs/footprint.md). Those pages are clean copies of the file, needed again only by
    the next compile or load. So when numba's compiler lock is let go, they are dropped from
    this process (``madvise(MADV_DONTNEED)``: the page cache keeps them, and the next compile
    maps them back in at a minor fault each). Only mappings that hold nothing but clean file
    pages are touched, never relocated data, so the library reads the same bytes after.
    Linux only; elsewhere, or where ``madvise`` refuses, nothing is done."""

    def __init__(self) -> None:
        self.depth = 0  # compiler-lock holders, across threads
        self.lock = threading.Lock()
        self.ranges: list[tuple[int, int]] | None = None  # found at the first release

    def on_start(self, _event: event.Event) -> None:
        with self.lock:
            self.depth += 1

    def on_end(self, _event: event.Event) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                self.release()

    def release(self) -> None:
        if self.ranges is None:
            self.ranges = _clean_ranges("libllvmlite", read_smaps())
        madvise = _libc_madvise()
        for start, length in self.ranges:
            if madvise(start, length, _MADV_DONTNEED) != 0:
                self.ranges = []  # refused (an old kernel?): keep the pages from now on
                return


@functools.cache
def _libc_madvise() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


@dataclass(frozen=True)
class Mapping:
    """One mapping of ``/proc/self/smaps``: its addresses, permissions, file and sizes."""

    start: int
    length: int
    perms: str  # "r-xp"...
    path: str  # "" for anonymous memory; may hold spaces
    kb: dict[str, int]  # "Rss", "Private_Dirty"...: kB


def mappings(smaps: str) -> list[Mapping]:
    """The mappings the text of ``/proc/self/smaps`` lists, in order."""
    out: list[Mapping] = []
    for line in smaps.splitlines():
        fields = line.split(maxsplit=5)
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            start, end = (int(x, 16) for x in fields[0].split("-"))
            path = fields[5].strip() if len(fields) > 5 else ""
            out.append(Mapping(start, end - start, fields[1], path, {}))
        elif out and fields[0].endswith(":") and len(fields) > 1 and fields[1].isdigit():
            out[-1].kb[fields[0][:-1]] = int(fields[1])
    return out


def _clean_ranges(library: str, smaps: str) -> list[tuple[int, int]]:
    """The address ranges (start, length) of a loaded library's read-only mappings that hold
    only clean pages (its code and constants, not the data its loader relocated), from the
    text of ``/proc/self/smaps``."""
    return [
        (m.start, m.length)
        for m in mappings(smaps)
        if "w" not in m.perms
        and library in os.path.basename(m.path)
        and not m.kb.get("Private_Dirty")
        and not m.kb.get("Shared_Dirty")
    ]


def read_smaps() -> str:
    """The text of ``/proc/self/smaps``; empty where there is none (not Linux)."""
    try:
        with open("/proc/self/smaps") as f:
            return f.read()
    except OSError:  # not Linux, or no /proc
        return ""


# --- numba's disk cache, stamped with what a kernel inlines ------------------------------------

# Beside a function's own directory, what qllama's compiled code reads as it compiles: these
# options and the GGML tables (qllama/ggml_types.py, the quants' level tables)
_SHARED_SOURCES = ("jit.py", "ggml_types.py", "quants")


@functools.cache
def _sources_stamp(directory: str) -> str:
    """A hash of the Python files of ``directory`` and of :data:`_SHARED_SOURCES`, by content,
    once a process (a process runs the files it imported)."""
    here = Path(__file__).parent
    roots = [Path(directory), *(here / s for s in _SHARED_SOURCES)]
    files = sorted({f for r in roots for f in ([r] if r.is_file() else r.glob("*.py"))})
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())
    return digest.hexdigest()


def _stamped(locator: type) -> type:
    """numba's cache ``locator`` for qllama's functions, stamped also by the files their
    machine code inlines. numba stamps a cached function by its own file alone: after an edit
    of kernels/quantize.py, gemv.py's decode kernels, which inline its quantizers, came from
    the cache with the old code."""

    class Stamped(locator):
        def get_source_stamp(self) -> Any:
            return (super().get_source_stamp(), _sources_stamp(os.path.dirname(self._py_file)))

        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> Any:
            if not getattr(py_func, "__module__", "").startswith("qllama."):
                return None  # another library's function: numba's own locators
            return super().from_function(py_func, py_file)

    Stamped.__name__ = Stamped.__qualname__ = f"Stamped{locator.__name__}"
    return Stamped


def _stamp_qllama_caches() -> None:
    """Put :func:`_stamped` forms of numba's file-backed locators, in numba's order (a
    ``NUMBA_CACHE_DIR`` first), before its own."""
    from numba.core import caching

    ours: list[Any] = [
        _stamped(c)
        for c in (
            caching.UserProvidedCacheLocator,
            caching.InTreeCacheLocator,
            caching.UserWideCacheLocator,
        )
    ]
    numba_own: list[Any] = caching.CacheImpl._locator_classes
    caching.CacheImpl._locator_classes = [*ours, *numba_own]


_stamp_qllama_caches()

if sys.platform.startswith("linux"):
    _COMPILER_PAGES = _CompilerPages()
    event.register("numba:compiler_lock", _COMPILER_PAGES)
    _COMPILER_PAGES.release()  # what importing numba touched

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
