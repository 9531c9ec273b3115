"""Quantize a whole GGUF file the way ``llama-quantize`` does, with or without an importance
matrix.

For a file type such as ``Q4_K_M`` every tensor gets the type llama.cpp's
``llama_tensor_get_type`` would give it (``src/llama-quant.cpp``): the file type's default
type, a per-role choice (attn_v and ffn_down in some layers, the output matrix, the token
embedding), and a fallback when a row length is not a multiple of the block size (576-wide
SmolLM2 cannot hold 256-blocks, so its "Q4_K_M" is mostly Q5_0). The choice is written as
tables here: one per role, keyed by file type, each entry a rule of what the tensor's layer,
the model's shape and the presence of an importance matrix decide.

Tensors are visited in llama.cpp's order (layer, then name), which the per-role counters
depend on, and written in that order; metadata is copied with
``general.quantization_version`` and ``general.file_type`` moved to the end, then, with an
importance matrix, llama-quantize's ``quantize.imatrix.*`` keys. Quantized sources are
dequantized to f32 first; a tensor already of its target type is copied byte for byte.

With an importance matrix each tensor is quantized with its entry (per expert slice for 3-D
weights); a tensor without one is quantized without, except where llama.cpp requires one
(IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS targets, and Q2_K in a Q2_K_S file; never
token_embd or output), which is refused, as is such a file type without any importance matrix.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from qllama import quants
from qllama.errors import (
    ImatrixError,
    ModelConfigError,
    QllamaError,
    UnsupportedTensorTypeError,
)
from qllama.ggml_types import FileType, GGMLType, ValueType
from qllama.gguf.reader import GGUFFile, GGUFValue, TensorInfo, read_gguf
from qllama.gguf.writer import GGUFWriter

QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION

FT = FileType
T = GGMLType

# llama_ftype_get_default_type; a file type without an entry (NVFP4) is refused, as
# llama-quantize does ("invalid output file type")
DEFAULT_TYPES: dict[FileType, GGMLType] = {
    FT.ALL_F32: T.F32,
    FT.MOSTLY_F16: T.F16,
    FT.MOSTLY_BF16: T.BF16,
    FT.MOSTLY_Q4_0: T.Q4_0,
    FT.MOSTLY_Q4_1: T.Q4_1,
    FT.MOSTLY_Q5_0: T.Q5_0,
    FT.MOSTLY_Q5_1: T.Q5_1,
    FT.MOSTLY_Q8_0: T.Q8_0,
    FT.MOSTLY_Q1_0: T.Q1_0,
    FT.MOSTLY_Q2_0: T.Q2_0,
    FT.MOSTLY_MXFP4_MOE: T.MXFP4,
    FT.MOSTLY_Q2_K: T.Q2_K,
    FT.MOSTLY_Q2_K_S: T.Q2_K,
    FT.MOSTLY_IQ3_XS: T.IQ3_S,
    FT.MOSTLY_Q3_K_S: T.Q3_K,
    FT.MOSTLY_Q3_K_M: T.Q3_K,
    FT.MOSTLY_Q3_K_L: T.Q3_K,
    FT.MOSTLY_Q4_K_S: T.Q4_K,
    FT.MOSTLY_Q4_K_M: T.Q4_K,
    FT.MOSTLY_Q5_K_S: T.Q5_K,
    FT.MOSTLY_Q5_K_M: T.Q5_K,
    FT.MOSTLY_Q6_K: T.Q6_K,
    FT.MOSTLY_TQ1_0: T.TQ1_0,
    FT.MOSTLY_TQ2_0: T.TQ2_0,
    FT.MOSTLY_IQ2_XXS: T.IQ2_XXS,
    FT.MOSTLY_IQ2_XS: T.IQ2_XS,
    FT.MOSTLY_IQ2_S: T.IQ2_XS,
    FT.MOSTLY_IQ2_M: T.IQ2_S,
    FT.MOSTLY_IQ3_XXS: T.IQ3_XXS,
    FT.MOSTLY_IQ1_S: T.IQ1_S,
    FT.MOSTLY_IQ1_M: T.IQ1_M,
    FT.MOSTLY_IQ4_NL: T.IQ4_NL,
    FT.MOSTLY_IQ4_XS: T.IQ4_XS,
    FT.MOSTLY_IQ3_S: T.IQ3_S,
    FT.MOSTLY_IQ3_M: T.IQ3_S,
}

# The names llama-quantize takes (tools/quantize/quantize.cpp QUANT_OPTIONS); Q3_K, Q4_K and
# Q5_K are its aliases of the _M mixtures.
FILE_TYPES: dict[str, FileType] = {ft.label: ft for ft in FileType if ft in DEFAULT_TYPES}
ALIASES: dict[str, FileType] = {
    "Q3_K": FT.MOSTLY_Q3_K_M,
    "Q4_K": FT.MOSTLY_Q4_K_M,
    "Q5_K": FT.MOSTLY_Q5_K_M,
}

# tensor_type_fallback: what a type becomes when the row length does not divide into its
# blocks; 32-block types have none (they fall to F16); any other type without an entry
# (Q1_0's 128, NVFP4's 64) makes llama.cpp throw
FALLBACKS: dict[GGMLType, GGMLType] = {
    **dict.fromkeys(
        (T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_XS), T.IQ4_NL
    ),
    **dict.fromkeys((T.Q2_0, T.Q2_K, T.Q3_K, T.TQ1_0, T.TQ2_0), T.Q4_0),
    T.Q4_K: T.Q5_0,
    T.Q5_K: T.Q5_1,
    T.Q6_K: T.Q8_0,
}

# tensor_requires_imatrix: target types llama-quantize will not write without an imatrix
REQUIRES_IMATRIX = frozenset((T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_M, T.IQ1_S))

# --- which tensors are quantized (tensor_allows_quantization) -----------------------------------

# never quantized when the name contains one of these
KEEP_FRAGMENTS = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "time_mix_first.weight",
    "time_mix_w0.weight",
    "time_mix_w1.weight",
    "time_mix_w2.weight",
    "time_mix_v0.weight",
    "time_mix_v1.weight",
    "time_mix_v2.weight",
    "time_mix_a0.weight",
    "time_mix_a1.weight",
    "time_mix_a2.weight",
    "time_mix_g1.weight",
    "time_mix_g2.weight",
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
)
KEEP_NAMES = frozenset(("position_embd.weight", "token_types.weight"))
# per architecture, more fragments never quantized
KEEP_FRAGMENTS_BY_ARCH: dict[str, tuple[str, ...]] = {
    "glm5-next": (
        "hc_",
        "indexer.attn_q_b",
        "indexer.attn_k",
        "indexer.proj",
        "indexer_compressor_gate",
        "indexer_compressor_ape",
        "ssm_f_a.weight",
        "ssm_f_b.weight",
        "ssm_g_a.weight",
        "ssm_g_b.weight",
        "ssm_beta.weight",
        "attn_kv_a_mqa.weight",
        "attn_k_b.weight",
        "attn_v_b.weight",
    ),
}
# per architecture, name fragments kept at Q8_0 or better
AT_LEAST_Q8_0_BY_ARCH: dict[str, tuple[str, ...]] = {
    "glm5-next": ("attn_q_a", "attn_q_b", "nextn.eh_proj"),
}
# MXFP4_MOE: 3-D tensors become MXFP4; in these architectures only the expert FFNs do
MXFP4_EXPERT_ROLES_ONLY = frozenset(("bailingmoe3",))


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
        """category_is_attn_v: the fused QKV and MLA's kv_b count as attn_v (so llama.cpp's
        own ATTN_QKV branch after them is never reached)."""
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
    """``"Q4_K_M"`` (any case; llama-quantize's aliases too) -> :class:`FileType`; a clear
    error for anything else, and for NVFP4, which llama.cpp cannot quantize to."""
    if isinstance(label, FileType):
        ft: FileType | None = label
    else:
        key = label.upper()
        ft = FILE_TYPES[key] if key in FILE_TYPES else ALIASES.get(key)  # ALL_F32 is 0
    if ft is None or ft not in DEFAULT_TYPES:
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


def ggml_dims(ne: tuple[int, ...]) -> tuple[int, ...]:
    """``ne`` without its trailing 1s (ggml_n_dims): what llama.cpp loads and writes, so a
    [64, 1] tensor (qwen2moe's ffn_gate_inp_shexp as the converter writes it) is {64}."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return tuple(ne[:n])


def allows_quantization(t: TensorInfo, arch: str | None = None) -> bool:
    """2-D or larger weights (trailing 1s dropped), except norms and the small special
    tensors llama.cpp keeps."""
    name = t.name
    if len(ggml_dims(t.ne)) < 2 or not name.endswith("weight") or name in KEEP_NAMES:
        return False
    fragments = KEEP_FRAGMENTS + KEEP_FRAGMENTS_BY_ARCH.get(arch or "", ())
    return not any(f in name for f in fragments)


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

    @property
    def falcon(self) -> bool:
        return self.arch == "falcon"


# --- the rules -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Facts:
    """What a rule may look at for one tensor."""

    new: GGMLType  # the type so far (the default type)
    model: ModelShape
    i: int  # the tensor's index among its role (attn_v, ffn_down...) or its layer
    n: int  # how many there are
    imatrix: bool  # whether an importance matrix is given

    @property
    def more(self) -> bool:
        return use_more_bits(self.i, self.n)


Rule = Callable[[Facts], GGMLType]


def keep(f: Facts) -> GGMLType:
    return f.new


def to(t: GGMLType) -> Rule:
    return lambda f: t


def gqa4(then: GGMLType, otherwise: Rule = keep) -> Rule:
    """``then`` when 4 or more query heads share a KV head, else ``otherwise``."""
    return lambda f: then if f.model.n_gqa >= 4 else otherwise(f)


def first_eighth(then: GGMLType, otherwise: Rule = keep) -> Rule:
    """``then`` in the first n/8 layers."""
    return lambda f: then if f.i < f.n // 8 else otherwise(f)


def more_bits(then: GGMLType) -> Rule:
    return lambda f: then if f.more else f.new


def without_imatrix(rule: Rule) -> Rule:
    return lambda f: f.new if f.imatrix else rule(f)


def with_imatrix(rule: Rule) -> Rule:
    return lambda f: rule(f) if f.imatrix else f.new


# The IQ1/IQ2 file types: llama.cpp's branch for them comes before every role's generic one.
VERY_LOW_BIT = frozenset(
    (
        FT.MOSTLY_IQ2_XXS,
        FT.MOSTLY_IQ2_XS,
        FT.MOSTLY_IQ1_S,
        FT.MOSTLY_IQ2_S,
        FT.MOSTLY_IQ2_M,
        FT.MOSTLY_IQ1_M,
    )
)
IQ2_S_M = frozenset((FT.MOSTLY_IQ2_S, FT.MOSTLY_IQ2_M))

# output.weight (and token_embd when tied): Q8_0 for MXFP4_MOE, Falcon, or rows that do not
# divide; Q5_K for these; Q6_K for the rest (a Q8_0 stays Q8_0)
OUTPUT_Q5_K = frozenset(
    (
        FT.MOSTLY_IQ2_XXS,
        FT.MOSTLY_IQ2_XS,
        FT.MOSTLY_IQ3_XXS,
        FT.MOSTLY_IQ1_S,
        FT.MOSTLY_IQ2_S,
        FT.MOSTLY_IQ2_M,
        FT.MOSTLY_IQ1_M,
    )
)

# token_embd (untied)
TOKEN_EMBD: dict[FileType, GGMLType] = {
    **dict.fromkeys(
        (FT.MOSTLY_IQ2_XXS, FT.MOSTLY_IQ2_XS, FT.MOSTLY_IQ1_S, FT.MOSTLY_IQ1_M), T.Q2_K
    ),
    **dict.fromkeys((FT.MOSTLY_IQ2_S, FT.MOSTLY_IQ2_M, FT.MOSTLY_IQ3_XXS), T.IQ3_S),
    **dict.fromkeys((FT.MOSTLY_TQ1_0, FT.MOSTLY_TQ2_0, FT.MOSTLY_Q2_0), T.Q4_K),
}


# attn_v (and the fused qkv, kv_b), by file type; then the 70B and 8-expert bumps
ATTN_V: dict[FileType, Rule] = {
    FT.MOSTLY_Q2_K: gqa4(T.Q4_K, to(T.Q3_K)),
    FT.MOSTLY_Q2_K_S: gqa4(T.Q4_K),
    FT.MOSTLY_IQ3_XXS: gqa4(T.Q4_K, lambda f: T.IQ3_XXS if f.imatrix else T.IQ3_S),
    FT.MOSTLY_IQ3_XS: gqa4(T.Q4_K),
    FT.MOSTLY_IQ3_S: gqa4(T.Q4_K),
    FT.MOSTLY_IQ3_M: to(T.Q4_K),
    FT.MOSTLY_Q3_K_M: lambda f: T.Q5_K if f.i < 2 else T.Q4_K,
    FT.MOSTLY_Q3_K_L: to(T.Q5_K),
    FT.MOSTLY_IQ4_NL: gqa4(T.Q5_K),
    FT.MOSTLY_IQ4_XS: gqa4(T.Q5_K),
    FT.MOSTLY_Q4_K_M: more_bits(T.Q6_K),
    FT.MOSTLY_Q5_K_M: more_bits(T.Q6_K),
    FT.MOSTLY_Q4_K_S: lambda f: T.Q5_K if f.i < 4 else f.new,
}

ATTN_K: dict[FileType, Rule] = {FT.MOSTLY_IQ3_XS: to(T.IQ3_XXS), FT.MOSTLY_IQ3_XXS: to(T.IQ2_S)}
ATTN_Q = ATTN_K


def _q3_k_m_down(f: Facts) -> GGMLType:
    if f.i < f.n // 16:
        return T.Q5_K
    return T.Q4_K if not f.model.falcon or f.more else T.Q3_K


def _q4_k_m_down(f: Facts) -> GGMLType:
    if f.model.falcon:
        return T.Q6_K if f.i < f.n // 16 else T.Q5_K if f.more else T.Q4_K
    return T.Q6_K if f.more else f.new


# ffn_down by file type (i, n: its layer and the number of layers)
FFN_DOWN: dict[FileType, Rule] = {
    FT.MOSTLY_Q2_K: to(T.Q3_K),
    FT.MOSTLY_Q2_K_S: first_eighth(T.Q4_K),
    FT.MOSTLY_IQ3_XXS: without_imatrix(first_eighth(T.Q4_K, to(T.Q3_K))),
    FT.MOSTLY_Q3_K_M: _q3_k_m_down,
    FT.MOSTLY_IQ3_M: lambda f: (
        T.Q4_K if f.i < f.n // 8 or (f.model.n_expert == 8 and f.more) else f.new
    ),
    FT.MOSTLY_Q3_K_L: lambda f: T.Q4_K if f.model.falcon else T.Q5_K,
    FT.MOSTLY_Q4_K_M: _q4_k_m_down,
    FT.MOSTLY_IQ4_NL: without_imatrix(first_eighth(T.Q5_K)),
    FT.MOSTLY_IQ4_XS: without_imatrix(first_eighth(T.Q5_K)),
    FT.MOSTLY_Q5_K_M: more_bits(T.Q6_K),
    FT.MOSTLY_Q4_K_S: lambda f: f.new if f.model.falcon else first_eighth(T.Q5_K)(f),
    # "craziness in the first few ffn_down layers" of Q4_0/Q5_0 with an imatrix
    FT.MOSTLY_Q4_0: with_imatrix(first_eighth(T.Q4_1)),
    FT.MOSTLY_Q5_0: with_imatrix(first_eighth(T.Q5_1)),
}

# attn_output: with 8 experts these file types get Q5_K; otherwise by file type (not Falcon)
ATTN_OUTPUT_8_EXPERTS = frozenset(
    (
        FT.MOSTLY_Q2_K,
        FT.MOSTLY_IQ3_XS,
        FT.MOSTLY_IQ3_XXS,
        FT.MOSTLY_Q3_K_S,
        FT.MOSTLY_Q3_K_M,
        FT.MOSTLY_IQ4_NL,
        FT.MOSTLY_Q4_K_S,
        FT.MOSTLY_Q4_K_M,
        FT.MOSTLY_IQ3_S,
        FT.MOSTLY_IQ3_M,
        FT.MOSTLY_IQ4_XS,
    )
)
ATTN_OUTPUT: dict[FileType, GGMLType] = {
    FT.MOSTLY_Q2_K: T.Q3_K,
    FT.MOSTLY_IQ3_XXS: T.IQ3_S,
    FT.MOSTLY_Q3_K_M: T.Q4_K,
    FT.MOSTLY_Q3_K_L: T.Q5_K,
    FT.MOSTLY_IQ3_M: T.Q4_K,
}
ATTN_OUTPUT_FALCON: dict[FileType, GGMLType] = {FT.MOSTLY_Q3_K_L: T.Q4_K}

# ffn_gate and ffn_up: IQ3_XS puts the middle layers (n/8 <= i < 7n/8) at IQ3_XXS
FFN_GATE_UP: dict[FileType, Rule] = {
    FT.MOSTLY_IQ3_XS: lambda f: T.IQ3_XXS if f.n // 8 <= f.i < 7 * f.n // 8 else f.new,
}


@dataclass(frozen=True)
class Overrides:
    """llama-quantize's choices over its mixture rules: ``--tensor-type NAME=TYPE`` (the
    first pattern found in a tensor's name, by ``re.search``, replaces the mixture for it;
    NAME lower-cased as llama-quantize does; the shape fallback still applies),
    ``--token-embedding-type`` and ``--output-tensor-type`` (taken as they are, before any
    other rule and without a fallback), and ``--pure`` (no mixture: the file type's type)."""

    tensor_types: tuple[tuple[str, GGMLType], ...] = ()
    token_embedding_type: GGMLType | None = None
    output_tensor_type: GGMLType | None = None
    pure: bool = False

    @classmethod
    def parse(
        cls,
        tensor_types: Sequence[str] = (),
        *,
        token_embedding_type: str | None = None,
        output_tensor_type: str | None = None,
        pure: bool = False,
    ) -> Overrides:
        """From llama-quantize's arguments: ``"attn_v=q8_0"``, ``"blk\\.1[0-9]\\.=Q4_K"``."""
        pairs = []
        for text in tensor_types:
            name, eq, kind = text.partition("=")
            if not eq or not name or not kind:
                raise QllamaError(f"--tensor-type {text!r}: give NAME=TYPE (attn_v=q8_0)")
            try:
                re.compile(name.lower())
            except re.error as e:
                raise QllamaError(f"--tensor-type {text!r}: {name!r} is no pattern: {e}") from None
            pairs.append((name.lower(), ggml_type_named(kind, f"--tensor-type {text!r}")))
        return cls(
            tuple(pairs),
            ggml_type_named(token_embedding_type, "--token-embedding-type")
            if token_embedding_type
            else None,
            ggml_type_named(output_tensor_type, "--output-tensor-type")
            if output_tensor_type
            else None,
            pure,
        )

    def match(self, name: str) -> GGMLType | None:
        """The type of the first ``--tensor-type`` pattern found in ``name``."""
        return next((t for p, t in self.tensor_types if re.search(p, name)), None)

    def as_arguments(self) -> list[str]:
        """The llama-quantize arguments that make these choices."""
        out = []
        for p, t in self.tensor_types:
            out += ["--tensor-type", f"{p}={t.name.lower()}"]
        if self.token_embedding_type is not None:
            out += ["--token-embedding-type", self.token_embedding_type.name.lower()]
        if self.output_tensor_type is not None:
            out += ["--output-tensor-type", self.output_tensor_type.name.lower()]
        return out + (["--pure"] if self.pure else [])


def ggml_type_named(name: str, where: str) -> GGMLType:
    """A GGML type by llama.cpp's name, any case (``q4_k``, ``MXFP4``)."""
    try:
        return GGMLType[name.upper()]
    except KeyError:
        raise QllamaError(f"{where}: {name!r} is not a GGML type") from None


@dataclass
class TypeChooser:
    """llama_tensor_get_type for one file, with its per-role counters."""

    ftype: FileType
    model: ModelShape
    tied: bool  # no output.weight: token_embd doubles as the output matrix
    n_attention_wv: int
    imatrix: bool = False
    i_attention_wv: int = 0
    counters: dict[Role, int] = field(default_factory=dict)
    # tensors whose chosen type does not divide their rows: name -> (chosen, fallback)
    fallbacks: dict[str, tuple[GGMLType, GGMLType]] = field(default_factory=dict)
    overrides: Overrides = field(default_factory=Overrides)

    @property
    def default(self) -> GGMLType:
        return DEFAULT_TYPES[self.ftype]

    def choose(self, t: TensorInfo) -> GGMLType:
        if not allows_quantization(t, self.model.arch):
            return t.ggml_type
        o, role = self.overrides, Role.of(t.name)
        # the user's types for the two tables come first, as they are (no fallback); a
        # --tensor-type that names per_layer_token_embd takes it from --token-embedding-type
        if o.token_embedding_type is not None and role == Role.TOKEN_EMBD:
            if t.name != "per_layer_token_embd.weight" or o.match(t.name) is None:
                return o.token_embedding_type
        if o.output_tensor_type is not None and role == Role.OUTPUT:
            return o.output_tensor_type
        new = self.default
        if new.block.block_size == 1:  # F32 / F16 / BF16 files: no mixture, no fallback
            return new
        manual = o.match(t.name)
        if manual is not None:  # replaces the mixture: no role's counter moves for it
            new = manual
        elif not o.pure:
            new = self._by_role(new, t)
        got = self._fallback(new, t)
        if got != new:
            self.fallbacks[t.name] = (new, got)
        return got

    def _facts(self, new: GGMLType, i: int, n: int) -> Facts:
        return Facts(new, self.model, i, n, self.imatrix)

    def _next(self, role: Role) -> int:
        """The role's counter (its tensors so far), then counted one more."""
        i = self.counters.get(role, 0)
        self.counters[role] = i + 1
        return i

    def _layer(self, role: Role, name: str) -> int:
        """layer_info: the role's counter, or with experts the layer in the name."""
        i = self._next(role)
        if max(1, self.model.n_expert) <= 1:
            return i
        layer = _layer_of(name)  # experts are not consecutive: read the layer from the name
        if not 0 <= layer < self.model.n_layer:
            raise ModelConfigError(
                f"bad layer {layer} for tensor {name}; must be in [0, {self.model.n_layer})"
            )
        return layer

    def _by_role(self, new: GGMLType, t: TensorInfo) -> GGMLType:
        ft, m, role, name = self.ftype, self.model, Role.of(t.name), t.name
        if any(frag in name for frag in AT_LEAST_Q8_0_BY_ARCH.get(m.arch, ())):
            return T.Q8_0
        if role == Role.OUTPUT or (self.tied and role == Role.TOKEN_EMBD):
            if self.overrides.output_tensor_type is not None:
                return self.overrides.output_tensor_type
            if ft == FT.MOSTLY_MXFP4_MOE or m.falcon or t.ne[0] % new.block.block_size:
                return T.Q8_0
            if ft in OUTPUT_Q5_K:
                return T.Q5_K
            return new if new == T.Q8_0 else T.Q6_K
        if ft == FT.MOSTLY_MXFP4_MOE:
            expert = len(t.ne) > 2 and t.ne[2] > 1
            if m.arch in MXFP4_EXPERT_ROLES_ONLY:
                expert &= role in (Role.FFN_UP, Role.FFN_GATE, Role.FFN_DOWN)
            return T.MXFP4 if expert else T.Q8_0
        if role == Role.TOKEN_EMBD:
            return TOKEN_EMBD.get(ft, new)
        if ft in VERY_LOW_BIT:
            return self._very_low_bit(new, t, role)
        if role.is_attn_v:
            i, n = self.i_attention_wv, self.n_attention_wv
            self.i_attention_wv += 1
            new = ATTN_V.get(ft, keep)(self._facts(new, i, n))
            if m.is_70b and new in (T.Q3_K, T.Q4_K):
                new = T.Q5_K
            return T.Q8_0 if m.n_expert == 8 else new
        if role in (Role.ATTN_K, Role.ATTN_Q):
            if role == Role.ATTN_K and m.n_expert == 8:
                return T.Q8_0
            return (ATTN_K if role == Role.ATTN_K else ATTN_Q).get(ft, keep)(self._facts(new, 0, 0))
        if role == Role.FFN_DOWN:
            i = self._layer(role, name)
            return FFN_DOWN.get(ft, keep)(self._facts(new, i, m.n_layer))
        if role == Role.ATTN_OUTPUT:
            if m.falcon:
                return ATTN_OUTPUT_FALCON.get(ft, new)
            if m.n_expert == 8:
                return T.Q5_K if ft in ATTN_OUTPUT_8_EXPERTS else new
            return ATTN_OUTPUT.get(ft, new)
        if role in (Role.FFN_GATE, Role.FFN_UP):
            i = self._layer(role, name)
            return FFN_GATE_UP.get(ft, keep)(self._facts(new, i, m.n_layer))
        return new

    def _very_low_bit(self, new: GGMLType, t: TensorInfo, role: Role) -> GGMLType:
        """IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ2_M: their own branch, before the rest."""
        ft, m = self.ftype, self.model
        if role.is_attn_v:
            self.i_attention_wv += 1
            if m.n_gqa >= 4 or m.n_expert >= 4:
                return T.Q4_K
            return T.IQ3_S if ft in IQ2_S_M else T.Q2_K
        if role == Role.ATTN_K and m.n_expert == 8:
            return T.Q4_K
        if role == Role.FFN_DOWN:
            # the plain counter here, not layer_info (llama.cpp's code)
            i = self._next(role)
            if i < m.n_layer // 8:
                return T.IQ3_S if ft in IQ2_S_M else T.Q2_K
            return new
        if role == Role.ATTN_OUTPUT:
            if m.n_expert == 8:
                return T.Q5_K
            if ft in (FT.MOSTLY_IQ1_S, FT.MOSTLY_IQ1_M):
                return T.IQ2_XXS
            return T.IQ3_S if ft in IQ2_S_M else new
        return new

    @staticmethod
    def _fallback(new: GGMLType, t: TensorInfo) -> GGMLType:
        ncols = t.ne[0]
        block = new.block.block_size
        if ncols % block == 0:
            return new
        if new in FALLBACKS:
            new = FALLBACKS[new]
        elif block > 32:
            raise ModelConfigError(
                f"tensor {t.name}: rows of {ncols} do not divide into {new.name} blocks of "
                f"{block}, and llama.cpp defines no fallback type for {new.name}"
            )
        return new if ncols % new.block.block_size == 0 else T.F16


def plan(
    f: GGUFFile,
    ftype: str | FileType,
    *,
    imatrix: bool = False,
    overrides: Overrides | None = None,
) -> dict[str, GGMLType]:
    """The type of every tensor of ``f`` in the quantized file, in llama.cpp's write order.
    ``imatrix``: whether the file is quantized with an importance matrix (some rules depend
    on it); ``overrides``: llama-quantize's ``--tensor-type`` and friends."""
    return plan_with_fallbacks(f, ftype, imatrix=imatrix, overrides=overrides)[0]


def plan_with_fallbacks(
    f: GGUFFile,
    ftype: str | FileType,
    *,
    imatrix: bool = False,
    overrides: Overrides | None = None,
) -> tuple[dict[str, GGMLType], dict[str, tuple[GGMLType, GGMLType]]]:
    """:func:`plan`, and the tensors whose rows the chosen type cannot divide: name ->
    (the type chosen, the fallback written), what llama-quantize reports per tensor."""
    ft = file_type(ftype)
    names = visit_order(list(f.tensors))
    chooser = TypeChooser(
        ftype=ft,
        model=ModelShape.from_gguf(f),
        tied="output.weight" not in f.tensors,
        n_attention_wv=sum(Role.of(n).is_attn_v for n in names),
        imatrix=imatrix,
        overrides=overrides or Overrides(),
    )
    types = {n: chooser.choose(f.tensors[n]) for n in names}
    return types, chooser.fallbacks


def requires_imatrix(name: str, new: GGMLType, ftype: FileType) -> bool:
    """tensor_requires_imatrix: whether llama-quantize refuses to write ``name`` as ``new``
    without importance data."""
    if name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    return new in REQUIRES_IMATRIX or (new == T.Q2_K and ftype == FT.MOSTLY_Q2_K_S)


# --- the importance matrix as llama-quantize uses it ----------------------------------------------


@dataclass(frozen=True)
class ImatrixInput:
    """An importance matrix prepared for quantization: per tensor the values llama-quantize
    passes to ggml, and the metadata it records in the output."""

    values: Mapping[str, np.ndarray]
    file: str  # quantize.imatrix.file: the path as given
    datasets: tuple[str, ...]
    chunk_count: int
    n_entries: int  # entries in the file (quantize.imatrix.entries_count)

    def metadata(self) -> list[tuple[str, GGUFValue]]:
        """llama-quantize's ``quantize.imatrix.*`` keys, in its order (strings cut to 127
        bytes as its fixed buffers do; counts as u32)."""
        kv = [("quantize.imatrix.file", GGUFValue(ValueType.STRING, _c_string(self.file)))]
        if self.datasets:
            kv.append(
                (
                    "quantize.imatrix.dataset",
                    GGUFValue(ValueType.STRING, _c_string(self.datasets[0])),
                )
            )
        kv.append(("quantize.imatrix.entries_count", GGUFValue(ValueType.UINT32, self.n_entries)))
        if self.chunk_count > 0:
            kv.append(
                ("quantize.imatrix.chunks_count", GGUFValue(ValueType.UINT32, self.chunk_count))
            )
        return kv


def _c_string(s: str) -> str:
    """``strncpy(buf, s, 127)``: the first 127 bytes (a split character becomes U+FFFD)."""
    return s.encode()[:127].decode("utf-8", "replace")


def load_imatrix(
    path: str | os.PathLike[str], f: GGUFFile, *, recorded_as: str | None = None
) -> ImatrixInput:
    """Read an importance matrix file for quantizing ``f``: its per-tensor means, checked
    against the file's tensors (names, lengths, finite values). The output records the path
    as given, as llama-quantize does, or ``recorded_as``."""
    from qllama.gguf.imatrix import read_imatrix

    m = read_imatrix(path)
    values = m.for_tensors({t.name: t.shape for t in f})
    file = recorded_as if recorded_as is not None else os.fspath(path)
    return ImatrixInput(values, file, tuple(m.datasets), m.chunk_count, len(m.entries))


# --- writing ----------------------------------------------------------------------------------


def _convert(
    f: GGUFFile, t: TensorInfo, new: GGMLType, qw: np.ndarray | None
) -> Callable[[], np.ndarray]:
    """A callable giving ``t``'s bytes as ``new``: copied if the type is unchanged, else
    dequantized to f32 and quantized, expert slice by expert slice with an importance matrix."""

    def run() -> np.ndarray:
        raw = f.tensor_data(t.name)
        if new == t.ggml_type:
            return raw
        x = quants.dequantize(raw, t.ggml_type, t.shape)
        if qw is None:
            return quants.quantize(x, new)
        slices = x.reshape(-1, *x.shape[-2:])  # (n_mat, rows, row length)
        per = qw.reshape(slices.shape[0], -1)
        return np.concatenate(
            [
                quants.quantize(s, new, imatrix=w).reshape(-1)
                for s, w in zip(slices, per, strict=True)
            ]
        )

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
    without_imatrix: list[str] = field(default_factory=list)  # quantized without an entry
    # rows not a multiple of the chosen type's block: name -> (chosen, written)
    fallbacks: dict[str, tuple[GGMLType, GGMLType]] = field(default_factory=dict)


def quantize_file(
    src: str | os.PathLike[str] | GGUFFile,
    dst: str | os.PathLike[str],
    ftype: str | FileType,
    *,
    imatrix: str | os.PathLike[str] | ImatrixInput | None = None,
    imatrix_name: str | None = None,
    progress: Callable[[int, int, TensorInfo, GGMLType], None] | None = None,
    overrides: Overrides | None = None,
) -> QuantizeResult:
    """Write ``dst``: ``src`` quantized to file type ``ftype`` (``"Q8_0"``, ``"IQ4_XS"``...).

    ``imatrix`` is an importance matrix file (GGUF or legacy ``.dat``, as llama-quantize's
    ``--imatrix``) or an :class:`ImatrixInput`; the output records the file's path as given,
    or ``imatrix_name``. ``overrides`` are llama-quantize's ``--tensor-type``,
    ``--token-embedding-type``, ``--output-tensor-type`` and ``--pure``
    (:class:`Overrides`). ``progress(i, n, tensor, new_type)`` is called before each tensor
    is converted. Nothing is written unless every check passes.
    """
    f = src if isinstance(src, GGUFFile) else read_gguf(src)
    ft = file_type(ftype)
    im = (
        load_imatrix(imatrix, f, recorded_as=imatrix_name)
        if isinstance(imatrix, str | os.PathLike)
        else imatrix
    )
    types, fallbacks = plan_with_fallbacks(f, ft, imatrix=im is not None, overrides=overrides)
    missing: list[str] = []
    arch = f.architecture
    for name, new in types.items():
        t = f.tensors[name]
        needs = requires_imatrix(name, new, ft)
        if im is None and needs and allows_quantization(t, arch):
            # llama-quantize checks before it writes anything, whatever the source type
            raise ImatrixError(
                f"file type {ft.label} quantizes {name} to {new.name}, which needs an "
                "importance matrix (give one with --imatrix)"
            )
        if new == t.ggml_type:
            continue
        if im is not None and name not in im.values:
            if needs:
                raise ImatrixError(
                    f"the importance matrix has no entry for {name}, which file type "
                    f"{ft.label} quantizes to {new.name} (it needs one)"
                )
            missing.append(name)  # llama-quantize: "did not find weights", quantized without
    for name, new in types.items():  # then refuse unsupported types up front
        t = f.tensors[name]
        if new == t.ggml_type:
            continue
        try:
            quants.get(t.ggml_type)
            quants.get(new)
        except UnsupportedTensorTypeError as e:
            raise UnsupportedTensorTypeError(f"{ft.label}, tensor {name}: {e}") from None

    w = GGUFWriter()
    skip = {
        "general.quantization_version",
        "general.file_type",
        "split.no",
        "split.count",
        "split.tensors.count",
    }
    extra = im.metadata() if im is not None else []
    skip |= {key for key, _ in extra}  # gguf_set_val: removed, then appended
    for key, v in f.kv.items():
        if key not in skip:
            w.add(key, v)
    w.add("general.quantization_version", GGUFValue(ValueType.UINT32, QUANTIZATION_VERSION))
    w.add("general.file_type", GGUFValue(ValueType.UINT32, int(ft)))
    for key, v in extra:
        w.add(key, v)

    for i, (name, new) in enumerate(types.items()):
        t = f.tensors[name]
        qw = im.values.get(name) if im is not None else None
        convert = _convert(f, t, new, qw)
        if progress is not None:
            convert = _announce(progress, i, len(types), t, new, convert)
        w.add_tensor(name, convert, new, tuple(reversed(ggml_dims(t.ne))))
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
        without_imatrix=missing,
        fallbacks=fallbacks,
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
