"""The environment that makes an AVX-512 host run the code paths of an AVX2-only one.

``python tools/isa_env.py avx2`` prints ``NAME=VALUE`` lines; ``nox -s tests-avx2`` runs the test
suite under them and ``benchmarks/isa.py`` builds its numba target from :func:`numba_env`.
Each library that chooses its kernels by the CPU is told to stop at AVX2:

* numba (qllama's compiled kernels): the host CPU's name and features, less every feature
  beyond AVX2 (``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``, which
  ``qllama.backends.numpy.kernels.simd`` reads to choose its instructions; numba's disk cache keeps
  these kernels apart, its index is keyed by the target);
* OpenBLAS (numpy's products): its Haswell kernels (``OPENBLAS_CORETYPE``);
* numpy's own loops: without their AVX-512 targets (``NPY_DISABLE_CPU_FEATURES``);
* torch: its AVX2 kernels (``ATEN_CPU_CAPABILITY``); XLA (jax): ``--xla_cpu_max_isa``.

The hardware is still the host's, so the numbers are an AVX2 build's on this machine; the
bits are what an AVX2-only machine computes, up to what a library decides without asking
(a thread count, a cache size).
"""

from __future__ import annotations

import sys

ISAS = ("avx2",)
# LLVM feature names that an AVX2-only x86 lacks (prefixes)
BEYOND_AVX2 = ("avx512", "avx10", "avxvnni", "avxifma", "avxneconvert", "amx", "evex512")
# numpy's dispatch targets above AVX2 (numpy 2.x names; an unknown one is ignored with a warning)
NUMPY_BEYOND_AVX2 = ("X86_V4", "AVX512F", "AVX512_SKX", "AVX512_ICL", "AVX512_SPR")


def numba_env(isa: str) -> dict[str, str]:
    """numba's target for ``isa``: the host CPU's name and features, less those beyond it."""
    from llvmlite import binding

    if isa not in ISAS:
        raise SystemExit(f"unknown instruction set {isa!r} (known: {', '.join(ISAS)})")
    features = dict(binding.get_host_cpu_features())
    if not features.get("avx2"):
        raise SystemExit(f"--isa {isa}: this CPU has no AVX2")
    flags = [
        ("-" if name.startswith(BEYOND_AVX2) else "+" if on else "-") + name
        for name, on in sorted(features.items())
    ]
    return {
        "NUMBA_CPU_NAME": binding.get_host_cpu_name(),
        "NUMBA_CPU_FEATURES": ",".join(flags),
    }


def environment(isa: str) -> dict[str, str]:
    """Every variable above, for ``isa``."""
    return {
        **numba_env(isa),
        "OPENBLAS_CORETYPE": "Haswell",
        "NPY_DISABLE_CPU_FEATURES": ",".join(NUMPY_BEYOND_AVX2),
        "ATEN_CPU_CAPABILITY": "avx2",
        "XLA_FLAGS": "--xla_cpu_max_isa=AVX2",
    }


if __name__ == "__main__":
    for name, value in environment(sys.argv[1] if len(sys.argv) > 1 else "avx2").items():
        print(f"{name}={value}")
