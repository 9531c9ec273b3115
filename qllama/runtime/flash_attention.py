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

import importlib

import numpy as np

from qllama.quants.rounding import fma, libm

F32 = np.float32


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=F32).astype(np.float16).astype(F32)


def chunk_oracle(
    scores: np.ndarray,
    mask: np.ndarray,
    v: np.ndarray,
    scale: float,
    softcap: float = 0.0,
    *,
    f16_acc: bool,
    fused_sum: bool = True,
    cells: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The loop in plain numpy over ``cells`` (first, end; default all) of scores (G, R, S)
    raw products, mask (t, S) (row r reads ``r % t``), values (G, S, DV): each row's
    accumulator (G, R, DV), not yet divided by its sum, its maximum and its sum (G, R). Slow (a
    Python loop per cell); for tests."""
    expf, tanhf = libm("expf"), libm("tanhf")
    G, R, S = scores.shape
    t, DV = mask.shape[0], v.shape[2]
    c0, c1 = cells or (0, S)
    acc_out = np.empty((G, R, DV), F32)
    m_out = np.empty((G, R), F32)
    s_out = np.empty((G, R), F32)
    one = F32(1.0)
    for g in range(G):
        for r in range(R):
            acc = np.zeros(DV, F32)
            total, M = F32(0.0), F32(-np.inf)
            for c in range(c0, c1):
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
            acc_out[g, r], m_out[g, r], s_out[g, r] = acc, M, total
    return acc_out, m_out, s_out


def chunk(
    scores: np.ndarray,
    mask: np.ndarray,
    v: np.ndarray,
    scale: float,
    softcap: float = 0.0,
    *,
    f16_acc: bool,
    fused_sum: bool = True,
    cells: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`chunk_oracle` compiled (numba), the same bits; the oracle where numba is
    missing."""
    from qllama.backends.numpy.dispatch import kernels_available

    if not kernels_available():
        return chunk_oracle(
            scores, mask, v, scale, softcap, f16_acc=f16_acc, fused_sum=fused_sum, cells=cells
        )
    # the kernels' package is typed loosely (numba); the module, imported by name
    flash = importlib.import_module("qllama.backends.numpy.kernels.flash")
    G, R, S = scores.shape
    c0, c1 = cells or (0, S)
    acc = np.empty((G, R, v.shape[2]), F32)
    m, total = np.empty((G, R), F32), np.empty((G, R), F32)
    flash.one_chunk(
        np.ascontiguousarray(scores, dtype=F32),
        np.ascontiguousarray(mask, dtype=F32),
        np.ascontiguousarray(v, dtype=F32),
        float(F32(scale)),
        float(F32(softcap)),
        f16_acc,
        fused_sum,
        c0,
        c1,
        acc,
        m,
        total,
    )
    return acc, m, total


def normalized(acc: np.ndarray, total: np.ndarray) -> np.ndarray:
    """``acc * (1/S)`` per row, 0 where nothing was attended (S = 0)."""
    with np.errstate(divide="ignore"):
        inv = np.where(total == 0, F32(0.0), F32(1.0) / total).astype(F32)
    return (acc * inv[..., None]).astype(F32)


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
    """The kernel in plain numpy over every cell: (G, R, DV)."""
    acc, _, total = chunk_oracle(
        scores, mask, v, scale, softcap, f16_acc=f16_acc, fused_sum=fused_sum
    )
    return normalized(acc, total)


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
    """The kernel compiled over every cell, the oracle's bits: (G, R, DV)."""
    acc, _, total = chunk(scores, mask, v, scale, softcap, f16_acc=f16_acc, fused_sum=fused_sum)
    return normalized(acc, total)


def split(
    scores: np.ndarray,
    mask: np.ndarray,
    v: np.ndarray,
    scale: float,
    softcap: float = 0.0,
    *,
    threads: int,
    compiled: bool = True,
) -> np.ndarray:
    """llama.cpp's split-KV decode (F16 K and V, one query, 512 cells or more): the cells cut
    into ``ceil(S / threads)``-sized chunks, one per thread, each the one_chunk loop (f16
    accumulator); then ``ggml_flash_attn_ext_reduce_partials`` folds them in order, skipping
    empty ones: ``M' = max(M, Mc)``, ``a = expf(M - M')``, ``b = expf(Mc - M')``,
    ``acc = acc*a + acc_c*b``, ``S = S*a + S_c*b`` (each product rounded, then the sum), and
    ``acc * (1/S)``. ``compiled=False``: the oracle."""
    run = chunk if compiled else chunk_oracle
    expf = np.vectorize(libm("expf"), otypes=[F32])
    G, R, S = scores.shape
    size = -(-S // threads)
    acc = np.zeros((G, R, v.shape[2]), F32)
    M = np.full((G, R), -np.inf, F32)
    total = np.zeros((G, R), F32)
    for c0 in range(0, S, size):
        part, m_c, s_c = run(
            scores, mask, v, scale, softcap, f16_acc=True, cells=(c0, min(c0 + size, S))
        )
        live = s_c != 0
        m_new = np.where(live, np.fmax(M, m_c), M).astype(F32)
        a = np.where(live, expf(M - m_new), F32(1.0)).astype(F32)
        b = np.where(live, expf(np.where(live, m_c - m_new, F32(0.0))), F32(0.0)).astype(F32)
        acc = np.where(live[..., None], acc * a[..., None] + part * b[..., None], acc).astype(F32)
        total = np.where(live, total * a + s_c * b, total).astype(F32)
        M = m_new
    with np.errstate(divide="ignore"):
        inv = np.where(total == 0, F32(1.0), F32(1.0) / total).astype(F32)
    return (acc * inv[..., None]).astype(F32)
