"""What every backend is: the small fixed protocol the model calls, and the weights it sees.

The model never learns a weight's type. At load it hands each 2-D weight, as the file stores
it, to ``backend.prepare`` (upload, repack or dequantize, once); in the forward pass it calls
only ``backend.matmul(x, w)`` and ``backend.embedding(ids, w)``, and :func:`matmuls` for the
products that share an input (Q, K and V; gate and up): one call of the backend's optional
``matmuls(x, ws)`` where its class has one, else ``matmul`` on each; and :func:`expert_matmul`
for a mixture of experts' products (ggml's ``mul_mat_id``: each token's rows times the experts
the router chose for it), the backend's own ``expert_matmul`` where its class has one, else one
``matmul`` per chosen expert over the rows routed to it (:func:`expert_matmuls` for those that
share an input and a selection, up and gate, as :func:`matmuls`). Everything else (norms, RoPE,
attention) is array-API code run on ``backend.xp``, attention a block of queries at a time
(``attention_bytes``, optional too), its scores by :func:`attention_scores` (the backend's
optional ``attention_scores(q, k)``, else ``q @ k^T``). A backend may compute some of that glue
itself: :func:`glue` hands the model the backend's form of an op of :data:`GLUE_OPS` where it
offers one, with the same numbers as the array-API form in fewer dispatches, or, for a
mixture's router ops, with the numbers of its arithmetic (the CPU arithmetic: ggml's).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from qllama.array_api import to_numpy
from qllama.errors import BackendError, UnsupportedTensorTypeError
from qllama.ggml_types import GGMLType


@dataclass(frozen=True)
class QuantTensor:
    """A 2-D weight exactly as the GGUF file stores it.

    ``shape`` is numpy order ``(rows, row_length)``: a linear layer ``y = x @ W.T`` has
    ``rows`` outputs and ``row_length`` inputs, and each row is a run of blocks.
    """

    name: str
    ggml_type: GGMLType
    shape: tuple[int, int]
    data: np.ndarray  # uint8, (rows * row_bytes,), usually a read-only view of the file

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_length(self) -> int:
        return self.shape[1]


@runtime_checkable
class Backend(Protocol):
    """The protocol. ``name`` is the registry key; ``xp`` the array namespace the model uses."""

    name: ClassVar[str]
    xp: Any
    device: Any
    dequantize_all: bool

    def supports(self, ggml_type: GGMLType) -> bool:
        """Whether ``prepare`` accepts weights of this type (a declared table, not a probe)."""
        ...

    def prepare(self, tensor: QuantTensor) -> Any:
        """Turn a stored weight into whatever ``matmul``/``embedding`` take; called once."""
        ...

    def matmul(self, x: Any, w: Any) -> Any:
        """``x @ W.T``: ``x`` is ``(T, row_length)`` float32 in ``xp``; returns ``(T, rows)``."""
        ...

    def embedding(self, ids: Any, w: Any) -> Any:
        """Rows ``ids`` of ``W``, dequantized: ``(T,)`` integer ids -> ``(T, row_length)``."""
        ...

    def asarray(self, x: Any) -> Any:
        """An ``xp`` array on the backend's device (inputs: token ids, norm weights)."""
        ...


# Attention scores a block of queries at a time, each block's (n_head, rows, cache) scores at
# most this many bytes unless the backend's class says otherwise (``attention_bytes``): a
# bound on memory for long prompts, large enough that a GPU sees a few big products.
ATTENTION_BYTES = 256 << 20


def attention_bytes(backend: Backend) -> int:
    """The bytes of one block of attention scores on ``backend``."""
    return int(getattr(backend, "attention_bytes", ATTENTION_BYTES))


def attention_scores(backend: Backend, q: Any, k: Any) -> Any:
    """Queries ``(n_kv, m, hd)`` times the cached keys ``(n_kv, S, hd)`` of their KV head:
    ``(n_kv, m, S)``, one product per head. The backend's ``attention_scores(q, k)`` where it
    has one (the same numbers, computed faster), else ``q @ k^T``."""
    own = getattr(backend, "attention_scores", None)
    if own is not None:
        return own(q, k)
    xp = backend.xp
    return xp.matmul(q, xp.permute_dims(k, (0, 2, 1)))


# The glue a backend may compute (:func:`glue`), each with the signature and the numbers of the
# model's array-API form: rms_norm(x, w, eps); rope(x, cos, sin), adjacent pairs; rope_halves(x,
# cos, sin), the pairs (i, i + n_rot/2); swiglu(gate, up) = silu(gate) * up;
# masked_softmax(scores, scale, mask) = softmax(scores * scale + mask) over the last axis, terms
# below scores.NEGLIGIBLE dropped; attention(q, k, v, mask, scale): queries (t, n_head, hd) over
# a KV head's cached keys (n_kv, S, hd) and values (n_kv, S, hd_v), query head h reading KV
# head h // (n_head / n_kv), scores by attention_scores, then masked_softmax, then P V:
# (t, n_head * hd_v).
# Then a mixture's router ops, ggml's as llama.cpp's build_moe_ffn calls them, with the numbers of
# the backend's arithmetic (the CPU one: ggml's CPU ops bit for bit), else of the array-API form:
# soft_max(x) over the last axis of x (T, n), no scale, no mask (router_softmax: exp(x - max)
# times the reciprocal of the sum); sum_rows(x), x (T, k) -> (T, 1) (row_sum: the namespace's
# float32 sum; ggml's CPU adds in order in double); route(logits, k, select_on_softmax, norm,
# scale, min_sum, ranked_past): the model's routing steps with those two (the top k, the
# weights: Model._route) in one call, (selected, weights), or None where it declines a row.
# And slot_sum(y, w): each slot's output y (T, k, n) times its weight w (T, k), the slots added
# in slot order, (T, n).
GLUE_OPS = (
    "rms_norm",
    "rope",
    "rope_halves",
    "swiglu",
    "masked_softmax",
    "attention",
    "soft_max",
    "sum_rows",
    "route",
    "slot_sum",
)


def glue(backend: Backend, op: str) -> Callable[..., Any] | None:
    """The backend's own form of the forward pass's glue op ``op`` (one of :data:`GLUE_OPS`):
    what its class's ``glue(op)`` returns (None: it has none for ``op`` here), else None, and
    the model computes ``op`` in array-API code. Looked up on the class, as :func:`matmuls`."""
    own = getattr(type(backend), "glue", None)
    return None if own is None else own(backend, op)


def arithmetic(backend: Backend) -> str:
    """The study's name for what a backend computes (docs/architecture.md): ``cpu`` where
    activations are quantized before integer dot products (the numpy backend's default),
    ``dequantize-all`` where every weight was widened at load, ``per-tensor`` under an
    arithmetic policy, else ``gpu`` (float activations times weights dequantized inside each
    matmul)."""
    if backend.dequantize_all:
        return "dequantize-all"
    if getattr(backend, "routes", None) is not None:
        return "per-tensor"
    return "cpu" if getattr(backend, "activations", None) == "q8" else "gpu"


def describe(backend: Backend) -> str:
    """One line saying what computes a run: the backend's ``describe()`` where its class has
    one (device, arithmetic, kernels, threads), else its name and arithmetic."""
    own = getattr(backend, "describe", None)
    if own is not None:
        return str(own())
    return f"{backend.name}, {arithmetic(backend)} arithmetic"


def matmuls(backend: Backend, x: Any, ws: Sequence[Any]) -> tuple[Any, ...]:
    """``x @ W.T`` for each weight of ``ws``: the backend's ``matmuls(x, ws)`` where its class
    defines one (the same numbers as ``matmul`` on each, in fewer calls), else ``matmul`` on
    each. Looked up on the class, so that a wrapper that forwards attributes to the backend it
    wraps (and has its own weights) is called weight by weight."""
    fused = getattr(type(backend), "matmuls", None)
    if fused is None:
        return tuple(backend.matmul(x, w) for w in ws)
    return tuple(fused(backend, x, ws))


def expert_matmul(backend: Backend, x: Any, experts: Sequence[Any], selected: Any) -> Any:
    """ggml's ``mul_mat_id``: ``x[t] @ experts[selected[t, s]].T`` for every token ``t`` and
    slot ``s``, ``(T, k, rows)``.

    ``x`` is ``(T, K)`` (one row per token, shared by its k experts: up and gate) or
    ``(T, k, K)`` (one row per token and slot: down); ``experts`` the prepared 2-D slices of a
    3-D expert tensor; ``selected`` ``(T, k)`` expert ids. The backend's ``expert_matmul`` where
    its class has one, else each chosen expert's products in one ``matmul`` over the rows
    routed to it, bucketed as ggml buckets them (token-major, slot-minor), and no product for
    an expert no token chose. Under the CPU arithmetic a row's product does not depend on the
    other rows of the call (each row is quantized by itself, integer sums are exact), so this
    is, bit for bit, the product of each (token, slot) alone (tests/test_moe.py).
    """
    own = getattr(type(backend), "expert_matmul", None)
    if own is not None:
        return own(backend, x, experts, selected)
    return grouped_expert_matmul(backend, x, experts, selected)


def expert_matmuls(
    backend: Backend, x: Any, tensors: Sequence[Sequence[Any]], selected: Any
) -> tuple[Any, ...]:
    """:func:`expert_matmul` of one input and selection with each expert tensor of ``tensors``
    (up and gate): the backend's ``expert_matmuls(x, tensors, selected)`` where its class
    defines one (the same numbers, in fewer calls), else :func:`expert_matmul` on each. Looked
    up on the class, as :func:`matmuls`."""
    fused = getattr(type(backend), "expert_matmuls", None)
    if fused is None:
        return tuple(expert_matmul(backend, x, t, selected) for t in tensors)
    return tuple(fused(backend, x, tensors, selected))


def group_pairs(selected: Any, n_expert: int) -> tuple[np.ndarray, np.ndarray]:
    """The (token, slot) pairs of ``selected`` (T, k) grouped by expert as ggml buckets them:
    ``order`` (T*k,), the pairs' flat indices (token-major, slot-minor) expert by expert, in
    their order within each, and ``bounds`` (n_expert + 1,): expert ``e``'s pairs are
    ``order[bounds[e]:bounds[e + 1]]``. An id outside ``[0, n_expert)`` is refused."""
    flat = np.asarray(to_numpy(selected)).astype(np.int64).reshape(-1)  # (T*k,)
    if flat.size and (flat.min() < 0 or flat.max() >= n_expert):
        raise BackendError(
            f"expert ids must lie in [0, {n_expert}), got {flat.min()} .. {flat.max()}"
        )
    order = np.argsort(flat, kind="stable")
    return order, np.searchsorted(flat[order], np.arange(n_expert + 1))


def grouped_expert_matmul(backend: Backend, x: Any, experts: Sequence[Any], selected: Any) -> Any:
    """:func:`expert_matmul` from ``matmul``: each chosen expert's products in one ``matmul``
    over the rows routed to it (ggml's buckets), no product for an expert no token chose."""
    xp = backend.xp
    T, k = selected.shape
    order, bounds = group_pairs(selected, len(experts))
    rows = x.shape[-1]
    x2 = xp.reshape(x, (T * k, rows)) if x.ndim == 3 else x  # (T*k or T, K)
    source = order if x.ndim == 3 else order // k  # the row of x2 of each grouped pair
    parts = []
    for e, (a, b) in enumerate(itertools.pairwise(bounds.tolist())):
        if a == b:
            continue
        idx = backend.asarray(source[a:b].astype(np.int32))
        parts.append(backend.matmul(xp.take(x2, idx, axis=0), experts[e]))  # (b - a, n_out)
    y = parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)  # (T*k, n_out), grouped
    back = backend.asarray(np.argsort(order).astype(np.int32))  # pair j's row of y
    out = xp.take(y, back, axis=0)  # (T*k, n_out) token-major, slot-minor
    return xp.reshape(out, (T, k, out.shape[-1]))


def router_softmax(x: Any, *, xp: Any) -> Any:
    """The router's softmax over the last axis in the array API: exp(x - max), times the
    reciprocal of the sum (not divided by the sum, as ggml). No term is dropped, unlike the
    attention's softmax: a router row is a few dozen logits."""
    e = xp.exp(x - xp.max(x, axis=-1, keepdims=True))
    return e * (1.0 / xp.sum(e, axis=-1, keepdims=True))


def row_sum(x: Any, *, xp: Any) -> Any:
    """ggml's ``sum_rows`` in the array API: each row of ``x`` (T, k) summed in the namespace's
    float32 order, (T, 1)."""
    return xp.sum(x, axis=-1, keepdims=True)


def check_supported(backend: Backend, tensor: QuantTensor, types: frozenset[GGMLType]) -> None:
    """Refuse a weight type a backend does not declare, naming both."""
    if tensor.ggml_type not in types:
        raise UnsupportedTensorTypeError(
            f"backend {backend.name} does not support {tensor.ggml_type.name} "
            f"(tensor '{tensor.name}'); it supports {', '.join(sorted(t.name for t in types))}"
        )


def require_device(backend_name: str, device: str | None, devices: tuple[str, ...]) -> str:
    """The device to use: the first of ``devices`` by default; a clear error if unknown."""
    if device is None:
        return devices[0]
    if device not in devices:
        raise BackendError(
            f"backend {backend_name} has no device {device!r}; available here: {', '.join(devices)}"
        )
    return device
