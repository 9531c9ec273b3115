"""numpy: the CPU arithmetic's backend, which chooses who computes each product.

:mod:`qllama.backends.numpy.oracle` states what ggml's CPU computes and computes it plainly
(``kernels="numpy"``); the compiled kernels compute the same bits fast (``kernels="numba"``).
This module holds the backend: its options, the weights it keeps (the file's bytes) and the
choice of kernel for each product.

Options: ``activations="q8"`` (the CPU arithmetic) or ``"f32"`` (the GPU arithmetic on numpy:
float32 activations times the dequantized weight), ``activation_rounding``, ``simd_width``
and ``dequantize_all`` (weights widened to float32 once, at load; plain float32 matmuls).
``simd_width`` names the float SIMD width of the llama.cpp build the CPU arithmetic stands
for under ``activation_rounding="simd"``: 8 (AVX2, the default) or 16 (AVX-512F with DQ), the
blocks of the router's softmax (:mod:`qllama.backends.numpy.router`), or ``"host"``: the width
of a llama.cpp built natively on this CPU; under ``"ref"`` the scalar loop runs whatever the
width.

``kernels="numba"`` (the default when numba is installed) computes the ``q8`` arithmetic with the
compiled kernels of :mod:`qllama.backends.numpy.kernels.matmul`: the same float32 values, bit for
bit, from the file's bytes, many times faster; F32 weights are then multiplied as zero-copy views of
the file, in the same chunks as here (F16 and BF16 weights keep the plain path). ``kernels="numpy"``
keeps this plain path, the oracle the kernels are tested against. ``threads`` sets numba's thread
count for the kernels (default: numba's own in the calling thread at its first matmul, i.e.
``NUMBA_NUM_THREADS`` or the number of cores). ``blas_threads`` (default 1) caps BLAS's threads,
process-wide, when the kernels first run: the model's attention products go to BLAS, whose idle
threads spin-wait for work on the cores the kernels' threads need (measured on 2 cores: teacher
forcing over 337 tokens twice as fast with one BLAS thread; docs/bench.md). ``None`` leaves BLAS as
it is. It needs threadpoolctl (a dependency of qllama) and is skipped without it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import numpy as np

from qllama import quants
from qllama.array_api import namespace
from qllama.backends.array_api import ALL_TYPES, ArrayBackend, Blocks, Dense
from qllama.backends.base import (
    QuantTensor,
    check_supported,
    group_pairs,
    grouped_expert_matmul,
    require_device,
)
from qllama.backends.numpy import router
from qllama.backends.numpy.heap import keep_large_buffers
from qllama.backends.numpy.oracle import Activations, WeightBlocks, vec_dot
from qllama.errors import BackendError, TensorShapeError
from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding

F32 = np.float32

ACTIVATIONS = ("q8", "f32")
ROUNDINGS = ("ref", "simd")
KERNELS = ("numba", "numpy")
ROUTER_OPS = ("soft_max", "sum_rows", "route")  # glue ops of ggml's CPU arithmetic, not numpy's
FLOAT_DOT_TYPES = ("F32", "F16", "BF16")  # vec_dot types of the float weight formats

# ggml has no CPU vec_dot for weights stored in its activation formats
Q8_WEIGHT_TYPES = ALL_TYPES - {GGMLType.Q8_1, GGMLType.Q8_K}
# the formats the compiled kernels compute (the float ones go through BLAS either way)
KERNEL_LEGACY = frozenset(GGMLType[n] for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"))
KERNEL_KQUANTS = frozenset(GGMLType[n] for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))
KERNEL_IQ = frozenset(
    GGMLType[n]
    for n in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")
)
KERNEL_TABLES = frozenset(GGMLType[n] for n in ("IQ4_NL", "IQ4_XS", "MXFP4"))
KERNEL_SMALL = frozenset(GGMLType[n] for n in ("NVFP4", "Q1_0", "Q2_0"))
KERNEL_TYPES = KERNEL_LEGACY | KERNEL_KQUANTS | KERNEL_IQ | KERNEL_TABLES | KERNEL_SMALL
# ... of which these run in the streaming kernels, several weights in one call
STREAMING_TYPES = KERNEL_LEGACY | KERNEL_KQUANTS | KERNEL_TABLES | KERNEL_SMALL
STREAMING_TYPES |= {GGMLType.TQ1_0, GGMLType.TQ2_0}
# ... and the IQ grid formats (kernels/grid.py)
KERNEL_GRID = frozenset(
    GGMLType[n] for n in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
)
STREAMING_TYPES |= KERNEL_GRID
ONE_OFFSET = np.zeros(1, np.int64)

# Below this many multiply-adds a matmul runs on one thread (~20 us): waking a second one
# and meeting it at the end costs about as much.
SERIAL_MACS = 1 << 17


def _exporter(a: np.ndarray) -> Any:
    """The object whose buffer ``a`` views, through views of views (the file's map, for a
    file's tensors and their experts' slabs; each ``np.frombuffer`` of a memoryview has a
    memoryview of its own), or None."""
    base = a.base
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base  # a slab of an expert tensor: a view of the tensor's view
    return base.obj if isinstance(base, memoryview) else base


def _limit_blas(threads: int) -> None:
    """Cap every loaded BLAS at ``threads`` threads (process-wide; threadpoolctl if present)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(limits=threads, user_api="blas")


def kernels_available() -> bool:
    """Whether the compiled kernels can run here (numba is installed; not imported yet)."""
    return importlib.util.find_spec("numba") is not None


ORACLE_FALLBACK = (
    "numba is not installed: the numpy backend computes the CPU arithmetic with its oracle, "
    "some 30 times slower (same numbers). pip install numba (a dependency of qllama) fixes it"
)


@functools.cache
def _say_oracle_fallback() -> None:
    """Say once per process that the default kernels fell back to the oracle."""
    warnings.warn(ORACLE_FALLBACK, RuntimeWarning, stacklevel=4)


@dataclass(frozen=True)
class Packed:
    """A weight held as the file's bytes, unpacked only for the rows a call works on."""

    tensor: QuantTensor
    fmt: type[QuantType]
    # the streaming calls this weight leads: the ids of the weights after it -> their Streams
    # (None: no one call takes them). Held here, not by the backend, so that they go with the
    # model's weights, and with them the map of the file they view.
    streams: dict[tuple[int, ...], Streams | None] = field(
        default_factory=dict, compare=False, repr=False
    )

    # the expert tensors whose first slab this weight is: the ids of the tensors -> the
    # tensors, their experts in turn, and their Slabs (None: no one compiled mul_mat_id takes
    # them); held here for the reason ``streams`` is
    slabs: dict[tuple[int, ...], tuple[tuple[Any, ...], list[Any], Slabs | None]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def row_bytes(self) -> int:
        return self.tensor.row_length // self.fmt.block_size * self.fmt.type_size

    @functools.cached_property
    def kernels_exact(self) -> bool:
        """Whether the compiled kernels give the oracle's bits for this weight
        (:func:`~qllama.backends.numpy.kernels.matmul.computes_exactly`); asked in kernels
        mode only."""
        from qllama.backends.numpy.kernels import matmul

        return matmul.computes_exactly(int(self.tensor.ggml_type), self.tensor.data)

    def rows(self, index: slice | np.ndarray) -> tuple[QuantTensor, Fields]:
        """Rows ``index`` as a tensor of their own and their unpacked (mostly view) fields."""
        raw = self.tensor.data.reshape(self.tensor.rows, self.row_bytes)[index]
        part = dataclasses.replace(
            self.tensor, shape=(raw.shape[0], self.tensor.row_length), data=raw.reshape(-1)
        )
        return part, self.fmt.unpack(raw.reshape(-1, self.fmt.type_size))


@dataclass(frozen=True)
class Streams:
    """Weights that one call of a streaming kernel takes: one format, one row length, views
    of one buffer (the file's map), at byte ``offsets`` of it."""

    code: int  # the GGML type
    buffer: np.ndarray  # uint8
    offsets: np.ndarray  # int64, each weight's first byte in ``buffer``
    rows: np.ndarray  # int64, each weight's rows
    starts: np.ndarray  # int64, each weight's first row among all of them
    spans: tuple[tuple[int, int], ...]  # (start, rows) of each, as ints
    macs_per_token: int
    total_rows: int  # of all the weights

    @classmethod
    def of(cls, ws: Sequence[Any]) -> Streams | None:
        """The streams of ``ws``, or None where one call cannot take them all: another
        kind of weight, a format without streaming kernels, two formats or row lengths, or
        weights that are not views of one buffer."""
        if not all(isinstance(w, Packed) for w in ws):
            return None
        code, k = ws[0].tensor.ggml_type, ws[0].tensor.row_length
        if code not in STREAMING_TYPES or not all(w.kernels_exact for w in ws):
            return None
        rows = np.array([w.tensor.rows for w in ws], np.int64)
        starts = np.cumsum(rows) - rows
        spans = tuple(zip(starts.tolist(), rows.tolist(), strict=True))
        if len(ws) == 1:
            buffer, offsets = ws[0].tensor.data, ONE_OFFSET
        else:
            shared = _one_buffer(ws)
            if shared is None or any(
                w.tensor.ggml_type != code or w.tensor.row_length != k for w in ws
            ):
                return None
            buffer, offsets = shared
        total = int(rows.sum())
        return cls(int(code), buffer, offsets, rows, starts, spans, total * k, total)


@dataclass(frozen=True)
class Slabs:
    """A 3-D expert tensor as one compiled ``mul_mat_id`` takes it: one format and 2-D shape,
    each expert's slab at byte ``offsets[e]`` of ``buffer`` (the file's map)."""

    code: int  # the GGML type
    buffer: np.ndarray  # uint8
    offsets: np.ndarray  # int64 (n_expert,)
    rows: int  # of each expert
    row_length: int
    tile_rows: int  # an expert this many pairs chose goes to the token tiles of ``matmul``
    # the experts whose kernels_exact held: each is checked once, when first chosen (the check
    # reads its slab)
    exact: set[int] = field(default_factory=set, compare=False, repr=False)

    @classmethod
    def of(cls, experts: Sequence[Any]) -> Slabs | None:
        """The slabs of ``experts``, or None where one compiled call cannot take them: another
        kind of weight, a format without a compiled ``mul_mat_id``, two formats or shapes, or
        slabs that are not views of one buffer. Reads none of their bytes."""
        from qllama.backends.numpy.kernels import experts as kernels
        from qllama.backends.numpy.kernels import matmul

        first = experts[0]
        if not all(isinstance(w, Packed) for w in experts):
            return None
        code = int(first.tensor.ggml_type)
        if kernels.kernel(code, serial=True) is None or any(
            w.tensor.ggml_type != first.tensor.ggml_type or w.tensor.shape != first.tensor.shape
            for w in experts
        ):
            return None
        shared = _one_buffer(experts)
        if shared is None:
            return None
        buffer, offsets = shared
        tile_rows = matmul.GEMM_TOKENS[code]  # where the dense products switch to tiles
        return cls(code, buffer, offsets, first.tensor.rows, first.tensor.row_length, tile_rows)


@dataclass(frozen=True)
class Grouping:
    """One selection (T, k)'s pairs grouped by expert (:func:`~qllama.backends.base.group_pairs`),
    with what each of the layer's expert products (up, gate, down share it) reads of it."""

    order: np.ndarray  # (T*k,) int64, the pairs' flat indices expert by expert
    bounds: np.ndarray  # (n_expert + 1,) int64, expert e's pairs order[bounds[e]:bounds[e+1]]
    by_token: np.ndarray  # (T*k,) order // k: each grouped pair's token
    counts: np.ndarray  # (n_expert,) pairs an expert
    most: int  # the most pairs one expert has
    chosen: list[int]  # the experts some pair chose

    @classmethod
    def of(cls, selected: np.ndarray, n_expert: int) -> Grouping:
        """The grouping of ``selected`` (T, k) in one compiled call (the kernels' counting
        sort: :func:`~qllama.backends.base.group_pairs`'s order); an id outside
        ``[0, n_expert)`` is refused as there."""
        from qllama.backends.numpy.kernels import experts as kernels

        flat = selected.reshape(-1)  # (T*k,)
        order, by_token = np.empty(flat.size, np.int64), np.empty(flat.size, np.int64)
        bounds, counts = np.empty(n_expert + 1, np.int64), np.empty(n_expert, np.int64)
        most = kernels.group_pairs(
            flat, n_expert, order, bounds, by_token, counts, selected.shape[1]
        )
        if most < 0:
            group_pairs(selected, n_expert)  # raises, naming the ids
        return cls(order, bounds, by_token, counts, int(most), np.flatnonzero(counts).tolist())


def _one_buffer(ws: Sequence[Packed]) -> tuple[np.ndarray, np.ndarray] | None:
    """The one buffer every weight of ``ws`` is a view of, as uint8, and each weight's byte
    offset in it (int64); None where they are views of different or non-contiguous buffers."""
    base = _exporter(ws[0].tensor.data)
    if base is None or any(_exporter(w.tensor.data) is not base for w in ws):
        return None
    try:
        buffer = np.frombuffer(base, dtype=np.uint8)
    except (TypeError, ValueError, BufferError):  # not one contiguous buffer
        return None
    start = buffer.ctypes.data
    return buffer, np.array([w.tensor.data.ctypes.data - start for w in ws], np.int64)


# Attention scores of at most this many query rows per KV head (a decode step: 1-2 tokens
# times the heads sharing a KV head) are computed as (K Q^T)^T where that gives this BLAS's
# bits for Q K^T (keys_first_exact): OpenBLAS then streams the cached keys as they are
# stored, where Q K^T makes it pack all of them first. A 1B shape's 16 layers over 4352
# cached positions, keys from memory: 7.2 ms a token against 18.3 (SmolLM2 at 4096: 26 ms of
# a 47 ms token were this product). At 12 rows and more the packing pays for itself.
KEYS_FIRST_ROWS = 8


@functools.cache
def keys_first_exact() -> bool:
    """Whether ``(k @ q^T)^T`` is ``q @ k^T`` bit for bit under this process's BLAS, for up
    to :data:`KEYS_FIRST_ROWS` query rows: checked once, on sample shapes. OpenBLAS's
    AVX-512 kernels sum each score's products in the same order either way (1080 shapes of 1
    to 8 rows, head sizes 32 to 256, 7 to 4352 keys: all equal); its AVX2 (Haswell) kernels
    do not (342 of them differ), and there the scores keep ``q @ k^T``."""
    rng = np.random.default_rng(0)
    for rows, hd in itertools.product((1, 2, 3, 4, 8), (64, 80, 128, 256)):
        q = rng.standard_normal((2, rows, hd)).astype(F32)
        k = rng.standard_normal((2, 300, hd)).astype(F32)
        by_keys = np.matmul(k, q.transpose(0, 2, 1)).transpose(0, 2, 1)
        if not np.array_equal(np.matmul(q, k.transpose(0, 2, 1)), by_keys):
            return False
    return True


class NumpyBackend(ArrayBackend):
    """The CPU arithmetic (``activations="q8"``), or the GPU one on numpy (``"f32"``)."""

    name: ClassVar[str] = "numpy"
    # attention's blocks of scores stay in cache; fastest of 256 KiB ... unblocked in
    # perplexity at n_ctx 512 (SmolLM2, an AMD EPYC guest: 1.39 s a window against 1.55)
    attention_bytes: ClassVar[int] = 2 << 20

    def __init__(
        self,
        *,
        device: str | None = None,
        dequantize_all: bool = False,
        activations: str = "q8",
        activation_rounding: Rounding = "ref",
        simd_width: int | str = 8,
        work_bytes: int = 64 << 20,
        kernels: str | None = None,
        threads: int | None = None,
        blas_threads: int | None = 1,
        **options: Any,
    ) -> None:
        if options:
            raise BackendError(
                f"backend numpy has no options {sorted(options)}; it takes activations, "
                "activation_rounding, simd_width, work_bytes, kernels, threads and blas_threads"
            )
        if kernels is None:
            kernels = "numba" if kernels_available() else "numpy"
            if kernels == "numpy":
                _say_oracle_fallback()
        if kernels not in KERNELS:
            raise BackendError(f"backend numpy: kernels must be one of {KERNELS}, not {kernels!r}")
        if kernels == "numba" and not kernels_available():
            raise BackendError(
                "backend numpy: kernels='numba' needs numba; install it with "
                "pip install numba, or use kernels='numpy'"
            )
        for option, value in (("threads", threads), ("blas_threads", blas_threads)):
            if value is not None and value < 1:
                raise BackendError(f"backend numpy: {option} must be at least 1, not {value}")
        if activations not in ACTIVATIONS:
            raise BackendError(
                f"backend numpy: activations must be one of {ACTIVATIONS}, not {activations!r}"
            )
        if activation_rounding not in ROUNDINGS:
            raise BackendError(
                f"backend numpy: activation_rounding must be one of {ROUNDINGS}, "
                f"not {activation_rounding!r}"
            )
        # "host": what a llama.cpp built natively on this CPU would use
        width = router.host_width() if simd_width == "host" else simd_width
        if not isinstance(width, int) or width not in router.SIMD:
            raise BackendError(
                f"backend numpy: simd_width must be one of {tuple(router.SIMD)} (a llama.cpp "
                f"build's float lanes: 8 AVX2, 16 AVX-512) or 'host', not {simd_width!r}"
            )
        if work_bytes < 1:
            raise BackendError(f"backend numpy: work_bytes must be positive, not {work_bytes}")
        super().__init__(
            namespace("numpy"),
            device=require_device(self.name, device, ("cpu",)),
            dequantize_all=dequantize_all,
        )
        self.activations = activations
        self.activation_rounding = activation_rounding
        self.simd_width = width
        self.work_bytes = work_bytes
        self.kernels = kernels
        self.threads = threads
        self.blas_threads = blas_threads
        self._blas_limited = False
        self._kernel_state: tuple[int, Any, int] | None = None  # thread id, module, threads
        # the last selection's grouping (:meth:`_grouped`): its key, then the grouping
        self._grouping: tuple[tuple[Any, ...], Grouping] | None = None
        keep_large_buffers()  # a forward pass's temporaries reused, not faulted in anew

    def describe(self) -> str:
        """The arithmetic, and what computes it: the compiled kernels and their threads, or
        the oracle (BLAS for what is float)."""
        if self.kernels == "numba":
            import numba

            how = f"numba kernels, {self.threads or numba.get_num_threads()} threads"
        else:
            how = "the numpy oracle, 1 thread"
        if self._q8:
            return (
                f"numpy, cpu arithmetic (activations quantized to each weight's vec_dot_type, "
                f"integer dot products; {how})"
            )
        return f"{super().describe()}; {how}"

    @property
    def weight_types(self) -> frozenset[GGMLType]:
        """The types ``prepare`` accepts in this mode (a declared table)."""
        return Q8_WEIGHT_TYPES if self._q8 else ALL_TYPES

    @property
    def _q8(self) -> bool:
        return self.activations == "q8" and not self.dequantize_all

    # -- protocol ------------------------------------------------------------------------------

    def supports(self, ggml_type: GGMLType) -> bool:
        return ggml_type in self.weight_types

    # Packed where ArrayBackend has Blocks: this backend keeps the file's bytes and unpacks
    # only the rows a call works on (the others unpack whole tensors at prepare)
    def prepare(self, tensor: QuantTensor) -> Packed | Dense:  # type: ignore[override]
        if self.dequantize_all:
            dense = super().prepare(tensor)
            assert isinstance(dense, Dense)
            return dense
        check_supported(self, tensor, self.weight_types)
        return Packed(tensor, quants.get(tensor.ggml_type))

    def matmul(self, x: Any, w: Packed | Dense) -> Any:  # type: ignore[override]
        if isinstance(w, Dense):
            return super().matmul(x, w)
        x = np.asarray(x, dtype=F32)
        if x.ndim != 2 or x.shape[1] != w.tensor.row_length:
            raise TensorShapeError(
                f"matmul with '{w.tensor.name}' {w.tensor.shape} needs activations "
                f"(T, {w.tensor.row_length}), got {x.shape}"
            )
        if self.activations == "f32":
            return self._matmul_f32(x, w)
        return self._matmul_q8(x, w)

    def attention_scores(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        """``q @ k^T`` per KV head (:func:`~qllama.backends.base.attention_scores`), for a
        decode step's few query rows as ``(k @ q^T)^T`` where those are the same bits
        (:data:`KEYS_FIRST_ROWS`)."""
        if q.shape[1] > KEYS_FIRST_ROWS or not keys_first_exact():
            return np.matmul(q, k.transpose(0, 2, 1))
        # C order: the softmax's sums then run along contiguous rows, as they did before
        return np.ascontiguousarray(np.matmul(k, q.transpose(0, 2, 1)).transpose(0, 2, 1))

    def glue(self, op: str) -> Callable[..., Any] | None:
        """This backend's form of the model's glue op ``op`` (:func:`~qllama.backends.base.glue`):
        in the CPU arithmetic the router's ops as ggml's CPU computes them (compiled with the
        kernels, numpy code without); the compiled form of the others with the numba kernels, where
        they give this numpy's bits (``glue_exact``); else None."""
        if op in ROUTER_OPS:
            return self._router_ops().get(op)
        if self.kernels != "numba":
            return None
        from qllama.backends.numpy import glue

        if not glue.glue_exact():
            return None
        if op in glue.WITH_BACKEND:
            return functools.partial(glue.WITH_BACKEND[op], self)
        return glue.OPS.get(op)

    def _router_ops(self) -> dict[str, Callable[..., Any]]:
        """ggml's CPU ``soft_max`` (its scalar loop under ``activation_rounding="ref"``, the
        ``simd_width`` build's blocks under ``"simd"``) and ``sum_rows``, in the CPU
        arithmetic, and with the compiled kernels ``route``, a layer's routing in one call;
        none in the others (the model's array-API forms)."""
        if not self._q8:
            return {}
        simd = self.activation_rounding == "simd"
        soft_max: Callable[..., np.ndarray] = router.soft_max
        sum_rows: Callable[[np.ndarray], np.ndarray] = router.sum_rows
        compiled: dict[str, Callable[..., Any]] = {}
        if self.kernels == "numba":  # the same bits in one compiled call each
            from qllama.backends.numpy import glue

            soft_max, sum_rows = glue.router_soft_max, glue.router_sum_rows
            compiled["route"] = functools.partial(
                glue.router_route, simd=simd, width=self.simd_width
            )
        return {
            "soft_max": functools.partial(soft_max, simd=simd, width=self.simd_width),
            "sum_rows": sum_rows,
            **compiled,
        }

    def embedding(self, ids: Any, w: Packed | Dense) -> Any:  # type: ignore[override]
        if isinstance(w, Dense):
            return super().embedding(ids, w)
        # ggml's get_rows: only the wanted rows, unpacked and dequantized (inherited code)
        ids = np.asarray(ids)
        part, fields = w.rows(ids)
        return super().embedding(np.arange(ids.shape[0]), Blocks(part, w.fmt, fields))

    # -- the arithmetic ------------------------------------------------------------------------

    def _matmul_f32(self, x: np.ndarray, w: Packed) -> np.ndarray:
        """The GPU arithmetic, a chunk of dequantized rows at a time."""
        out = np.empty((x.shape[0], w.tensor.rows), dtype=F32)
        # dequantize_fields makes a few float32 temporaries of the chunk
        for rows in self._row_chunks(w, per_row=16 * w.tensor.row_length + 8 * x.shape[0]):
            part, fields = w.rows(rows)
            out[:, rows] = super().matmul(x, Blocks(part, w.fmt, fields))
        return out

    def _matmul_q8(self, x: np.ndarray, w: Packed) -> np.ndarray:
        """ggml's CPU matmul: quantize the activations once, then ``vec_dot`` by chunks."""
        if self.kernels == "numba":
            if w.tensor.ggml_type in KERNEL_TYPES and w.kernels_exact:
                return self._matmul_kernels(x, w)
            if w.tensor.ggml_type == GGMLType.F32:
                return self._matmul_f32_view(x, w)
        act_type = quants.get(w.fmt.vec_dot_type)
        # F16 / BF16 activations round one way only; Q8_K's "simd" is its "ref" anyway
        rounding: Rounding = self.activation_rounding if len(act_type.roundings) > 1 else "ref"
        raw = quants.quantize(x, act_type.ggml_type, rounding=rounding)
        act_fields = act_type.unpack(raw.reshape(-1, act_type.type_size))
        tokens, k = x.shape
        out = np.empty((tokens, w.tensor.rows), dtype=F32)
        if w.fmt.vec_dot_type in FLOAT_DOT_TYPES:
            # float weights: products of two halves are exact in float32; only the order of
            # the float32 sum differs from ggml's SIMD accumulators
            xr = act_type.dequantize_fields(act_fields, xp=self.xp).reshape(tokens, k)
            for rows in self._row_chunks(w, per_row=16 * k + 8 * tokens):
                part, fields = w.rows(rows)
                wr = w.fmt.dequantize_fields(fields, xp=self.xp).reshape(part.shape)
                out[:, rows] = np.matmul(xr, wr.T)
            return out

        acts: Activations | None = None
        # Working set per weight row: its unpacked integers and float32 layout (~16 bytes an
        # element), and per token the block sums, 8 lane accumulators and a few temporaries.
        per_token = 4 * (2 * 8 + 6)
        token_step = max(1, min(tokens, self.work_bytes // (64 * per_token)))
        for rows in self._row_chunks(w, per_row=16 * k + per_token * token_step):
            part, fields = w.rows(rows)
            form = w.fmt.integer_form(fields)
            if acts is None:
                acts = Activations.of(act_fields, x.shape, form)
            wb = WeightBlocks.of(form, part.rows)
            for t0 in range(0, tokens, token_step):
                t = slice(t0, min(tokens, t0 + token_step))
                out[t, rows] = vec_dot(acts, wb, t)
        return out

    def _matmul_kernels(self, x: np.ndarray, w: Packed) -> np.ndarray:
        """The same numbers as :meth:`_matmul_q8`'s integer path, from compiled kernels."""
        streams = self._streams((w,))
        if streams is None:  # a format of the loops of kernels/matmul.py
            return self._loops(np.ascontiguousarray(x, dtype=F32), (w,))[0]
        return self._stream(x, (w,), streams)[0]

    def matmuls(self, x: Any, ws: Sequence[Packed | Dense]) -> tuple[Any, ...]:
        """``x @ W.T`` for each of ``ws``, the same numbers as :meth:`matmul` on each: one
        kernel call where the streaming kernels compute them all (one format, one file), so
        that a layer's Q, K and V (or gate and up) cost one dispatch."""
        streams = self._streams(ws) if self.kernels == "numba" and self._q8 else None
        if streams is None:
            return tuple(self.matmul(x, w) for w in ws)
        x = np.asarray(x, dtype=F32)
        if x.ndim != 2 or x.shape[1] != ws[0].tensor.row_length:
            raise TensorShapeError(
                f"matmul with '{ws[0].tensor.name}' {ws[0].tensor.shape} needs activations "
                f"(T, {ws[0].tensor.row_length}), got {x.shape}"
            )
        return self._stream(x, cast(Sequence[Packed], ws), streams)  # Streams: all Packed

    def expert_matmul(self, x: Any, experts: Sequence[Packed | Dense], selected: Any) -> Any:
        """ggml's ``mul_mat_id`` (:func:`~qllama.backends.base.expert_matmul`), ``(T, k,
        rows)``: :meth:`expert_matmuls` of one expert tensor."""
        return self.expert_matmuls(x, [experts], selected)[0]

    def expert_matmuls(
        self, x: Any, tensors: Sequence[Sequence[Packed | Dense]], selected: Any
    ) -> tuple[Any, ...]:
        """:func:`~qllama.backends.base.expert_matmuls`, ``(T, k, rows)`` each: in the CPU
        arithmetic with the compiled kernels, one call
        (:mod:`~qllama.backends.numpy.kernels.experts`) for all the tensors (up and gate,
        views of one file's map), which quantizes each row of ``x`` once and reads only the
        selected experts' rows; but an expert that as many pairs chose as the dense products
        meet in token tiles (``Slabs.tile_rows``: a batch) meets them there, in one
        ``matmuls`` call for all the tensors (its rows quantized once). Else (another mode, a
        format without that call, tensors one call cannot take, a selected Q8_0 expert the
        kernels do not compute exactly) each tensor by itself, or one ``matmul`` per
        selected expert. The same numbers every way: under the CPU arithmetic a row's
        product does not depend on the other rows of its call."""
        n = len(tensors)
        if self.kernels != "numba" or not self._q8:
            return self._apart(x, tensors, selected)
        experts, slabs = self._slabs(tensors)  # the experts tensor by tensor
        if slabs is None:
            return self._apart(x, tensors, selected)
        g = self._grouped(selected, len(tensors[0]))
        if not self._exact(slabs, experts, g.chosen, n):
            return self._apart(x, tensors, selected)
        T, k = selected.shape
        x = np.ascontiguousarray(x, dtype=F32)
        if x.shape[-1] != slabs.row_length or x.shape[:-1] not in ((T,), (T, k)):
            raise TensorShapeError(
                f"expert_matmul with '{experts[0].tensor.name}' needs activations "
                f"({T}, {slabs.row_length}) or ({T}, {k}, {slabs.row_length}), got {x.shape}"
            )
        x2 = x.reshape(-1, slabs.row_length)  # (T or T*k, K): each token's or pair's row
        src = g.order if x.ndim == 3 else g.by_token  # the row of x2 of each grouped pair
        P = T * k
        if g.most < slabs.tile_rows:  # each pair's products straight to its row j
            out = np.empty((n * P, slabs.rows), F32)  # (n*P, rows): tensor by tensor
            self._mul_mat_id(slabs, x2, src, g.order, g.bounds, out)
            return tuple(out[i * P : (i + 1) * P].reshape(T, k, slabs.rows) for i in range(n))
        # a batch: an expert many pairs chose meets them in token tiles, on its pairs' rows
        # gathered (grouped order: a slice an expert); then every row to its pair's place
        counts, bounds = g.counts, g.bounds
        tiled = counts >= slabs.tile_rows  # (n_expert,)
        grouped = np.empty((n * P, slabs.rows), F32)  # (n*P, rows), each tensor grouped
        xg = x2[src]  # (P, K), grouped
        for e in np.flatnonzero(tiled).tolist():
            a, b = bounds[e], bounds[e + 1]
            ys = self.matmuls(xg[a:b], [t[e] for t in tensors])  # its rows quantized once
            for i, y in enumerate(ys):
                grouped[i * P + a : i * P + b] = y  # (b - a, rows)
        few = np.repeat(~tiled, counts)  # the other experts' pairs, still grouped
        if few.any():
            fewer = np.concatenate([[0], np.cumsum(np.where(tiled, 0, counts))])
            self._mul_mat_id(slabs, x2, src[few], np.flatnonzero(few), fewer, grouped)
        out = np.empty((n, P, slabs.rows), F32)
        out[:, g.order] = grouped.reshape(n, P, slabs.rows)  # token-major, slot-minor
        return tuple(out[i].reshape(T, k, slabs.rows) for i in range(n))

    def _apart(
        self, x: Any, tensors: Sequence[Sequence[Packed | Dense]], selected: Any
    ) -> tuple[Any, ...]:
        """:meth:`expert_matmuls` where one compiled call cannot take the tensors together:
        each tensor by itself (a call of its own, where one takes it), or, for one tensor,
        one ``matmul`` per selected expert."""
        if len(tensors) > 1:
            return tuple(self.expert_matmul(x, t, selected) for t in tensors)
        return (grouped_expert_matmul(self, x, tensors[0], selected),)

    def _exact(self, slabs: Slabs, experts: Sequence[Any], chosen: list[int], n: int) -> bool:
        """Whether the kernels give the oracle's bits for each expert ``chosen`` of each of
        the ``n`` tensors whose experts ``experts`` holds in turn, each checked once, when
        first chosen (the check reads its slab)."""
        n_expert = len(experts) // n
        every = [i * n_expert + e for i in range(n) for e in chosen]
        if slabs.exact.issuperset(every):
            return True
        if not all(cast(Packed, experts[e]).kernels_exact for e in every):
            return False
        slabs.exact.update(every)
        return True

    def _mul_mat_id(
        self,
        slabs: Slabs,
        x2: np.ndarray,
        src: np.ndarray,
        order: np.ndarray,
        bounds: np.ndarray,
        out: np.ndarray,
    ) -> None:
        """The compiled ``mul_mat_id`` of :meth:`expert_matmuls`: expert ``e``'s pairs
        ``bounds[e]:bounds[e + 1]``, rows ``src`` of ``x2``, into rows ``order`` of ``out``;
        where ``slabs`` holds several tensors' experts (:meth:`expert_matmuls`), each
        tensor's into its own block of rows of ``out``, in turn."""
        from qllama.backends.numpy.kernels import experts as kernels

        _, threads = self._kernels_for_this_thread()
        serial = threads == 1 or order.size * slabs.row_length * slabs.rows < SERIAL_MACS
        kernel = kernels.kernel(slabs.code, serial=serial)
        assert kernel is not None  # Slabs.of took only formats with a kernel
        simd = self.activation_rounding == "simd"
        flat = out.reshape(-1)  # (P*rows,)
        kernel(slabs.buffer, slabs.offsets, slabs.rows, x2, src, order, bounds, simd, threads, flat)
        self._limit_blas_once()

    def _grouped(self, selected: Any, n_expert: int) -> Grouping:
        """The :class:`Grouping` of ``selected``, remembered for the next call with the same
        selection (a layer's up, gate and down products share one)."""
        sel = np.asarray(selected)
        key = (n_expert, sel.shape, sel.dtype.str, sel.tobytes())
        memo = self._grouping
        if memo is not None and memo[0] == key:
            return memo[1]
        grouping = Grouping.of(sel, n_expert)
        self._grouping = (key, grouping)
        return grouping

    def _slabs(self, tensors: Sequence[Sequence[Any]]) -> tuple[list[Any], Slabs | None]:
        """The experts of ``tensors``, tensor by tensor, and what one compiled ``mul_mat_id``
        needs for them (None where one call cannot take them): remembered by the first
        expert, for the same tensors (a layer's are, at every step)."""
        first = tensors[0][0]
        if not isinstance(first, Packed):
            return [e for t in tensors for e in t], None
        known = first.slabs.get(key := tuple(map(id, tensors)))
        if known is None or any(a is not b for a, b in zip(known[0], tensors, strict=True)):
            experts = [e for t in tensors for e in t]
            known = first.slabs[key] = (tuple(tensors), experts, Slabs.of(experts))
        return known[1], known[2]

    def _streams(self, ws: Sequence[Any]) -> Streams | None:
        """What one streaming call needs for ``ws`` (remembered by the first of them), or
        None where one call cannot take them all."""
        if not isinstance(ws[0], Packed):
            return None
        known, key = ws[0].streams, tuple(map(id, ws[1:]))
        if key not in known:
            known[key] = Streams.of(ws)
        return known[key]

    def _stream(self, x: np.ndarray, ws: Sequence[Packed], s: Streams) -> tuple[np.ndarray, ...]:
        """The streaming kernel on the weights ``ws`` (their Streams ``s``): one (T, rows_i)
        array each."""
        ck, threads = self._kernels_for_this_thread()
        x = np.ascontiguousarray(x, dtype=F32)
        tokens = x.shape[0]
        serial = threads == 1 or tokens * s.macs_per_token < SERIAL_MACS
        stream = ck.streaming(s.code, tokens, serial=serial)
        if stream is None:  # this many tokens go to the loops of kernels/matmul.py
            return self._loops(x, ws)
        flat = np.empty(tokens * s.total_rows, F32)
        simd = self.activation_rounding == "simd"
        outs_at = s.starts if tokens == 1 else tokens * s.starts  # a decode step's, as they are
        stream(s.buffer, s.offsets, s.rows, x, simd, threads, flat, outs_at)
        self._limit_blas_once()
        if len(s.spans) == 1:
            return (flat.reshape(tokens, s.total_rows),)
        return tuple(
            flat[tokens * a : tokens * (a + r)].reshape(tokens, r) for a, r in s.spans
        )  # (tokens, rows_i) each

    def _loops(self, x: np.ndarray, ws: Sequence[Packed]) -> tuple[np.ndarray, ...]:
        """The loops of kernels/matmul.py (the IQ and table formats), a call per weight."""
        ck, threads = self._kernels_for_this_thread()
        simd = self.activation_rounding == "simd"
        outs = []
        for w in ws:
            serial = threads == 1 or x.size * w.tensor.rows < SERIAL_MACS
            kernel = ck.kernel(int(w.tensor.ggml_type), serial=serial)
            outs.append(kernel(w.tensor.data, w.tensor.rows, x, simd, threads))
        self._limit_blas_once()
        return tuple(outs)

    def _limit_blas_once(self) -> None:
        if not self._blas_limited:  # after the first call, which loads the last BLAS (scipy's)
            self._blas_limited = True
            if self.blas_threads is not None:
                _limit_blas(self.blas_threads)

    def _kernels_for_this_thread(self) -> tuple[Any, int]:
        """The kernels module and numba's thread count in the calling thread (numba keeps
        one per thread), set from ``threads`` on the first call there; a few microseconds
        saved on each of a decode step's 200 matmuls."""
        ident = threading.get_ident()
        if self._kernel_state is None or self._kernel_state[0] != ident:
            import numba

            from qllama.backends.numpy.kernels import matmul

            if self.threads is not None:
                numba.set_num_threads(self.threads)
            self._kernel_state = (ident, matmul, numba.get_num_threads())
        return self._kernel_state[1], self._kernel_state[2]

    def _matmul_f32_view(self, x: np.ndarray, w: Packed) -> np.ndarray:
        """F32 weights: the oracle's BLAS products, on a view of the file instead of a copy.

        Same activations (F32 "quantization" copies bits), same row chunks, same shapes: the
        same BLAS calls as the plain path.
        """
        tokens, k = x.shape
        view = w.tensor.data.view("<f4").reshape(w.tensor.shape)
        out = np.empty((tokens, w.tensor.rows), dtype=F32)
        for rows in self._row_chunks(w, per_row=16 * k + 8 * tokens):
            out[:, rows] = np.matmul(x, view[rows].T)
        return out

    def _row_chunks(self, w: Packed, *, per_row: int) -> list[slice]:
        """Slices of weight rows whose working set stays near ``work_bytes``."""
        step = max(1, self.work_bytes // max(1, per_row))
        return [slice(r, min(r + step, w.tensor.rows)) for r in range(0, w.tensor.rows, step)]
