"""The hyperparameters of a model, read and checked from GGUF metadata.

:meth:`ModelConfig.from_gguf` reads the keys llama.cpp reads for the file's architecture
(:mod:`qllama.runtime.architectures`), with llama.cpp's defaults, and refuses any value qllama would
not compute exactly: a scaling type it does not implement (LongRoPE), a YaRN key llama.cpp
does not read for the family set to another value than llama.cpp uses, a mixture of
experts in a family declared without one, a routing it does not compute (grouped top-k, dense
leading layers, another gating), a key of a feature it lacks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from qllama.errors import ModelConfigError
from qllama.ggml_types import FLOAT_VALUE_TYPES, INTEGER_VALUE_TYPES, ValueType
from qllama.gguf.reader import GGUFFile
from qllama.runtime.architectures import (
    ARCHITECTURES,
    Architecture,
    Embedding,
    ExpertWidth,
    LayerKind,
    QueryScale,
    Rope,
    SharedExpert,
    Yarn,
    architecture,
)
from qllama.runtime.yarn import context_attn_factor, rope_mscale

MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS
MAX_CONTEXT = 1 << 24
MAX_WIDTH = 1 << 20
MAX_EXPERTS = 1024  # llama.cpp's LLAMA_MAX_EXPERTS
ROPE_SCALINGS = ("none", "linear", "yarn")  # what qllama computes of rope.scaling.type
# the YaRN keys llama.cpp leaves at these values unless the family reads them
# (Architecture.yarn_keys): a file that sets one to another value describes another model
YARN_DEFAULTS = {
    "rope.scaling.yarn_ext_factor": 1.0,
    "rope.scaling.yarn_beta_fast": 32.0,
    "rope.scaling.yarn_beta_slow": 1.0,
    "rope.scaling.yarn_log_multiplier": 0.0,
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of the model (names follow llama.cpp's GGUF keys).

    Fields left at 0 take llama.cpp's default: ``key_length`` and ``value_length`` are
    ``n_embd // n_head``, ``n_rot`` is the key length, ``attn_scale`` is
    ``1 / sqrt(head_dim)``; a softcap, embedding, residual or logit scale of 0 is off.
    """

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
    key_length: int = 0  # head_dim of queries and keys
    value_length: int = 0  # head_dim of values
    n_rot: int = 0  # rotated dimensions of a head (< head_dim: partial rotary)
    rope_scale: float = 1.0  # 1 / rope.scaling.factor (linear scaling)
    rope_freqs: bool = False  # the file has rope_freqs.weight: angles are divided by it
    layers: tuple[LayerKind, ...] = ()  # per block: rotation and window (() : all global)
    attn_scale: float = 0.0
    attn_softcap: float = 0.0  # scores -> c tanh(scores / c) before the mask
    final_softcap: float = 0.0  # logits -> c tanh(logits / c)
    embedding_scale: float = 0.0  # token embeddings times this
    residual_scale: float = 0.0  # each block's attention and MLP outputs times this
    logit_scale: float = 0.0  # logits divided by this
    # mixture of experts (0 experts: a dense FFN); the gating and the shared expert are the
    # architecture's (features.experts)
    n_expert: int = 0  # expert_count
    n_expert_used: int = 0  # expert_used_count: k of the top-k
    n_ff_exp: int = 0  # an expert's hidden width
    n_ff_shexp: int = 0  # the shared expert's hidden width (0: none)
    expert_weights_norm: bool = False  # the k weights divided by their (clamped) sum
    expert_weights_scale: float = 0.0  # then multiplied by this (0 or 1: not at all)

    @property
    def features(self) -> Architecture:
        """The declaration of this architecture."""
        return architecture(self.arch)

    @property
    def head_dim(self) -> int:
        return self.key_length or self.n_embd // self.n_head

    @property
    def head_dim_v(self) -> int:
        return self.value_length or self.n_embd // self.n_head

    @property
    def rope_dim(self) -> int:
        """Rotated dimensions per head (``rope.dimension_count``)."""
        return self.n_rot or self.head_dim

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head."""
        return self.n_head // self.n_head_kv

    @property
    def query_scale(self) -> float:
        # written as 1.0 / head_dim**0.5, the expression of the llama path since its first
        # results, so that SmolLM2's numbers stay bit for bit what they were
        return self.attn_scale or 1.0 / self.head_dim**0.5

    def layer(self, i: int) -> LayerKind:
        """Rotation and window of block ``i``."""
        if self.layers:
            return self.layers[i]
        return LayerKind(Rope(self.rope_base, self.rope_scale, self.rope_freqs))

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> ModelConfig:
        """Read ``{arch}.*`` keys; every missing, mistyped or out-of-range value is a
        :class:`ModelConfigError` raised before anything is allocated from it."""
        arch = f.kv.get("general.architecture")
        if arch is None or not isinstance(arch.value, str):
            raise ModelConfigError("general.architecture is missing or not a string")
        return _Reader(f, architecture(arch.value)).config()


class _Reader:
    """The keys of one file, read as llama.cpp reads them for its architecture."""

    def __init__(self, f: GGUFFile, a: Architecture) -> None:
        self.f, self.a, self.p = f, a, a.name

    def value(self, key: str) -> Any:
        return self.f.kv.get(f"{self.p}.{key}")

    def integer(self, key: str, low: int, high: int, default: int | None = None) -> int:
        v = self.value(key)
        if v is None:
            if default is None:
                raise ModelConfigError(f"key not found: {self.p}.{key}")
            return default
        if v.type not in INTEGER_VALUE_TYPES:
            raise ModelConfigError(
                f"key {self.p}.{key} has type {v.type.name}, expected an integer"
            )
        if not low <= v.value <= high:
            raise ModelConfigError(f"key {self.p}.{key} is {v.value}, outside [{low}, {high}]")
        return int(v.value)

    def real(self, key: str, default: float | None = None, *, positive: bool = True) -> float:
        v = self.value(key)
        if v is None:
            if default is None:
                raise ModelConfigError(f"key not found: {self.p}.{key}")
            return default
        if v.type not in FLOAT_VALUE_TYPES:
            raise ModelConfigError(f"key {self.p}.{key} has type {v.type.name}, expected a float")
        ok = math.isfinite(v.value) and (v.value > 0 if positive else v.value >= 0)
        if not ok:
            bound = "> 0" if positive else ">= 0"
            raise ModelConfigError(f"key {self.p}.{key} is {v.value}, must be finite and {bound}")
        return float(v.value)

    def typed(self, key: str, vtype: ValueType, default: Any) -> Any:
        """A string or bool key: ``default`` if absent, an error naming it if mistyped."""
        v = self.value(key)
        if v is None:
            return default
        if v.type != vtype:
            raise ModelConfigError(
                f"key {self.p}.{key} has type {v.type.name}, expected {vtype.name.lower()}"
            )
        return v.value

    def text(self, key: str, default: str) -> str:
        return str(self.typed(key, ValueType.STRING, default))

    def flag(self, key: str, default: bool) -> bool:
        return bool(self.typed(key, ValueType.BOOL, default))

    def refuse_unsupported(self) -> None:
        """Keys of features qllama does not compute: an error naming the key."""
        for key in self.a.refused_keys:
            if self.value(key) is not None:
                raise ModelConfigError(
                    f"{self.p}.{key} is set: qllama does not compute this feature of {self.p}"
                )
        scaling = self.text("rope.scaling.type", "linear")
        if scaling not in ROPE_SCALINGS:
            raise ModelConfigError(
                f"{self.p}.rope.scaling.type is '{scaling}': qllama computes "
                f"{' and '.join(ROPE_SCALINGS)} RoPE scaling only"
            )

    def rope(self, n_ctx: int) -> Rope:
        """The global layers' rotation: base, scale, rope_freqs, magnitude and YaRN, as
        llama.cpp's load_hparams and llama_context read them."""
        base = self.real("rope.freq_base", 10000.0)
        factor = self.real("rope.scaling.factor", 0.0, positive=False)
        if factor == 0.0:
            factor = self.real("rope.scale_linear", 0.0, positive=False)
        scaling = self.text("rope.scaling.type", "linear")
        scale = 1.0 if factor == 0.0 or scaling == "none" else 1.0 / factor
        factors = "rope_freqs.weight" in self.f.tensors
        attn_factor = self.real("rope.scaling.attn_factor", 1.0)
        if scaling != "yarn":
            return Rope(base, scale, factors, attn_factor)
        read = {}
        for key, default in YARN_DEFAULTS.items():  # the betas > 0, the others >= 0
            read[key] = value = self.real(key, default, positive=key.endswith(("_fast", "_slow")))
            if key not in self.a.yarn_keys and value != default:
                raise ModelConfigError(
                    f"{self.p}.{key} is {value}: llama.cpp computes {self.p}'s YaRN with "
                    f"{default} whatever the file says"
                )
        log_mul = read["rope.scaling.yarn_log_multiplier"]
        attn = context_attn_factor(scale, log_mul, attn_factor)
        self.check_yarn_magnitude(rope_mscale(context_attn_factor(scale, log_mul, 1.0), scale))
        orig = self.integer("rope.scaling.original_context_length", 0, MAX_CONTEXT, default=0)
        yarn = Yarn(
            orig or n_ctx,
            read["rope.scaling.yarn_beta_fast"],
            read["rope.scaling.yarn_beta_slow"],
        )
        return Rope(base, scale, factors, attn, yarn)

    def check_yarn_magnitude(self, computed: float) -> None:
        """``yarn_attn_factor`` (what the converter writes of transformers' attention_factor)
        is not read by llama.cpp, which computes the magnitude from the factor: a file whose
        value is another one is refused."""
        given = self.real("rope.scaling.yarn_attn_factor", computed)
        if abs(given - computed) > 1e-6 * computed:
            raise ModelConfigError(
                f"{self.p}.rope.scaling.yarn_attn_factor is {given}: llama.cpp computes "
                f"{self.p}'s YaRN magnitude as {computed:.7g} from rope.scaling.factor"
            )

    def experts(self, n_ff: int) -> dict[str, Any]:
        """The mixture-of-experts fields of the config (none for a dense model); what qllama
        does not compute of a routing is refused with its key and value."""
        p, e = self.p, self.a.experts
        n_expert = self.integer("expert_count", 0, MAX_EXPERTS, default=0)
        if e is None:
            if n_expert:
                raise ModelConfigError(
                    f"{p}.expert_count is {n_expert}: qllama computes no mixture of experts "
                    f"for {p} (it does for "
                    f"{', '.join(sorted(n for n, a in ARCHITECTURES.items() if a.experts))})"
                )
            return {}
        if n_expert == 0:
            if e.optional:
                return {}
            raise ModelConfigError(f"key not found: {p}.expert_count (or it is 0)")
        used = self.integer("expert_used_count", 1, n_expert)
        for key, dense in (
            ("expert_group_count", 1),
            ("leading_dense_block_count", 0),
            ("moe_every_n_layers", 1),
        ):
            v = self.integer(key, 0, MAX_LAYERS * MAX_EXPERTS, default=dense)
            if v > dense:
                raise ModelConfigError(
                    f"{p}.{key} is {v}: qllama computes every block of {p} as a mixture "
                    "over all experts (no groups, no dense layers)"
                )
        gating = self.integer("expert_gating_func", 0, 255, default=0)
        if gating not in (0, e.gating.value):
            raise ModelConfigError(
                f"{p}.expert_gating_func is {gating}: {p} gates with "
                f"{e.gating.name.lower()} ({e.gating.value})"
            )
        if e.width == ExpertWidth.FFN:
            width = n_ff
        else:
            fallback = n_ff // used if e.width == ExpertWidth.EXPERT_KEY else None
            width = self.integer("expert_feed_forward_length", 1, MAX_WIDTH * 8, fallback)
        shared = 0
        if e.shared != SharedExpert.NONE:
            default = n_ff if e.shared == SharedExpert.GATED else 0
            shared = self.integer("expert_shared_feed_forward_length", 0, MAX_WIDTH * 8, default)
        return {
            "n_expert": n_expert,
            "n_expert_used": used,
            "n_ff_exp": width,
            "n_ff_shexp": shared,
            "expert_weights_norm": e.norm,
        }

    def heads(self, n_embd: int) -> tuple[int, int, int, int, int]:
        """n_head, n_head_kv, key length, value length, n_rot (checked against each other)."""
        p, a = self.p, self.a
        n_head = self.integer("attention.head_count", 1, n_embd)
        n_head_kv = self.integer("attention.head_count_kv", 1, n_head, default=n_head)
        if n_head % n_head_kv:
            raise ModelConfigError(
                f"{p}.attention.head_count {n_head} is not a multiple of head_count_kv {n_head_kv}"
            )
        if self.value("attention.key_length") is None and n_embd % n_head:
            raise ModelConfigError(
                f"{p}.embedding_length {n_embd} is not a multiple of head_count {n_head}"
            )
        k_len = self.integer("attention.key_length", 1, MAX_WIDTH, default=n_embd // n_head)
        v_len = self.integer("attention.value_length", 1, MAX_WIDTH, default=n_embd // n_head)
        if a.q_width_is_embd and n_head * k_len != n_embd:
            raise ModelConfigError(
                f"{p}.attention.key_length {k_len} x head_count {n_head} != embedding_length "
                f"{n_embd}: llama.cpp's {p} sizes the query projection as n_embd"
            )
        for dim in (k_len, self.integer("rope.dimension_count", 1, MAX_WIDTH, default=k_len)):
            if dim % 2:
                raise ModelConfigError(f"head dimension {dim} is odd; RoPE rotates pairs")
        n_rot = self.integer("rope.dimension_count", 1, k_len, default=k_len)
        if n_rot != k_len and not a.partial_rotary:
            raise ModelConfigError(
                f"{p}.rope.dimension_count {n_rot} != head dimension {k_len} "
                f"(partial RoPE is not supported for {p})"
            )
        return n_head, n_head_kv, k_len, v_len, n_rot

    def layer_kinds(self, n_layer: int, rope: Rope) -> tuple:
        """Per block: the rotation (with the sliding layers' own base) and the window."""
        a = self.a
        window = self.integer("attention.sliding_window", 0, MAX_CONTEXT, default=a.swa_window)
        if a.swa_pattern == 0 or (
            a.swa_needs_key and self.value("attention.sliding_window") is None
        ):
            window = 0
        sliding = self.sliding_layers(n_layer) if window else [False] * n_layer
        swa_base = a.swa_rope_base_default or rope.base
        swa_rope = dataclasses.replace(
            rope,
            base=self.real("rope.freq_base_swa", swa_base) if a.swa_rope_base_key else rope.base,
            scale=1.0 if a.swa_rope_scale_one else rope.scale,
        )
        rope_on = not a.rope_off_unless_finetuned or self.flag("rope.scaling.finetuned", True)
        kinds = []
        for i in range(n_layer):
            kind: Rope | None = swa_rope if sliding[i] else rope
            if not rope_on or (a.nope_every and (i + 1) % a.nope_every == 0):
                kind = None
            kinds.append(LayerKind(kind, window if sliding[i] else 0))
        return tuple(kinds)

    def sliding_layers(self, n_layer: int) -> list[bool]:
        """llama.cpp's load_swa_pattern: a per-layer bool array, or a period P (layer il
        slides iff il % P < P - 1; P = 0: every layer)."""
        key = f"{self.p}.attention.sliding_window_pattern"
        v = self.value("attention.sliding_window_pattern")
        if v is not None and v.type == ValueType.ARRAY:
            if v.elem_type != ValueType.BOOL or len(v.value) != n_layer:
                raise ModelConfigError(f"key {key} must be {n_layer} bools, one per layer")
            return [bool(b) for b in np.asarray(v.value).tolist()]
        n = self.integer("attention.sliding_window_pattern", 0, MAX_LAYERS, self.a.swa_pattern)
        return [n == 0 or i % n < n - 1 for i in range(n_layer)]

    def query_scale(self, n_embd: int, n_head: int, n_layer: int) -> float:
        a = self.a
        if a.query_scale == QueryScale.GEMMA and n_layer == a.embd_query_scale_layers:
            return 1.0 / math.sqrt(n_embd // n_head)  # the 27B models (llama.cpp's rule)
        if a.query_scale == QueryScale.KEY:
            return self.real("attention.scale", 0.0, positive=False)
        return 0.0

    def softcap(self, key: str, default: float | None) -> float:
        """A soft-cap the architecture reads (0: off); 0 for one it does not."""
        return 0.0 if default is None else self.real(key, default, positive=False)

    def config(self) -> ModelConfig:
        a = self.a
        self.refuse_unsupported()
        n_embd = self.integer("embedding_length", 1, MAX_WIDTH)
        n_layer = self.integer("block_count", 1, MAX_LAYERS)
        n_head, n_head_kv, k_len, v_len, n_rot = self.heads(n_embd)
        tokens = self.f.kv.get("tokenizer.ggml.tokens")
        n_vocab_default = (
            len(tokens.value) if tokens is not None and isinstance(tokens.value, list) else None
        )
        n_ctx = self.integer("context_length", 1, MAX_CONTEXT)
        rope = self.rope(n_ctx)
        kinds = self.layer_kinds(n_layer, rope)
        plain = Rope(rope.base, rope.scale, rope.factors)  # what ModelConfig.layer() makes
        uniform = rope == plain and all(k == LayerKind(rope) for k in kinds)
        scaled = a.scales_logits_and_residuals
        emb = 0.0
        if a.embedding == Embedding.SQRT_EMBD:
            emb = math.sqrt(n_embd)
        elif a.embedding == Embedding.KEY:
            emb = self.real("embedding_scale", 0.0, positive=False)
        n_ff = self.integer("feed_forward_length", 1, MAX_WIDTH * 8)
        return ModelConfig(
            n_vocab=self.integer("vocab_size", 1, 1 << 24, default=n_vocab_default),
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            n_ff=n_ff,
            n_ctx=n_ctx,
            rope_base=rope.base,
            eps=self.real("attention.layer_norm_rms_epsilon"),
            arch=a.name,
            key_length=k_len,
            value_length=v_len,
            n_rot=n_rot,
            rope_scale=rope.scale,
            rope_freqs=rope.factors,
            layers=() if uniform else kinds,
            attn_scale=self.query_scale(n_embd, n_head, n_layer),
            attn_softcap=self.softcap("attn_logit_softcapping", a.attn_softcap),
            final_softcap=self.softcap("final_logit_softcapping", a.final_softcap),
            embedding_scale=emb,
            residual_scale=(self.real("residual_scale", 0.0, positive=False) if scaled else 0.0),
            logit_scale=self.real("logit_scale") if scaled else 0.0,
            **self.experts(n_ff),
        )
