"""ggml's CPU flash attention ``one_chunk`` kernel: the plain statement (the oracle) and the
entry point that runs the compiled one (:mod:`qllama.backends.numpy.kernels.flash`).

Per query row, over the cells in order (``ops.cpp
ggml_compute_forward_flash_attn_ext_f16_one_chunk``)::

    skip the cell if its mask is -inf
    s = score * scale (cap * tanhf(s) with a softcap), then + mask
    if s > M:  ms = expf(M - s); M = s; acc *= ms          (vs = 1)
    else:      vs = expf(s - M)                            (ms = 1)
    acc = fma(v, vs, acc)    per element; f16 acc: rounded to half after this and the rescale
    S = S*ms + vs            (one FMA: GCC contracts it on FMA builds)
    out = acc * (1/S)

``expf`` is libm's (glibc's is not correctly rounded, so the oracle calls it, through ctypes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib
from collections.abc import Callable

import numpy as np

F32 = np.float32


@functools.cache
def libm(name: str) -> Callable[[float], float]:
    """libm's float function ``name`` (``expf``, ``tanhf``), as the compiled kernel calls it."""
    path = ctypes.util.find_library("m")
    lib = ctypes.CDLL(path) if path else ctypes.CDLL(None)
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn


def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``a*b + c`` rounded once (numpy, elementwise). The product is exact in
    float64; the float64 sum ``s`` and its error ``e`` (two-sum) hold the exact result, and
    rounding ``s`` to float32 is the right answer unless ``s`` lies exactly halfway between
    two floats, where ``e`` says which side the exact value is on."""
    a64, b64, c64 = (np.asarray(z, dtype=F32).astype(np.float64) for z in (a, b, c))
    p = a64 * b64
    s = p + c64
    bb = s - p
    e = (p - (s - bb)) + (c64 - bb)
    r = s.astype(F32)
    r64 = r.astype(np.float64)
    other = np.nextafter(r, np.where(s > r64, F32(np.inf), F32(-np.inf))).astype(F32)
    o64 = other.astype(np.float64)
    tie = (s != r64) & ((r64 + o64) * 0.5 == s)
    toward_other = np.sign(e) == np.sign(o64 - r64)
    return np.where(tie & (e != 0) & toward_other, other, r).astype(F32)


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=F32).astype(np.float16).astype(F32)


def one_chunk_oracle(
    scores: np.ndarray,
    mask: np.ndarray,
    v: np.ndarray,
    scale: float,
    softcap: float = 0.0,
    *,
    f16_acc: bool,
    fused_sum: bool = True,
) -> np.ndarray:
    """The kernel in plain numpy: scores (G, R, S) raw products, mask (t, S) (row r reads
    ``r % t``), values (G, S, DV) -> (G, R, DV). Slow (a Python loop per cell); for tests."""
    expf, tanhf = libm("expf"), libm("tanhf")
    G, R, S = scores.shape
    t, DV = mask.shape[0], v.shape[2]
    out = np.empty((G, R, DV), F32)
    one = F32(1.0)
    for g in range(G):
        for r in range(R):
            acc = np.zeros(DV, F32)
            total, M = F32(0.0), F32(-np.inf)
            for c in range(S):
                mv = mask[r % t, c]
                if mv == -np.inf:
                    continue
                s = F32(scores[g, r, c] * F32(scale))
                if softcap:
                    s = F32(F32(softcap) * F32(tanhf(float(s))))
                s = F32(s + mv)
                ms, vs = one, one
                if s > M:
                    ms = F32(expf(float(M - s)))
                    M = s
                    acc = _f16(acc * ms) if f16_acc else acc * ms
                else:
                    vs = F32(expf(float(s - M)))
                acc = fma(v[g, c], np.full(DV, vs, F32), acc)
                if f16_acc:
                    acc = _f16(acc)
                if fused_sum:
                    total = fma(np.array([total]), np.array([ms]), np.array([vs]))[0]
                else:
                    total = F32(F32(total * ms) + vs)
            inv = F32(0.0) if total == 0 else F32(one / total)
            out[g, r] = acc * inv
    return out


def one_chunk(
    scores: np.ndarray,
    mask: np.ndarray,
    v: np.ndarray,
    scale: float,
    softcap: float = 0.0,
    *,
    f16_acc: bool,
    fused_sum: bool = True,
) -> np.ndarray:
    """The kernel compiled (numba), the oracle's bits; the oracle where numba is missing."""
    from qllama.backends.numpy.dispatch import kernels_available

    if not kernels_available():
        return one_chunk_oracle(
            scores, mask, v, scale, softcap, f16_acc=f16_acc, fused_sum=fused_sum
        )
    # the kernels' package is typed loosely (numba); the module, imported by name
    flash = importlib.import_module("qllama.backends.numpy.kernels.flash")
    out = np.empty((scores.shape[0], scores.shape[1], v.shape[2]), F32)
    flash.one_chunk(
        np.ascontiguousarray(scores, dtype=F32),
        np.ascontiguousarray(mask, dtype=F32),
        np.ascontiguousarray(v, dtype=F32),
        float(F32(scale)),
        float(F32(softcap)),
        f16_acc,
        fused_sum,
        out,
    )
    return out
