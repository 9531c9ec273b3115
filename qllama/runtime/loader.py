"""``qllama.load``: a GGUF file -> a checked, ready model on a backend.

Everything about the file is checked before a backend sees a byte of it: the configuration
(:mod:`qllama.runtime.config`, per architecture), every tensor's presence, type and shape against
the architecture's declaration (:mod:`qllama.runtime.architectures`; a tensor it would not use is
refused), the vocabulary against the embedding, and (by default) that no block scale or norm weight
is NaN or infinite.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from qllama import quants
from qllama.backends import get_backend
from qllama.backends.base import Backend, QuantTensor
from qllama.errors import BackendError, ModelConfigError, TensorShapeError, WeightValueError
from qllama.gguf.overlay import overlay
from qllama.gguf.reader import GGUFFile, TensorInfo, read_gguf
from qllama.runtime.architectures import Tensor
from qllama.runtime.arithmetic import policy_backend
from qllama.runtime.config import ModelConfig
from qllama.runtime.model import LayerWeights, Model, Weights

FLOAT_1D_TYPES = ("F32", "F16", "BF16")  # norms, biases and rope_freqs are never quantized


def is_vector(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor is a float array of the forward pass (a norm, a bias, RoPE factors, a
    shared expert's gate vector), not a weight a backend multiplies with."""
    return len(shape) == 1 or name.endswith(".bias")


def is_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor is a weight of products (2-D, or 3-D: one 2-D slice per expert)."""
    return not is_vector(name, shape)


def expected_tensors(c: ModelConfig, *, fused_qkv: bool = False) -> dict[str, Tensor]:
    """Every tensor the model may use, by name, as the architecture declares it."""
    return {t.name: t for t in c.features.tensors(c, fused_qkv=fused_qkv)}


def check_tensors(f: GGUFFile, c: ModelConfig) -> dict[str, TensorInfo]:
    """Presence, shape and supported type of every tensor the architecture uses, and no
    other tensor in the file (before any allocation)."""
    a = c.features
    fused = a.fused_qkv if a.fused_qkv is not None else "blk.0.attn_qkv.weight" in f.tensors
    expected = expected_tensors(c, fused_qkv=fused)
    found: dict[str, TensorInfo] = {}
    for name, spec in expected.items():
        t = f.tensors.get(name)
        if t is None:
            if spec.required:
                raise ModelConfigError(f"missing tensor '{name}'")
            continue
        shape = spec.shape(c)
        if t.shape != shape:
            # ggml's shapes are padded with 1s: the converter writes qwen2moe's shared-expert
            # gate {n_embd} as [n_embd, 1] (numpy (1, n_embd)), which llama.cpp loads as {n_embd}
            padded = (1,) * (len(t.shape) - len(shape)) + shape
            if t.shape != padded:
                raise TensorShapeError(
                    f"tensor '{name}' has shape {list(t.shape)}, expected {list(shape)}"
                )
            t = dataclasses.replace(t, ne=tuple(reversed(shape)))
        if is_vector(name, shape) and t.ggml_type.name not in FLOAT_1D_TYPES:
            raise TensorShapeError(
                f"tensor '{name}' is {t.ggml_type.name}; norm weights must be F32, F16 or BF16"
            )
        quants.get(t.ggml_type)  # refuse types qllama cannot compute with, naming them
        found[name] = t
    # a tensor the model would not use means a feature qllama does not compute (LongRoPE
    # factors, experts, a fused tensor in the wrong form): refused, never run without it
    extra = [name for name in f.tensors if name not in expected]
    if extra:
        shown = ", ".join(f"'{n}'" for n in extra[:5]) + (", ..." if len(extra) > 5 else "")
        raise ModelConfigError(
            f"{len(extra)} tensor(s) of the file are not used by the {c.arch} model: {shown}; "
            "qllama refuses a file it would not compute in full"
        )
    return found


def _field(name: str) -> str:
    """The :class:`LayerWeights` / :class:`Weights` field of a tensor: ``blk.3.attn_q.bias``
    -> ``attn_q_bias``, ``output.weight`` -> ``output``."""
    base = name.split(".", 2)[-1] if name.startswith("blk.") else name
    stem, _, kind = base.rpartition(".")
    return stem if kind == "weight" else f"{stem}_{kind}"


def _scale_fields(fields: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The float fields of unpacked blocks (scales, mins, or the values of float types)."""
    return [v for v in fields.values() if v.dtype.kind == "f"]


# bytes of a weight checked at a time (a buffer of this size, reused)
CHECK_CHUNK = 8 << 20


def _checked_parts(f: GGUFFile, t: TensorInfo) -> Iterator[tuple[int, np.ndarray, tuple[int, ...]]]:
    """A tensor's bytes for :func:`check_finite`, in parts: (its first block's index, its
    bytes, its shape). A 1-D tensor is one part, a view of the map (a norm: the model reads
    it at load); a weight is read from the file a chunk of rows at a time, so that the check
    leaves the map's pages untouched. A run then makes resident what it reads when it reads
    it: a mixture's experts no token selects never (its peak RSS stays what it touched), and
    a dense weight not before the kernels have loaded, whose LLVM working memory would
    otherwise sit on top of every weight at the peak of the load (docs/footprint.md)."""
    if len(t.shape) == 1:
        yield 0, f.tensor_data(t.name), t.shape
        return
    *lead, row_length = t.shape
    total = math.prod(lead)  # rows, of all the experts' slabs together for a 3-D tensor
    row_bytes = t.nbytes // total
    blocks_per_row = row_bytes // t.ggml_type.block.type_size
    step = max(1, CHECK_CHUNK // row_bytes)
    buf = np.empty(min(step, total) * row_bytes, np.uint8)
    for r0 in range(0, total, step):
        m = min(step, total - r0)
        part = buf[: m * row_bytes]
        f.read_tensor(t.name, r0 * row_bytes, part)
        yield r0 * blocks_per_row, part, (m, row_length)


def check_finite(f: GGUFFile, tensors: dict[str, TensorInfo]) -> None:
    """Refuse NaN or infinite block scales, mins and float weights: one such value turns a
    whole row of logits into NaN."""
    for name, t in tensors.items():
        first, count = -1, 0
        for block0, data, shape in _checked_parts(f, t):
            for v in _scale_fields(quants.unpack(data, t.ggml_type, shape)):
                bad = np.flatnonzero(~np.isfinite(v).all(axis=tuple(range(1, v.ndim))))
                if bad.size:
                    first = block0 + int(bad[0]) if first < 0 else first
                    count += bad.size
                    break  # a block is counted once, whichever of its fields is bad
        if count:
            raise WeightValueError(
                f"tensor '{name}' block {first} has a non-finite scale or value "
                f"({count} blocks in all)"
            )


def _norm(f: GGUFFile, t: TensorInfo, backend: Backend) -> Any:
    return backend.asarray(quants.dequantize(f.tensor_data(t.name), t.ggml_type, t.shape))


def load(
    path: str | os.PathLike[str],
    backend: str | Backend | None = None,
    device: str | None = None,
    dequantize_all: bool | None = None,
    *,
    n_ctx: int | None = None,
    kv_precision: str = "f32",
    check_weights: bool = True,
    trace_nonfinite: bool = False,
    arithmetic: Mapping[str, str] | str | None = None,
    weights_from: Mapping[str, Any] | None = None,
    **backend_options: Any,
) -> Model:
    """Load a GGUF file of any supported architecture on a backend.

    ``backend``, ``device`` and ``dequantize_all`` default to ``QLLAMA_BACKEND``,
    ``QLLAMA_DEVICE`` and ``QLLAMA_DEQUANTIZE_ALL`` (numpy, its default device, off).
    ``n_ctx`` caps the context (default: the model's). ``kv_precision="f16"`` emulates
    llama.cpp's half-precision KV cache; ``"q8_0/q4_0,fa"`` its ``-ctk q8_0 -ctv q4_0 -fa on``
    (:mod:`qllama.runtime.kv_types`). ``check_weights`` refuses NaN/inf block scales and
    float weights at load; ``trace_nonfinite`` checks every layer's output in the forward pass
    and names the first that is NaN or infinite (slower). Extra keywords go to the backend
    (e.g. the numpy backend's ``activations="f32"`` or ``activation_rounding="simd"``).
    ``arithmetic`` maps tensor-name patterns to an arithmetic per weight ("q8", "f32",
    "dequantized"; :mod:`qllama.runtime.arithmetic`); ``weights_from`` maps patterns to other files
    whose tensors replace the matching ones (:mod:`qllama.gguf.overlay`).
    """
    f = read_gguf(path)
    try:
        if weights_from is not None:
            f = overlay(f, weights_from)
        return _build(
            f,
            backend,
            device,
            dequantize_all,
            n_ctx=n_ctx,
            kv_precision=kv_precision,
            check_weights=check_weights,
            trace_nonfinite=trace_nonfinite,
            arithmetic=arithmetic,
            **backend_options,
        )
    except BaseException:
        f.close()  # all or nothing: a refused file leaves no map open
        raise


# the devices a backend may name (each backend says at load which of them it has here)
DEVICE_KINDS = ("cpu", "cuda", "mps", "gpu")


def check_options(backend: str, options: Mapping[str, Any]) -> None:
    """Refuse, without a file, what ``load(path, backend=backend, **options)`` would refuse
    about the options: an unknown backend or option, a value out of its range, a device that
    is no kind of device. (Whether the device exists is the machine's business, checked at
    load.) A backend whose package is not installed here has its own options checked where
    it runs."""
    from qllama.backends import BUILTIN, available
    from qllama.runtime import kv_types
    from qllama.runtime.arithmetic import as_policy

    if backend not in available():
        raise BackendError(f"unknown backend {backend!r}; available: {', '.join(available())}")
    opts = dict(options)
    device = opts.pop("device", None)
    if device is not None and str(device).split(":")[0] not in DEVICE_KINDS:
        raise BackendError(f"device {device!r} is none of {', '.join(DEVICE_KINDS)}")
    kv_types.parse(opts.pop("kv_precision", "f32"))
    n_ctx = opts.pop("n_ctx", None)
    if n_ctx is not None and (not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx < 1):
        raise BackendError(f"n_ctx must be a positive integer, not {n_ctx!r}")
    for flag in ("dequantize_all", "check_weights", "trace_nonfinite"):
        if not isinstance(opts.get(flag, False), bool):
            raise BackendError(f"{flag} must be true or false, not {opts[flag]!r}")
    for name in ("check_weights", "trace_nonfinite", "weights_from"):
        opts.pop(name, None)
    package = BUILTIN.get(backend, ("", backend))[1]
    if importlib.util.find_spec(package) is None:
        return
    policy = opts.pop("arithmetic", None)
    if policy is not None:  # its backends are built per tensor at load; here, one of each
        rules = as_policy(policy)
        for arithmetic in dict.fromkeys(rules.values()):
            policy_backend(backend, {"*": arithmetic}, ["w"], **opts)
        return
    get_backend(backend, **opts)


def _build(
    f: GGUFFile,
    backend: str | Backend | None,
    device: str | None,
    dequantize_all: bool | None,
    *,
    n_ctx: int | None,
    kv_precision: str,
    check_weights: bool,
    trace_nonfinite: bool,
    arithmetic: Mapping[str, str] | str | None = None,
    **backend_options: Any,
) -> Model:
    """:func:`load` on an open file: every check, then the backend, then the model."""
    from qllama.runtime import kv_types
    from qllama.runtime.chat_template import ChatTemplate
    from qllama.runtime.tokenizer import Tokenizer

    config = ModelConfig.from_gguf(f)
    kv_types.check_geometry(kv_types.parse(kv_precision), config.head_dim, config.head_dim_v)
    if n_ctx is not None and not 1 <= n_ctx:
        raise ModelConfigError(f"n_ctx must be at least 1, not {n_ctx}")
    if n_ctx is not None and n_ctx > config.n_ctx:
        # as llama.cpp: allowed (RoPE scaling may extend a model), but worth a warning
        warnings.warn(
            f"n_ctx {n_ctx} is longer than the {config.n_ctx} positions the model was trained for",
            stacklevel=3,
        )
    tensors = check_tensors(f, config)
    if check_weights:
        check_finite(f, tensors)
    tokenizer = Tokenizer.from_gguf(f)
    if tokenizer.n_vocab != config.n_vocab:
        raise TensorShapeError(
            f"the vocabulary has {tokenizer.n_vocab} tokens but token_embd.weight has "
            f"{config.n_vocab} rows"
        )
    if arithmetic is not None:  # a backend per arithmetic, each weight routed at prepare
        weights_2d = [name for name, t in tensors.items() if is_weight(name, t.shape)]
        be: Backend = policy_backend(
            backend,
            arithmetic,
            weights_2d,
            device=device,
            dequantize_all=dequantize_all,
            **backend_options,
        )
    elif not isinstance(backend, str | None):
        be = backend
    else:
        be = get_backend(backend, device=device, dequantize_all=dequantize_all, **backend_options)

    def prepared(name: str) -> Any:
        t = tensors[name]
        data = f.tensor_data(name)
        if len(t.shape) == 2:
            return be.prepare(QuantTensor(name, t.ggml_type, (t.shape[0], t.shape[1]), data))
        # a 3-D expert tensor (n_expert, rows, row_length): each expert's slab by itself,
        # a view of the file's bytes, under the tensor's name (the arithmetic policy's key)
        n, rows, row_length = t.shape
        slab = data.shape[0] // n
        return tuple(
            be.prepare(
                QuantTensor(name, t.ggml_type, (rows, row_length), data[e * slab : (e + 1) * slab])
            )
            for e in range(n)
        )

    def value(name: str) -> Any:
        t = tensors[name]
        return _norm(f, t, be) if is_vector(name, t.shape) else prepared(name)

    # the field each tensor fills: the one its name says, unless the declaration names another
    fields = {t.name: t.field for t in expected_tensors(config).values() if t.field}
    parts: list[dict[str, Any]] = [{} for _ in range(config.n_layer)]
    top: dict[str, Any] = {}
    for name in tensors:
        field = fields.get(name) or _field(name)
        if name.startswith("blk."):
            parts[int(name.split(".")[1])][field] = value(name)
        else:
            top[field] = value(name)
    top.setdefault("output", top["token_embd"])  # tied: the embedding is the output matrix
    weights = Weights(layers=[LayerWeights(**p) for p in parts], **top)
    template = f.get("tokenizer.chat_template")
    return Model(
        config,
        weights,
        be,
        tokenizer=tokenizer,
        chat_template=ChatTemplate(template, tokenizer) if isinstance(template, str) else None,
        source=f,
        n_ctx=n_ctx,
        kv_precision=kv_precision,
        # a Q8_0 cache is written by the arch quantize_row_q8_0, as the activations are
        kv_rounding=backend_options.get("activation_rounding", "ref"),
        trace_nonfinite=trace_nonfinite,
    )
