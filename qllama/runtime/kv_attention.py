"""Attention over llama.cpp's typed KV caches (bf16, the block formats, flash attention) as its
CPU computes it (``src/llama-graph.cpp build_attn_mha``, ``ggml/src/ggml-cpu/ops.cpp``).

What each cache stores is :mod:`qllama.runtime.kv_cache`'s business; this module reads it.

Without flash attention (``kq = mul_mat(K, Q)``, softmax, ``kqv = mul_mat(V, P)``): the query is
converted to the K type's ``vec_dot_type`` (F16 -> f16, BF16 -> bf16, the 32-block formats ->
Q8_0 or Q8_1) and a block-format K is multiplied with the numpy backend's CPU arithmetic, the
same integer ``vec_dot`` as a weight of that type; the probabilities are rounded to f16 or bf16
for an F16 or BF16 V (float V only: a block V needs flash attention).

With flash attention, llama.cpp's kernel for the call:

====================================================  ==============================================
when                                                  qllama
====================================================  ==============================================
K and V both F16 (an F32 cache is cast to F16),       the tiled kernel's arithmetic as
64 queries or more                                    ``"f16-flash"`` computes it (Q, P float32;
                                                      float sums in BLAS's order, not ggml's)
K and V both F16, one query, 512 cells or more        split-KV for the thread count ``,fa=N``
                                                      declares (its numbers depend on it); refused
                                                      without one
everything else (block formats, BF16, mixed types,    ``one_chunk``, compiled
short batches)                                        (:mod:`qllama.runtime.flash_attention`)
====================================================  ==============================================

Bit-exactness: block-format K scores are ggml's ``vec_dot`` (the backend's integer kernels);
F16/BF16 K scores are exact products summed in BLAS's order (an ulp from ggml's SIMD sums).
The one_chunk loop after the scores (libm ``expf``, FMA, the f16 accumulator) is ggml's bit for
bit.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from qllama.backends.base import QuantTensor
from qllama.errors import BackendError
from qllama.quants.base import Rounding
from qllama.runtime import flash_attention
from qllama.runtime.hadamard import fwht
from qllama.runtime.kv_cache import capacity_for
from qllama.runtime.kv_types import CACHE_TYPES, KVSpec, round_to
from qllama.runtime.scores import softcap as cap_scores
from qllama.runtime.scores import softmax

F32 = np.float32
TILED_QUERIES = 64  # GGML_FA_TILE_Q: a batch this long runs the tiled kernel
SPLIT_CELLS = 512  # single-token decode over this many cells runs split-KV


@functools.cache
def _cpu_backend(rounding: Rounding) -> Any:
    """The numpy backend computing the CPU arithmetic (Q quantized to the K type's
    vec_dot_type, integer block dots) with ``rounding`` (the arch quantize_row_q8_0's)."""
    from qllama.backends.numpy.dispatch import NumpyBackend

    return NumpyBackend(activations="q8", activation_rounding=rounding)


def flash_kernel(spec: KVSpec, queries: int, cells: int) -> str:
    """llama.cpp's flash attention kernel for a batch of ``queries`` over ``cells`` cells (its
    ``n_kv``, a multiple of 256; ``ggml_compute_forward_flash_attn_ext_f16``): "tiled",
    "split" or "one_chunk"."""
    if spec.tiled:
        return "tiled"
    f16_pair = spec.type_k == spec.type_v and spec.type_k in ("f32", "f16")
    if f16_pair and queries == 1 and cells >= SPLIT_CELLS:
        return "split"
    if f16_pair and queries >= TILED_QUERIES:
        return "tiled"
    return "one_chunk"


def read_type(spec: KVSpec, which: str) -> str:
    """The type attention reads: flash attention casts an F32 cache to F16 first."""
    t = spec.type_k if which == "k" else spec.type_v
    return "f16" if spec.flash and t == "f32" else t


def attend(
    cache: Any,
    layer: int,
    q: np.ndarray,
    mask: np.ndarray,
    *,
    queries: int,
    cells: int,
    scale: float,
    softcap: float,
) -> np.ndarray:
    """Queries ``q`` (t, n_head, hd), a block of a batch of ``queries`` whose cache now
    holds ``cells`` positions, over ``cache``'s layer under ``mask`` (t, S); (t, n_head*hd_v)."""
    spec: KVSpec = cache.spec
    t, n_head, hd = q.shape
    n_kv = cache.n_head_kv
    n_rep = n_head // n_kv
    hd_v = cache.head_dims[1]
    rot_k, rot_v = cache.rotation
    if rot_k:
        q = fwht(q, rot_k)
    q = np.reshape(
        np.transpose(np.reshape(q, (t, n_kv, n_rep, hd)), (1, 2, 0, 3)), (n_kv, n_rep * t, hd)
    )  # (n_kv, n_rep*t, hd)
    n_kv_cells = capacity_for(cells)  # llama.cpp's n_kv: the used cells padded to 256
    kernel = flash_kernel(spec, queries, n_kv_cells) if spec.flash else None
    if kernel == "split" and spec.threads is None:
        raise BackendError(
            f"KV cache {spec.name!r}: a single-token step over {n_kv_cells} cells runs llama.cpp's "
            f"split-KV flash attention, whose numbers depend on its thread count; declare it "
            f"('{spec.name}=N' for N threads), or use {spec.type_k}/{spec.type_v} without ',fa'"
        )
    k_type = read_type(spec, "k")  # tiled: F16 K against a float32 Q
    scores = _scores(cache, layer, q, "f32" if kernel == "tiled" else k_type, k_type)
    v = cache.v[layer]  # (n_kv, S, hd_v)
    cap = F32(softcap) if softcap else F32(0.0)
    kq_scale = F32(F32(scale) / cap) if softcap else F32(scale)
    if kernel in ("one_chunk", "split") and spec.type_v == "f32":  # cast to f16 for flash
        v = round_to("f16", v)
    if kernel == "split":
        assert spec.threads is not None
        n = n_kv_cells  # its chunks cut n_kv cells, not qllama's capacity
        out = flash_attention.split(
            scores[..., :n],
            mask[:, :n],
            v[:, :n],
            float(kq_scale),
            float(cap),
            threads=spec.threads,
        )  # (n_kv, n_rep, hd_v)
    elif kernel == "one_chunk":
        out = flash_attention.one_chunk(
            scores,
            mask,
            v,
            float(kq_scale),
            float(cap),
            f16_acc=read_type(spec, "v") == "f16",
        )  # (n_kv, n_rep*t, hd_v)
    else:
        out = _softmax_product(scores, mask, v, spec, kernel, t, scale, softcap)
    out = np.reshape(
        np.transpose(np.reshape(out, (n_kv, n_rep, t, hd_v)), (2, 0, 1, 3)), (t, n_head * hd_v)
    )  # (t, n_head*hd_v)
    return fwht(out, rot_v) if rot_v else out


def _scores(cache: Any, layer: int, q: np.ndarray, q_type: str, k_type: str) -> np.ndarray:
    """Raw products K·Q (n_kv, rows, S): the K type's vec_dot with Q converted to its
    vec_dot_type (``q_type``; the tiled kernel keeps Q float32)."""
    if cache.spec.quantized("k"):
        backend = _cpu_backend(cache.rounding)
        raw = cache.k_raw[layer]  # (n_kv, S, row_bytes)
        g_type = CACHE_TYPES[cache.spec.type_k]
        S, hd = raw.shape[1], q.shape[2]
        out = []
        for g in range(raw.shape[0]):
            tensor = QuantTensor(
                f"KV cache K (layer {layer}, head {g})", g_type, (S, hd), raw[g].reshape(-1)
            )
            out.append(backend.matmul(q[g], backend.prepare(tensor)))  # (rows, S)
        return np.stack(out)
    k = cache.k[layer]  # (n_kv, S, hd): stored values
    if k_type != cache.spec.type_k:  # flash attention's cast of an F32 cache to F16
        k = round_to(k_type, k)
    return np.matmul(round_to(q_type, q), np.transpose(k, (0, 2, 1)))


def _softmax_product(
    scores: np.ndarray,
    mask: np.ndarray,
    v: np.ndarray,
    spec: KVSpec,
    kernel: str | None,
    t: int,
    scale: float,
    softcap: float,
) -> np.ndarray:
    """softmax(scores*scale + mask) times V: the non-flash path (P rounded to the V type) or
    the tiled kernel's float arithmetic; (n_kv, rows, hd_v)."""
    xp = np
    n_kv, rows, S = scores.shape
    s = np.reshape(scores, (n_kv, rows // t, t, S)) * F32(scale)  # (n_kv, n_rep, t, S)
    if softcap:
        s = cap_scores(s, softcap, xp=xp)
    p = softmax(s + mask, xp=xp)  # (n_kv, n_rep, t, S)
    if kernel is None:  # mul_mat(V, P): P converted to the V type's vec_dot_type
        p = round_to(spec.type_v, p)
    else:  # tiled: the F16 V widened, P float32
        v = round_to("f16", v)
    return np.matmul(np.reshape(p, (n_kv, rows, S)), v)  # (n_kv, rows, hd_v)
