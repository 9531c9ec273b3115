"""The Hadamard rotation llama.cpp applies to queries, keys and values of a quantized KV cache.

llama.cpp multiplies by the Sylvester Hadamard matrix scaled by 1/sqrt(n), but its CPU computes
the product as a fast Walsh-Hadamard transform (``ggml/src/ggml-cpu/ops.cpp
ggml_compute_forward_fwht_impl``): each element times ``1.0f / sqrtf(n)`` first, then butterfly
stages ``len = 1, 2, ..., n/2`` of float32 sums and differences. A dense float32 matmul gives
other bits; this module computes the transform's. Each stage's adds are independent, so a
stage computed on whole arrays gives the scalar loop's bits.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def fwht(x: np.ndarray, n: int) -> np.ndarray:
    """``x`` (..., d) with each run of ``n`` elements along the last axis rotated (``d`` a
    multiple of ``n``, ``n`` a power of two); float32, a new array."""
    d = x.shape[-1]
    if n & (n - 1) or d % n:
        raise ValueError(f"a Hadamard block of {n} must be a power of two dividing {d}")
    y = np.asarray(x, dtype=F32) * (F32(1.0) / np.sqrt(F32(n)))
    y = y.reshape(-1, d // n, n)  # (rows, chunks, n)
    size = 1
    while size < n:
        pairs = y.reshape(y.shape[0], y.shape[1], n // (2 * size), 2, size)  # (.., blocks, 2, len)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = np.stack([a + b, a - b], axis=-2).reshape(y.shape)  # (rows, chunks, n)
        size *= 2
    return y.reshape(x.shape)


def fwht_loop(x: np.ndarray, n: int) -> np.ndarray:
    """The transform of one vector ``x`` (n,) as ggml's scalar loop writes it (the oracle)."""
    y = [F32(v) * (F32(1.0) / np.sqrt(F32(n))) for v in np.asarray(x, dtype=F32)]
    size = 1
    while size < n:
        for i in range(0, n, 2 * size):
            for j in range(size):
                a, b = y[i + j], y[i + size + j]
                y[i + j], y[i + size + j] = F32(a + b), F32(a - b)
        size *= 2
    return np.array(y, dtype=F32)


def dense(n: int) -> np.ndarray:
    """The rotation as a matrix, ``H[i, j] = (-1)^popcount(i & j) / sqrt(n)`` (float64)."""
    i = np.arange(n)
    bits = np.bitwise_and.outer(i, i)
    parity = np.array([bin(int(b)).count("1") & 1 for b in bits.ravel()]).reshape(n, n)
    return (1 - 2 * parity) / np.sqrt(n)
