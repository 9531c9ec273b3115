"""The model's key/value cache, and the precision attention runs in.

Keys and values live in arrays of a fixed capacity, grown in steps of ``CAPACITY_STEP``
positions. New rows are written in place where the namespace's arrays are mutable (numpy,
torch); elsewhere with ``take`` and ``where`` (jax and array-api-strict have no in-place
update, and a Python slice at a moving position would make jax compile again). Both store
the same values. Array shapes therefore change only when the capacity grows, so jax compiles
each operation a handful of times rather than once per token. Attention runs over the whole
capacity; the causal mask hides the positions not yet written. A cache may be fixed
(:meth:`KVCache.fix`): allocated once for the whole context and kept across sequences, as a
compiled decode step needs it (its shapes and addresses then never change); its rows may then
be written at positions given as an array, data rather than a constant of the compiled graph.

candle keeps the cache and attention in float32. llama.cpp's default cache is f16, so its
K and V are rounded to half when stored. Without flash attention its KQ and KQV products
(``vec_dot_type`` F16) round the queries and the softmax probabilities to half too:
``precision="f16"`` emulates that. Its CPU flash attention over a batch of 64 queries or more
(``ggml_compute_forward_flash_attn_ext_tiled``, llama-perplexity's default) widens the half K
and V back to float32 and keeps Q and the probabilities in float32: ``precision="f16-flash"``.
Both need a namespace with ``float16`` (numpy, torch, jax).

The general form names llama.cpp's ``type_k`` / ``type_v`` and flash attention
(``"q8_0/q4_0,fa"``, :mod:`qllama.runtime.kv_types`): such a cache stores what llama.cpp's
``from_float`` writes for each type (rows Hadamard-rotated first for the block formats,
:mod:`qllama.runtime.hadamard`), keeps a block-format K's bytes for the integer ``vec_dot``,
and is read by :mod:`qllama.runtime.kv_attention`. It is the numpy backend's (the CPU
arithmetic); other backends refuse it.
"""

from __future__ import annotations

import copy
from numbers import Integral
from typing import Any

from array_api_compat import is_numpy_namespace, is_torch_namespace

from qllama.errors import BackendError
from qllama.quants.base import Rounding
from qllama.runtime import kv_types
from qllama.runtime.hadamard import fwht

PRECISIONS = kv_types.LEGACY  # the named ones; kv_types.parse reads the general form
CAPACITY_STEP = 256


def capacity_for(n: int) -> int:
    """The capacity that holds ``n`` positions."""
    return -(-n // CAPACITY_STEP) * CAPACITY_STEP


class KVCache:
    """Per-layer keys ``(n_head_kv, capacity, head_dim)`` and values ``(n_head_kv, capacity,
    head_dim_v)`` (``head_dim_v`` defaults to ``head_dim``): each head's rows contiguous, so
    that the attention products read them as plain matrices. Either layout gives the same bits
    on numpy and torch; alone, the scores product of a 1B shape over 4352 positions ran 3x
    faster this way, but SmolLM2's decode after 2048 positions measured the same."""

    def __init__(
        self,
        n_layer: int,
        n_head_kv: int,
        head_dim: int,
        xp: Any,
        *,
        device: Any = None,
        precision: str = "f32",
        head_dim_v: int | None = None,
        rounding: Rounding = "ref",
    ) -> None:
        self.spec = kv_types.parse(precision)
        hd_v = head_dim if head_dim_v is None else head_dim_v
        # typed: the types and kernels beyond the three legacy precisions (numpy only)
        self.typed = not self.spec.legacy
        if self.typed:
            if not is_numpy_namespace(xp):
                raise BackendError(
                    f"KV cache {precision!r}: llama.cpp's bf16 and block-format caches and its "
                    f"flash attention kernels are computed on the numpy backend (the CPU "
                    f"arithmetic) only, not on {xp.__name__}; use f32, f16 or f16-flash there"
                )
            kv_types.check_geometry(self.spec, head_dim, hd_v)
        self.rounding = rounding  # the arch quantize_row_q8_0's ties ("simd" on x86 AVX2)
        self.rotation = (
            kv_types.rotation_size(self.spec, "k", head_dim),
            kv_types.rotation_size(self.spec, "v", hd_v),
        )
        # the legacy precisions round in the namespace; the typed path rounds in numpy itself
        legacy_half = self.spec.legacy and self.spec.type_k == "f16"
        half = getattr(xp, "float16", None) if legacy_half else None
        if legacy_half and half is None:
            raise BackendError(
                f"KV cache precision {precision} needs a namespace with float16; "
                f"{xp.__name__} has none"
            )
        self.xp, self.device, self.precision, self._half = xp, device, precision, half
        self._half_operands = legacy_half and not self.spec.flash  # Q and P too
        # a decode step's write then costs its own rows, not a copy of the whole capacity
        self._in_place = is_numpy_namespace(xp) or is_torch_namespace(xp)
        # per layer: whether its arrays are this cache's alone (a fork shares them until one
        # of the two writes, and the writer copies first)
        self._own = [True] * n_layer
        self.n_head_kv = n_head_kv
        self.head_dims = (head_dim, hd_v)
        self.k: list[Any] = [None] * n_layer
        self.k_raw: list[Any] = [None] * n_layer  # a block-format K's bytes (n_kv, capacity, row)
        self.v: list[Any] = [None] * n_layer
        self.capacity = 0
        self.length = 0  # positions holding valid keys and values
        self.fixed = False  # allocated once (fix): reset keeps the arrays

    def fix(self, n: int) -> None:
        """Allocate room for ``n`` positions now and keep these arrays from then on: a new
        sequence reuses them (the mask hides what an earlier one left), so that a compiled
        step finds the same shapes at the same addresses at every call."""
        self.reserve(n)
        self.fixed = True

    def reset(self, length: int = 0) -> None:
        """Keep positions ``< length`` (0: forget everything, a new sequence)."""
        if length == 0 and not self.fixed:
            self.k = [None] * len(self.k)
            self.v = [None] * len(self.v)
            self.k_raw = [None] * len(self.k)
            self.capacity = 0
        self.length = length

    def fork(self) -> KVCache:
        """A cache that starts as this one and then goes its own way (beam search, repeated
        rows): the arrays are shared until either cache writes a layer, which copies that
        layer's arrays first."""
        other = copy.copy(self)
        other.k, other.v, other.k_raw = list(self.k), list(self.v), list(self.k_raw)
        self._own, other._own = [False] * len(self.k), [False] * len(self.k)
        return other

    def reserve(self, n: int) -> None:
        """Make room for ``n`` positions."""
        need = capacity_for(n)
        if need <= self.capacity:
            return
        xp, rows = self.xp, need - self.capacity

        def grown(old: Any, hd: int) -> Any:
            # an array of its own per layer: rows are written into it in place
            pad = xp.zeros((self.n_head_kv, rows, hd), dtype=xp.float32, device=self.device)
            return pad if old is None else xp.concat([old, pad], axis=1)

        self.k = [grown(k, self.head_dims[0]) for k in self.k]
        self.v = [grown(v, self.head_dims[1]) for v in self.v]
        if self.spec.quantized("k"):
            g = kv_types.CACHE_TYPES[self.spec.type_k]
            row = self.head_dims[0] // g.block[0] * g.block[1]

            def grown_raw(old: Any) -> Any:
                pad = xp.zeros((self.n_head_kv, rows, row), dtype=xp.uint8)  # d = 0: zeros
                return pad if old is None else xp.concat([old, pad], axis=1)

            self.k_raw = [grown_raw(r) for r in self.k_raw]
        self._own = [True] * len(self.k)
        self.capacity = need
        self.slots = xp.arange(need, dtype=xp.int32, device=self.device)  # (capacity,)

    @property
    def float_operands(self) -> bool:
        """Whether queries and probabilities enter the attention products as they are
        (:meth:`operand` is the identity)."""
        return not self._half_operands

    def operand(self, x: Any) -> Any:
        """A query or probability as the attention products see it: rounded to half under
        ``f16`` precision (not under ``f16-flash``)."""
        return self._stored(x) if self._half_operands else x

    def _stored(self, x: Any) -> Any:
        """``x`` as the cache holds it: rounded to half unless the precision is f32."""
        if self._half is None:
            return x
        return self.xp.astype(self.xp.astype(x, self._half), self.xp.float32)

    def update(self, layer: int, pos: int | Any, k: Any, v: Any) -> tuple[Any, Any]:
        """Write this step's ``(T, n_head_kv, head_dim)`` keys and ``(T, n_head_kv,
        head_dim_v)`` values at ``pos`` (the first row's position; or, in place, an integer
        array ``(T,)`` of the rows' positions); return the layer's whole cache, ``(n_head_kv,
        capacity, head_dim)`` and ``(n_head_kv, capacity, head_dim_v)``."""
        xp, T = self.xp, k.shape[0]
        if self.typed:
            return self._update_typed(layer, pos, k, v)
        k = xp.permute_dims(self._stored(k), (1, 0, 2))  # (n_head_kv, T, head_dim)
        v = xp.permute_dims(self._stored(v), (1, 0, 2))  # (n_head_kv, T, head_dim_v)
        if self._in_place:
            if not self._own[layer]:  # shared with a fork: copy before writing
                self.k[layer] = xp.asarray(self.k[layer], copy=True)
                self.v[layer] = xp.asarray(self.v[layer], copy=True)
                self._own[layer] = True
            # positions as an array: a compiled step's position is data, not a constant
            rows = slice(pos, pos + T) if isinstance(pos, Integral) else pos
            self.k[layer][:, rows, :] = k
            self.v[layer][:, rows, :] = v
            return self.k[layer], self.v[layer]
        if not isinstance(pos, Integral):
            raise BackendError(f"{xp.__name__} has no in-place writes: pos must be an int")
        fresh = ((self.slots >= pos) & (self.slots < pos + T))[None, :, None]  # (1, capacity, 1)
        src = xp.clip(self.slots - pos, 0, T - 1)  # row of k feeding each slot
        self.k[layer] = xp.where(fresh, xp.take(k, src, axis=1), self.k[layer])
        self.v[layer] = xp.where(fresh, xp.take(v, src, axis=1), self.v[layer])
        return self.k[layer], self.v[layer]

    def _update_typed(self, layer: int, pos: int, k: Any, v: Any) -> tuple[Any, Any]:
        """:meth:`update` for the typed caches (numpy): each token's rows rotated where
        llama.cpp rotates them, then stored as the type's ``from_float`` writes them."""
        T, n_kv = k.shape[0], self.n_head_kv
        if not self._own[layer]:  # shared with a fork: copy before writing
            self.k[layer], self.v[layer] = self.k[layer].copy(), self.v[layer].copy()
            if self.k_raw[layer] is not None:
                self.k_raw[layer] = self.k_raw[layer].copy()
            self._own[layer] = True
        for which, x, store in (("k", k, self.k), ("v", v, self.v)):
            n = self.rotation[0 if which == "k" else 1]
            x = fwht(x, n) if n else x  # (T, n_kv, hd)
            hd = x.shape[-1]
            t = self.spec.type_k if which == "k" else self.spec.type_v
            rows = x.reshape(T * n_kv, hd)  # (T*n_kv, hd)
            raw, values = kv_types.from_float(t, rows, self.rounding)
            store[layer][:, pos : pos + T, :] = values.reshape(T, n_kv, hd).transpose(1, 0, 2)
            if which == "k" and raw is not None:
                self.k_raw[layer][:, pos : pos + T, :] = raw.reshape(T, n_kv, -1).transpose(1, 0, 2)
        return self.k[layer], self.v[layer]
