"""The hyperparameters of a llama-family model, read and checked from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qllama.errors import ModelConfigError
from qllama.ggml_types import FLOAT_VALUE_TYPES, INTEGER_VALUE_TYPES
from qllama.gguf_reader import GGUFFile

# Llama 2/3, Mistral 7B, TinyLlama and SmolLM2 files all call themselves "llama".
LLAMA_ARCHITECTURES = ("llama",)

MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS
MAX_CONTEXT = 1 << 24
MAX_WIDTH = 1 << 20


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and constants of the model (names follow llama.cpp's GGUF keys)."""

    n_vocab: int
    n_embd: int  # residual stream width
    n_layer: int
    n_head: int  # query heads
    n_head_kv: int  # key/value heads (< n_head under grouped-query attention)
    n_ff: int  # MLP hidden width
    n_ctx: int  # context length the model was trained for
    rope_base: float
    eps: float  # RMSNorm epsilon
    arch: str = "llama"

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head."""
        return self.n_head // self.n_head_kv

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> LlamaConfig:
        """Read ``{arch}.*`` keys; every missing, mistyped or out-of-range value is a
        :class:`ModelConfigError` raised before anything is allocated from it."""
        arch = f.kv.get("general.architecture")
        if arch is None or not isinstance(arch.value, str):
            raise ModelConfigError("general.architecture is missing or not a string")
        if arch.value not in LLAMA_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported architecture '{arch.value}'; "
                f"qllama runs {', '.join(LLAMA_ARCHITECTURES)}"
            )
        a = arch.value

        def integer(key: str, low: int, high: int, default: int | None = None) -> int:
            v = f.kv.get(f"{a}.{key}")
            if v is None:
                if default is None:
                    raise ModelConfigError(f"key not found: {a}.{key}")
                return default
            if v.type not in INTEGER_VALUE_TYPES:
                raise ModelConfigError(f"key {a}.{key} has type {v.type.name}, expected an integer")
            if not low <= v.value <= high:
                raise ModelConfigError(f"key {a}.{key} is {v.value}, outside [{low}, {high}]")
            return int(v.value)

        def real(key: str, default: float | None = None) -> float:
            v = f.kv.get(f"{a}.{key}")
            if v is None:
                if default is None:
                    raise ModelConfigError(f"key not found: {a}.{key}")
                return default
            if v.type not in FLOAT_VALUE_TYPES:
                raise ModelConfigError(f"key {a}.{key} has type {v.type.name}, expected a float")
            if not (math.isfinite(v.value) and v.value > 0):
                raise ModelConfigError(f"key {a}.{key} is {v.value}, must be finite and > 0")
            return float(v.value)

        n_embd = integer("embedding_length", 1, MAX_WIDTH)
        n_head = integer("attention.head_count", 1, n_embd)
        n_head_kv = integer("attention.head_count_kv", 1, n_head, default=n_head)
        if n_embd % n_head:
            raise ModelConfigError(
                f"{a}.embedding_length {n_embd} is not a multiple of head_count {n_head}"
            )
        if n_head % n_head_kv:
            raise ModelConfigError(
                f"{a}.attention.head_count {n_head} is not a multiple of head_count_kv {n_head_kv}"
            )
        head_dim = n_embd // n_head
        if head_dim % 2:
            raise ModelConfigError(f"head dimension {head_dim} is odd; RoPE rotates pairs")
        rope_dim = integer("rope.dimension_count", 1, head_dim, default=head_dim)
        if rope_dim != head_dim:
            raise ModelConfigError(
                f"{a}.rope.dimension_count {rope_dim} != head dimension {head_dim} "
                "(partial RoPE is not supported)"
            )
        tokens = f.kv.get("tokenizer.ggml.tokens")
        n_vocab_default = (
            len(tokens.value) if tokens is not None and isinstance(tokens.value, list) else None
        )
        return cls(
            n_vocab=integer("vocab_size", 1, 1 << 24, default=n_vocab_default),
            n_embd=n_embd,
            n_layer=integer("block_count", 1, MAX_LAYERS),
            n_head=n_head,
            n_head_kv=n_head_kv,
            n_ff=integer("feed_forward_length", 1, MAX_WIDTH * 8),
            n_ctx=integer("context_length", 1, MAX_CONTEXT),
            rope_base=real("rope.freq_base", default=10000.0),
            eps=real("attention.layer_norm_rms_epsilon"),
            arch=a,
        )
