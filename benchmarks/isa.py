"""The bench for another instruction set than the host's: ``bench.py --isa avx2``.

On an AVX-512 host, both sides of every comparison are built for AVX2, so that a machine
with AVX-512 measures what an AVX2-only one runs (issue 17's targets were set on one):

* qllama's numba kernels: compiled for the host CPU (its tuning) with every AVX-512 feature
  (and AVX-VNNI, AMX) turned off, through ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``, which
  :mod:`qllama.backends.numpy.kernels.simd` reads to choose its instructions; numba's disk cache
  keeps these kernels apart from the host's (its index is keyed by the target);
* llama.cpp: its libraries and tools built with ``-DGGML_AVX512=OFF``
  (``tools/llama_cpp_build.py tools --isa avx2``, cached per flags), loaded by
  llama-cpp-python through ``LLAMA_CPP_LIB_PATH``.

The hardware is still the host's (its caches, its memory, its 256-bit execution), so the
numbers stand for an AVX2 build on this machine, not for another machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from isa_env import ISAS, numba_env  # noqa: E402  (tools/isa_env.py: the targets)

__all__ = ["ISAS", "environment", "llama_bin", "numba_env"]


def llama_bin(isa: str) -> str:
    """The bin folder of llama.cpp's libraries and tools built for ``isa`` (built once)."""
    script = ROOT / "tools" / "llama_cpp_build.py"
    run = subprocess.run(
        [sys.executable, str(script), "tools", "--isa", isa],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return run.stdout.strip().splitlines()[-1]


def environment(isa: str, bin_dir: str) -> dict[str, str]:
    """What every worker runs with: numba's target, and llama-cpp-python's libraries (with
    the folder on the loader's path too: the build's RUNPATH names the temporary folder it
    was built in)."""
    paths = [bin_dir, os.environ.get("LD_LIBRARY_PATH", "")]
    return {
        **numba_env(isa),
        "LLAMA_CPP_LIB_PATH": bin_dir,
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in paths if p),
    }
