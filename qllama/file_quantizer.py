"""Quantize a whole GGUF file the way ``llama-quantize`` does (without an importance matrix).

For a file type such as ``Q4_K_M`` every tensor gets the type llama.cpp's
``llama_tensor_get_type`` would give it (``src/llama-quant.cpp``): a default type, a few
per-role upgrades (attn_v and ffn_down in some layers, the output matrix), and a fallback when
a row length is not a multiple of the block size (576-wide SmolLM2 cannot hold K-quants, so
its "Q4_K_M" is mostly Q5_0). Tensors are visited in llama.cpp's order (layer, then name),
which the per-layer counters depend on, and written in that order; metadata is copied with
``general.quantization_version`` and ``general.file_type`` moved to the end, as llama.cpp
does. Quantized sources are dequantized to f32 first; a tensor already of its target type is
copied byte for byte.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from qllama import quants
from qllama.errors import ModelConfigError
from qllama.ggml_types import FileType, GGMLType, ValueType
from qllama.gguf_reader import GGUFFile, GGUFValue, TensorInfo, read_gguf
from qllama.gguf_writer import GGUFWriter

QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION

FILE_TYPES: dict[str, FileType] = {ft.label: ft for ft in FileType}

# llama_ftype_get_default_type
DEFAULT_TYPES: dict[FileType, GGMLType] = {
    FileType.ALL_F32: GGMLType.F32,
    FileType.MOSTLY_F16: GGMLType.F16,
    FileType.MOSTLY_BF16: GGMLType.BF16,
    FileType.MOSTLY_Q4_0: GGMLType.Q4_0,
    FileType.MOSTLY_Q4_1: GGMLType.Q4_1,
    FileType.MOSTLY_Q5_0: GGMLType.Q5_0,
    FileType.MOSTLY_Q5_1: GGMLType.Q5_1,
    FileType.MOSTLY_Q8_0: GGMLType.Q8_0,
    FileType.MOSTLY_Q2_K: GGMLType.Q2_K,
    FileType.MOSTLY_Q3_K_S: GGMLType.Q3_K,
    FileType.MOSTLY_Q3_K_M: GGMLType.Q3_K,
    FileType.MOSTLY_Q3_K_L: GGMLType.Q3_K,
    FileType.MOSTLY_Q4_K_S: GGMLType.Q4_K,
    FileType.MOSTLY_Q4_K_M: GGMLType.Q4_K,
    FileType.MOSTLY_Q5_K_S: GGMLType.Q5_K,
    FileType.MOSTLY_Q5_K_M: GGMLType.Q5_K,
    FileType.MOSTLY_Q6_K: GGMLType.Q6_K,
}

# tensor_type_fallback: what a 256-block type becomes when the row length does not divide
FALLBACKS: dict[GGMLType, GGMLType] = {
    GGMLType.Q2_K: GGMLType.Q4_0,
    GGMLType.Q3_K: GGMLType.Q4_0,
    GGMLType.Q4_K: GGMLType.Q5_0,
    GGMLType.Q5_K: GGMLType.Q5_1,
    GGMLType.Q6_K: GGMLType.Q8_0,
}

# Never quantized, whatever their shape (the llama-relevant part of tensor_allows_quantization).
_KEEP_PATTERNS = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "position_embd.weight",
    "token_types.weight",
)


class Role(enum.Enum):
    """tensor_get_category: the broad role of a tensor, from its name."""

    OUTPUT = enum.auto()
    TOKEN_EMBD = enum.auto()
    ATTN_QKV = enum.auto()
    ATTN_KV_B = enum.auto()
    ATTN_V = enum.auto()
    ATTN_K = enum.auto()
    ATTN_Q = enum.auto()
    ATTN_OUTPUT = enum.auto()
    FFN_UP = enum.auto()
    FFN_GATE = enum.auto()
    FFN_DOWN = enum.auto()
    OTHER = enum.auto()

    @classmethod
    def of(cls, name: str) -> Role:
        if name == "output.weight":
            return cls.OUTPUT
        if name in ("token_embd.weight", "per_layer_token_embd.weight"):
            return cls.TOKEN_EMBD
        for fragment, role in _ROLE_FRAGMENTS:
            if fragment in name:
                return role
        return cls.OTHER

    @property
    def is_attn_v(self) -> bool:
        return self in (Role.ATTN_V, Role.ATTN_QKV, Role.ATTN_KV_B)


_ROLE_FRAGMENTS = (
    ("attn_qkv.weight", Role.ATTN_QKV),
    ("attn_kv_b.weight", Role.ATTN_KV_B),
    ("attn_v.weight", Role.ATTN_V),
    ("attn_k.weight", Role.ATTN_K),
    ("attn_q.weight", Role.ATTN_Q),
    ("attn_output.weight", Role.ATTN_OUTPUT),
    ("ffn_up", Role.FFN_UP),
    ("ffn_gate", Role.FFN_GATE),
    ("ffn_down", Role.FFN_DOWN),
)


def file_type(label: str | FileType) -> FileType:
    """``"Q4_K_M"`` (any case) -> :class:`FileType`; a clear error for anything else."""
    if isinstance(label, FileType):
        return label
    ft = FILE_TYPES.get(label.upper())
    if ft is None:
        raise ModelConfigError(
            f"unknown file type {label!r}; choose one of {', '.join(FILE_TYPES)}"
        )
    return ft


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits (C integer arithmetic)."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or _c_mod(i_layer - n_layers // 8, 3) == 2
    )


def _c_mod(a: int, b: int) -> int:
    """C's ``%``: the remainder takes the sign of the dividend."""
    return a - b * int(a / b)


def _layer_of(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def visit_order(names: list[str]) -> list[str]:
    """llama.cpp's weight_name_comparer: layer number (-1 outside blocks), then name."""
    return sorted(names, key=lambda n: (_layer_of(n), n.encode()))


def allows_quantization(t: TensorInfo) -> bool:
    """2-D or larger weights, except norms and a few small special tensors."""
    return (
        len(t.ne) >= 2
        and t.name.endswith("weight")
        and not any(p in t.name for p in _KEEP_PATTERNS)
    )


@dataclass
class ModelShape:
    """The hyperparameters the type rules look at."""

    arch: str
    n_layer: int
    n_head: int = 0
    n_head_kv: int = 0
    n_expert: int = 0

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> ModelShape:
        arch = f.architecture
        if arch is None:
            raise ModelConfigError("general.architecture is missing or not a string")

        def integer(key: str, default: int | None = None) -> int:
            v = f.kv.get(f"{arch}.{key}")
            if v is None:
                if default is None:
                    raise ModelConfigError(f"key not found: {arch}.{key}")
                return default
            if v.type == ValueType.ARRAY:  # per-layer head counts: the first layer's
                v = GGUFValue(
                    v.elem_type or ValueType.UINT32, int(v.value[0]) if len(v.value) else 0
                )
            if not isinstance(v.value, int) or isinstance(v.value, bool):
                raise ModelConfigError(
                    f"key {arch}.{key} has type {v.type.name}, expected an integer"
                )
            return v.value

        n_head = integer("attention.head_count", 0)
        return cls(
            arch=arch,
            n_layer=integer("block_count"),
            n_head=n_head,
            n_head_kv=integer("attention.head_count_kv", n_head),
            n_expert=integer("expert_count", 0),
        )

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        # llama.cpp's LLM_TYPE_70B for the llama architecture: 80 layers with grouped KV heads
        return self.arch == "llama" and self.n_layer == 80 and self.n_head != self.n_head_kv


@dataclass
class TypeChooser:
    """llama_tensor_get_type for one file, with its per-role counters."""

    ftype: FileType
    model: ModelShape
    tied: bool  # no output.weight: token_embd doubles as the output matrix
    n_attention_wv: int
    i_attention_wv: int = 0
    i_ffn_down: int = 0

    @property
    def default(self) -> GGMLType:
        return DEFAULT_TYPES[self.ftype]

    def choose(self, t: TensorInfo) -> GGMLType:
        if not allows_quantization(t):
            return t.ggml_type
        new = self.default
        if new.block.block_size == 1:  # F32 / F16 / BF16 files: no mixture, no fallback
            return new
        new = self._by_role(new, t)
        return self._fallback(new, t)

    def _by_role(self, new: GGMLType, t: TensorInfo) -> GGMLType:
        ft, m, role = self.ftype, self.model, Role.of(t.name)
        falcon = m.arch == "falcon"
        if role == Role.OUTPUT or (self.tied and role == Role.TOKEN_EMBD):
            if falcon or t.ne[0] % new.block.block_size:
                return GGMLType.Q8_0
            return new if new == GGMLType.Q8_0 else GGMLType.Q6_K
        if role.is_attn_v:
            i, n = self.i_attention_wv, self.n_attention_wv
            self.i_attention_wv += 1
            if ft == FileType.MOSTLY_Q2_K:
                new = GGMLType.Q4_K if m.n_gqa >= 4 else GGMLType.Q3_K
            elif ft == FileType.MOSTLY_Q3_K_M:
                new = GGMLType.Q5_K if i < 2 else GGMLType.Q4_K
            elif ft == FileType.MOSTLY_Q3_K_L:
                new = GGMLType.Q5_K
            elif ft in (FileType.MOSTLY_Q4_K_M, FileType.MOSTLY_Q5_K_M) and use_more_bits(i, n):
                new = GGMLType.Q6_K
            elif ft == FileType.MOSTLY_Q4_K_S and i < 4:
                new = GGMLType.Q5_K
            if m.is_70b and new in (GGMLType.Q3_K, GGMLType.Q4_K):
                new = GGMLType.Q5_K
            return GGMLType.Q8_0 if m.n_expert == 8 else new
        if role == Role.ATTN_K:
            return GGMLType.Q8_0 if m.n_expert == 8 else new
        if role == Role.FFN_DOWN:
            i, n = self._ffn_down_layer(t.name), m.n_layer
            self.i_ffn_down += 1
            more = use_more_bits(i, n)
            if ft == FileType.MOSTLY_Q2_K:
                return GGMLType.Q3_K
            if ft == FileType.MOSTLY_Q3_K_M:
                if i < n // 16:
                    return GGMLType.Q5_K
                return GGMLType.Q4_K if not falcon or more else GGMLType.Q3_K
            if ft == FileType.MOSTLY_Q3_K_L:
                return GGMLType.Q4_K if falcon else GGMLType.Q5_K
            if ft == FileType.MOSTLY_Q4_K_M:
                if falcon:
                    return (
                        GGMLType.Q6_K if i < n // 16 else GGMLType.Q5_K if more else GGMLType.Q4_K
                    )
                return GGMLType.Q6_K if more else new
            if ft == FileType.MOSTLY_Q5_K_M and more:
                return GGMLType.Q6_K
            if ft == FileType.MOSTLY_Q4_K_S and not falcon and i < n // 8:
                return GGMLType.Q5_K
            return new
        if role == Role.ATTN_OUTPUT:
            if falcon:
                return GGMLType.Q4_K if ft == FileType.MOSTLY_Q3_K_L else new
            if m.n_expert == 8:
                upgraded = (
                    FileType.MOSTLY_Q2_K,
                    FileType.MOSTLY_Q3_K_S,
                    FileType.MOSTLY_Q3_K_M,
                    FileType.MOSTLY_Q4_K_S,
                    FileType.MOSTLY_Q4_K_M,
                )
                return GGMLType.Q5_K if ft in upgraded else new
            return {
                FileType.MOSTLY_Q2_K: GGMLType.Q3_K,
                FileType.MOSTLY_Q3_K_M: GGMLType.Q4_K,
                FileType.MOSTLY_Q3_K_L: GGMLType.Q5_K,
            }.get(ft, new)
        return new

    def _ffn_down_layer(self, name: str) -> int:
        if self.model.n_expert <= 1:
            return self.i_ffn_down
        layer = _layer_of(name)  # experts are not consecutive: read the layer from the name
        if not 0 <= layer < self.model.n_layer:
            raise ModelConfigError(
                f"bad layer {layer} for tensor {name}; must be in [0, {self.model.n_layer})"
            )
        return layer

    @staticmethod
    def _fallback(new: GGMLType, t: TensorInfo) -> GGMLType:
        ncols = t.ne[0]
        if ncols % new.block.block_size == 0:
            return new
        new = FALLBACKS.get(new, new)
        return new if ncols % new.block.block_size == 0 else GGMLType.F16


def plan(f: GGUFFile, ftype: str | FileType) -> dict[str, GGMLType]:
    """The type of every tensor of ``f`` in the quantized file, in llama.cpp's write order."""
    ft = file_type(ftype)
    names = visit_order(list(f.tensors))
    chooser = TypeChooser(
        ftype=ft,
        model=ModelShape.from_gguf(f),
        tied="output.weight" not in f.tensors,
        n_attention_wv=sum(Role.of(n).is_attn_v for n in names),
    )
    return {n: chooser.choose(f.tensors[n]) for n in names}


def _convert(f: GGUFFile, t: TensorInfo, new: GGMLType) -> Callable[[], np.ndarray]:
    """A callable giving ``t``'s bytes as ``new``: copied if the type is unchanged, else
    dequantized to f32 and quantized."""

    def run() -> np.ndarray:
        raw = f.tensor_data(t.name)
        if new == t.ggml_type:
            return raw
        x = quants.dequantize(raw, t.ggml_type, t.shape)
        return quants.quantize(x, new)

    return run


@dataclass
class QuantizeResult:
    """What :func:`quantize_file` wrote."""

    path: str
    file_type: FileType
    types: dict[str, GGMLType]
    bytes_in: int
    bytes_out: int
    counts: dict[str, int] = field(default_factory=dict)


def quantize_file(
    src: str | os.PathLike[str] | GGUFFile,
    dst: str | os.PathLike[str],
    ftype: str | FileType,
    *,
    progress: Callable[[int, int, TensorInfo, GGMLType], None] | None = None,
) -> QuantizeResult:
    """Write ``dst``: ``src`` quantized to file type ``ftype`` (``"Q8_0"``, ``"Q4_K_M"``...).

    ``progress(i, n, tensor, new_type)`` is called before each tensor is converted.
    """
    f = src if isinstance(src, GGUFFile) else read_gguf(src)
    ft = file_type(ftype)
    types = plan(f, ft)
    for name, new in types.items():
        if new != f.tensors[name].ggml_type:
            quants.get(f.tensors[name].ggml_type)  # refuse an unsupported source type up front
            quants.get(new)

    w = GGUFWriter()
    skip = {
        "general.quantization_version",
        "general.file_type",
        "split.no",
        "split.count",
        "split.tensors.count",
    }
    for key, v in f.kv.items():
        if key not in skip:
            w.add(key, v)
    w.add("general.quantization_version", GGUFValue(ValueType.UINT32, QUANTIZATION_VERSION))
    w.add("general.file_type", GGUFValue(ValueType.UINT32, int(ft)))

    for i, (name, new) in enumerate(types.items()):
        t = f.tensors[name]
        convert = _convert(f, t, new)
        if progress is not None:
            convert = _announce(progress, i, len(types), t, new, convert)
        w.add_tensor(name, convert, new, t.shape)
    w.write(dst)

    counts: dict[str, int] = {}
    for new in types.values():
        counts[new.name] = counts.get(new.name, 0) + 1
    return QuantizeResult(
        path=os.fspath(dst),
        file_type=ft,
        types=types,
        bytes_in=sum(t.nbytes for t in f.tensors.values()),
        bytes_out=sum(new.nbytes(f.tensors[n].n_elements) for n, new in types.items()),
        counts=counts,
    )


def _announce(
    progress: Callable[[int, int, TensorInfo, GGMLType], None],
    i: int,
    n: int,
    t: TensorInfo,
    new: GGMLType,
    convert: Callable[[], np.ndarray],
) -> Callable[[], np.ndarray]:
    def run() -> np.ndarray:
        progress(i, n, t, new)
        return convert()

    return run
