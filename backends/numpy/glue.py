"""The numpy backend's compiled glue: the model's RMSNorm, RoPE, SwiGLU and attention softmax
in one numba call each (:mod:`qllama.backends.numpy.kernels.glue`), offered to the model
through :func:`qllama.backends.base.glue`.

Each op takes and returns float32 arrays and gives the bits of the model's array-API form on
numpy. Two of numpy's own choices are restated by the kernels (its pairwise float32 sum, its
x86 SIMD float32 exp); :func:`glue_exact` checks them against this process's numpy once, and
where they differ (numpy built without those kernels, or another sum) no op is offered.
Imported only where numba is installed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from qllama.backends.numpy.kernels import glue as kernels
from qllama.backends.numpy.kernels import router as router_kernels

F32 = np.float32
# A softmax of this many scores or more spreads its rows over numba's threads (a prefill
# tile's); below it, waking them costs more than it saves (a decode step's 9 x 256)
THREADED = 1 << 16


def _exp_arguments(chunk: int = 1 << 16) -> Iterator[np.ndarray]:
    """Every 997th float32 of [-104, 89] by bits (-104 ... -0, then 0 ... 89), ``chunk`` at a
    time: the whole of it would be 50 MB of temporaries at the peak of a model's load."""
    for start, stop, step in ((0xC2D00000, 0x80000000, -997), (0, 0x42B20000, 997)):
        span = step * chunk
        for lo in range(start, stop, span):
            hi = max(lo + span, stop) if step < 0 else min(lo + span, stop)
            yield np.arange(lo, hi, step, dtype=np.int64).astype(np.uint32).view(F32)


@functools.cache
def glue_exact() -> bool:
    """Whether the kernels' exp and sum give this numpy's bits: exp on every 997th float32 of
    [-104, 89] (the subnormal results included) and the sums of rows of 1 to 4100 numbers."""
    with np.errstate(over="ignore", under="ignore"):
        for args in _exp_arguments():
            if not np.array_equal(kernels.exp_all(args), np.exp(args)):
                return False
    rng = np.random.default_rng(0)
    for n in (1, 7, 8, 63, 128, 129, 576, 1536, 4100):
        row = rng.standard_normal(n).astype(F32)
        if kernels.pairwise_sum(row, 0, n, False) != np.sum(row):
            return False
    return True


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * w`` over the last axis of ``x`` (..., D)."""
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    D = x.shape[-1]
    kernels.rms_norm(x.reshape(-1, D), w, eps, out.reshape(-1, D))  # (rows, D)
    return out


def _rotation(kernel: Callable[..., None]) -> Callable[..., np.ndarray]:
    def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        kernel(x, np.ascontiguousarray(cos), np.ascontiguousarray(sin), out)
        return out

    return rotate


# x (T, H, n_rot) rotated by the angles cos, sin (T, n_rot/2): adjacent pairs (x[2i], x[2i+1])
# and the halves' pairs (x[i], x[i + n_rot/2])
rope = _rotation(kernels.rope_pairs)
rope_halves = _rotation(kernels.rope_halves)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``silu(gate) * up``, both (T, n_ff)."""
    gate, up = np.ascontiguousarray(gate), np.ascontiguousarray(up)
    out = np.empty_like(gate)
    kernels.swiglu(gate.reshape(-1), up.reshape(-1), out.reshape(-1))  # (T*n_ff,) each
    return out


def slot_sum(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Each slot's output ``y`` (T, k, n) times its weight ``w`` (T, k), the slots added in
    slot order: (T, n)."""
    y, w = np.ascontiguousarray(y, F32), np.ascontiguousarray(w, F32)
    out = np.empty((y.shape[0], y.shape[2]), F32)
    kernels.slot_sum(y, w, out)
    return out


def masked_softmax(scores: np.ndarray, scale: float, mask: np.ndarray) -> np.ndarray:
    """``softmax(scores * scale + mask)`` of scores (..., t, S) under ``mask`` (t, S)."""
    scores = np.ascontiguousarray(scores)
    out = np.empty_like(scores)
    t, S = mask.shape
    rows = (-1, t, S)  # (R, t, S): every leading axis is a row of queries over the mask
    # a decode step's few rows on this thread; a prefill tile's on numba's threads too
    kernel = kernels.masked_softmax if scores.size < THREADED else kernels.masked_softmax_threads
    kernel(scores.reshape(rows), scale, np.ascontiguousarray(mask), out.reshape(rows))
    return out


def attention(
    backend: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float
) -> np.ndarray:
    """Queries (t, n_head, hd) over keys (n_kv, S, hd) and values (n_kv, S, hd_v) under
    ``mask`` (t, S): the model's products on the same arrays (``backend.attention_scores``, then
    ``matmul``), with the compiled softmax between them and ndarray methods for the reshapes;
    (t, n_head * hd_v)."""
    t, n_head, hd = q.shape
    n_kv, S, hd_v = v.shape
    n_rep = n_head // n_kv
    # query head h reads kv head h // n_rep: one product per kv head over its query heads
    q = q.reshape(t, n_kv, n_rep, hd).transpose(1, 2, 0, 3).reshape(n_kv, n_rep * t, hd)
    scores = backend.attention_scores(q, k)  # (n_kv, n_rep*t, S)
    p = masked_softmax(scores.reshape(n_kv * n_rep, t, S), scale, mask)  # (n_kv*n_rep, t, S)
    out = np.matmul(p.reshape(n_kv, n_rep * t, S), v)  # (n_kv, n_rep*t, hd_v)
    out = out.reshape(n_kv, n_rep, t, hd_v).transpose(2, 0, 1, 3)  # (t, n_kv, n_rep, hd_v)
    return out.reshape(t, n_head * hd_v)


def router_soft_max(x: np.ndarray, *, simd: bool, width: int) -> np.ndarray:
    """ggml's CPU soft_max of float32 rows ``x`` (T, n), compiled: the bits of
    :func:`qllama.backends.numpy.router.soft_max` with the same ``simd`` and ``width``."""
    x = np.ascontiguousarray(x, F32)
    out = np.empty_like(x)
    router_kernels.soft_max(x, simd, width, out)
    return out


def router_sum_rows(x: np.ndarray) -> np.ndarray:
    """ggml's CPU sum_rows of float32 rows ``x`` (T, n), compiled: (T, 1), the bits of
    :func:`qllama.backends.numpy.router.sum_rows`."""
    x = np.ascontiguousarray(x, F32)
    out = np.empty((x.shape[0], 1), F32)
    router_kernels.sum_rows(x, out)
    return out


def router_route(
    x: np.ndarray,
    k: int,
    select_on_softmax: bool,
    norm: bool,
    scale: float,
    min_sum: float,
    ranked_past: int,
    *,
    simd: bool,
    width: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """A router's whole routing of float32 logits ``x`` (T, n) in one compiled call
    (:func:`qllama.backends.numpy.kernels.router.route`, whose docstring has the arguments):
    each token's k experts (T, k) int64, the best first, and their weights (T, k) float32,
    the bits of the model's steps with :func:`router_soft_max` and :func:`router_sum_rows`;
    None where a row holds a NaN or, past ``ranked_past`` experts, its top k meets a tie (the
    model's steps then rank it as ggml's sort does)."""
    x = np.ascontiguousarray(x, F32)
    selected = np.empty((x.shape[0], k), np.int64)
    weights = np.empty((x.shape[0], k), F32)
    done = router_kernels.route(
        x, k, select_on_softmax, norm, scale, min_sum, ranked_past, simd, width, selected, weights
    )
    return (selected, weights) if done else None


# the ops that need the backend itself (its attention_scores) take it first
OPS: dict[str, Callable[..., Any]] = {
    "rms_norm": rms_norm,
    "rope": rope,
    "rope_halves": rope_halves,
    "swiglu": swiglu,
    "masked_softmax": masked_softmax,
    "slot_sum": slot_sum,
}
WITH_BACKEND: dict[str, Callable[..., Any]] = {"attention": attention}
