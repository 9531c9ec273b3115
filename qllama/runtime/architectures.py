"""Every architecture qllama computes, as data: which features, which keys, which tensors.

One :class:`Architecture` per value of ``general.architecture``. The forward pass
(:mod:`qllama.runtime.model`) never asks for a name; it reads the features that
:class:`qllama.runtime.config.ModelConfig` copies from here and from the file's keys. The loader
checks the file against :meth:`Architecture.tensors`, so what is checked is what is computed: a
tensor the declaration does not list is refused, not ignored.

The facts (shapes, defaults, which tensors are optional) are llama.cpp's graph builders
(``src/models/<arch>.cpp``) as shared/reference/architectures.md states them; docs/architectures.md
has the table of architecture x feature.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from qllama.errors import ModelConfigError


class Dims(Protocol):
    """The sizes the tensors' shapes are computed from: a
    :class:`~qllama.runtime.config.ModelConfig` (read from the file after this declaration)."""

    @property
    def n_vocab(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def n_head_kv(self) -> int: ...
    @property
    def n_ff(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def head_dim_v(self) -> int: ...
    @property
    def rope_dim(self) -> int: ...
    @property
    def n_expert(self) -> int: ...
    @property
    def n_ff_exp(self) -> int: ...
    @property
    def n_ff_shexp(self) -> int: ...


class RopeLayout(enum.Enum):
    """Which dimensions RoPE rotates together."""

    ADJACENT = "adjacent"  # ggml NORM: pairs (x[2i], x[2i+1]); the converter permuted Q and K
    HALVES = "halves"  # ggml NEOX: pairs (x[i], x[i + n_rot/2]), HF's rotate_half


class Activation(enum.Enum):
    """The gate's nonlinearity in act(gate(x)) * up(x)."""

    SILU = "silu"  # SwiGLU
    GELU_TANH = "gelu_tanh"  # GeGLU with the tanh approximation (gemma)


class Gating(enum.Enum):
    """How the router's logits become the experts' weights (llama.cpp's
    ``llama_expert_gating_func_type``; the GGUF enum's numbers where it has them)."""

    SOFTMAX = 1  # select on softmax(logits), weights gathered from it
    SOFTMAX_WEIGHT = 3  # select on the logits, weights a softmax over the k selected (gpt-oss)


class SharedExpert(enum.Enum):
    """An always-on expert added to the routed ones (``*_shexp`` tensors)."""

    NONE = "none"
    GATED = "gated"  # times sigmoid(x . ffn_gate_inp_shexp), spelled silu(g)/g (qwen2moe)
    UNGATED = "ungated"  # added as it is, where expert_shared_feed_forward_length > 0 (granite)


class ExpertWidth(enum.Enum):
    """Which key sizes an expert's hidden layer."""

    FFN = "ffn"  # feed_forward_length (Mixtral, olmoe, granitemoe)
    EXPERT_KEY = "expert_key"  # expert_feed_forward_length, else feed_forward_length / k (qwen)
    EXPERT_KEY_REQUIRED = "expert_key_required"  # expert_feed_forward_length (gpt-oss)


class ExpertActivation(enum.Enum):
    """The experts' gated activation."""

    FAMILY = "family"  # the architecture's own activation (SiLU): act(gate) * up
    # gpt-oss's SWIGLU_OAI: g = min(gate, 7), u = clip(up, -7, 7), g / (1 + exp(-1.702 g)) * (u + 1)
    SWIGLU_OAI = "swiglu_oai"


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts FFN (llama.cpp's ``build_moe_ffn`` as the family calls it): the
    gating, whether the top-k weights are normalised to sum 1, the shared expert, and which
    tensors are optional. Every block of such a file is a mixture (none of these families has
    dense leading layers)."""

    gating: Gating = Gating.SOFTMAX
    norm: bool = False  # expert_weights_norm, fixed per family (the key is not read)
    shared: SharedExpert = SharedExpert.NONE
    width: ExpertWidth = ExpertWidth.EXPERT_KEY
    gate_optional: bool = False  # ffn_gate_exps may be absent: act(up) alone (llama, granite)
    optional: bool = False  # the family is dense unless expert_count is set (llama)
    activation: ExpertActivation = ExpertActivation.FAMILY
    biases: bool = False  # a router bias and per-expert biases (gpt-oss)


class Norms(enum.Enum):
    """Where the RMSNorms of a block sit."""

    PRE = "pre"  # x + f(norm(x)): attn_norm, ffn_norm
    # as PRE, the FFN's norm stored as post_attention_norm (gpt-oss)
    PRE_FFN_AS_POST_ATTENTION = "pre_ffn_as_post_attention"
    SANDWICH = "sandwich"  # x + post_norm(f(norm(x))): gemma2/3
    POST = "post"  # x + post_norm(f(x)): olmo2 (no pre-norms at all)


class QKNorm(enum.Enum):
    """RMSNorm of the queries and keys before RoPE."""

    NONE = "none"
    PER_HEAD = (
        "per_head"  # over head_dim, one weight (head_dim,) shared by the heads: qwen3, gemma3
    )
    WHOLE = "whole"  # over the whole projection, weight (n_head * head_dim,): olmo2


class Output(enum.Enum):
    """Where the logits' matrix comes from."""

    OPTIONAL = "optional"  # output.weight, else token_embd (tied)
    TIED = "tied"  # always token_embd; the loader never looks for output.weight (gemma2)
    REQUIRED = "required"  # output.weight must be there (olmo2)


class Embedding(enum.Enum):
    """What multiplies the token embeddings."""

    NONE = "none"
    SQRT_EMBD = "sqrt_embd"  # sqrt(n_embd), gemma
    KEY = "key"  # {arch}.embedding_scale, granite


class QueryScale(enum.Enum):
    """The factor of the attention scores, q.k * s."""

    HEAD_DIM = "head_dim"  # 1 / sqrt(head_dim)
    GEMMA = "gemma"  # 1 / sqrt(n_embd / n_head) for the 27B layer count, else 1 / sqrt(head_dim)
    KEY = "key"  # {arch}.attention.scale if present (granite), else 1 / sqrt(head_dim)


@dataclass(frozen=True)
class Tensor:
    """A tensor of the architecture: GGUF name (``{i}`` for the block), numpy shape from the
    config, and whether the file must have it."""

    name: str
    shape: Callable[[Dims], tuple[int, ...]]
    required: bool = True
    # the model's field it fills, where not the one its name says (gpt-oss's pre-FFN norm is
    # named post_attention_norm)
    field: str | None = None

    def at(self, i: int) -> str:
        return self.name.format(i=i)


def _embd(c: Dims) -> tuple[int, ...]:
    return (c.n_embd,)


# Shapes, numpy order (rows, row length): a weight of y = x @ W.T is (outputs, inputs).
_Q = lambda c: (c.n_head * c.head_dim, c.n_embd)  # noqa: E731
_K = lambda c: (c.n_head_kv * c.head_dim, c.n_embd)  # noqa: E731
_V = lambda c: (c.n_head_kv * c.head_dim_v, c.n_embd)  # noqa: E731
_QKV = lambda c: (c.n_head * c.head_dim + c.n_head_kv * (c.head_dim + c.head_dim_v), c.n_embd)  # noqa: E731
_O = lambda c: (c.n_embd, c.n_head * c.head_dim_v)  # noqa: E731
_GATE = lambda c: (c.n_ff, c.n_embd)  # noqa: E731
_GATE_UP = lambda c: (2 * c.n_ff, c.n_embd)  # noqa: E731  gate rows first, then up
_DOWN = lambda c: (c.n_embd, c.n_ff)  # noqa: E731


_ROUTER = lambda c: (c.n_expert, c.n_embd)  # noqa: E731
_EXP_GATE = lambda c: (c.n_expert, c.n_ff_exp, c.n_embd)  # noqa: E731  (expert, out, in)
_EXP_DOWN = lambda c: (c.n_expert, c.n_embd, c.n_ff_exp)  # noqa: E731
_SH_GATE = lambda c: (c.n_ff_shexp, c.n_embd)  # noqa: E731
_SH_DOWN = lambda c: (c.n_embd, c.n_ff_shexp)  # noqa: E731


def _rows(shape: Callable[[Dims], tuple[int, ...]]) -> Callable[[Dims], tuple[int]]:
    """The shape of a weight's bias: one per output row."""
    return lambda c: (shape(c)[0],)


SEPARATE_QKV = (
    Tensor("blk.{i}.attn_q.weight", _Q),
    Tensor("blk.{i}.attn_k.weight", _K),
    Tensor("blk.{i}.attn_v.weight", _V),
    Tensor("blk.{i}.attn_q.bias", _rows(_Q), required=False),
    Tensor("blk.{i}.attn_k.bias", _rows(_K), required=False),
    Tensor("blk.{i}.attn_v.bias", _rows(_V), required=False),
)
FUSED_QKV = (
    Tensor("blk.{i}.attn_qkv.weight", _QKV),
    Tensor("blk.{i}.attn_qkv.bias", _rows(_QKV), required=False),
)
SEPARATE_GATE_UP = (
    Tensor("blk.{i}.ffn_gate.weight", _GATE),
    Tensor("blk.{i}.ffn_up.weight", _GATE),
)
FUSED_GATE_UP = (Tensor("blk.{i}.ffn_up.weight", _GATE_UP),)
FFN_BIASES = (
    Tensor("blk.{i}.ffn_gate.bias", _rows(_GATE), required=False),
    Tensor("blk.{i}.ffn_up.bias", _rows(_GATE), required=False),
    Tensor("blk.{i}.ffn_down.bias", _rows(_DOWN), required=False),
)
ATTN_OUTPUT_BIAS = (Tensor("blk.{i}.attn_output.bias", _rows(_O), required=False),)
ROPE_FREQS = (Tensor("rope_freqs.weight", lambda c: (c.rope_dim // 2,), required=False),)
OUTPUT_BIAS = (Tensor("output.bias", lambda c: (c.n_vocab,), required=False),)


def expert_tensors(e: Experts, c: Dims) -> list[Tensor]:
    """The FFN tensors of a mixture-of-experts block: router, 3-D experts, shared expert."""
    out = [
        Tensor("blk.{i}.ffn_gate_inp.weight", _ROUTER),
        Tensor("blk.{i}.ffn_gate_exps.weight", _EXP_GATE, required=not e.gate_optional),
        Tensor("blk.{i}.ffn_up_exps.weight", _EXP_GATE),
        Tensor("blk.{i}.ffn_down_exps.weight", _EXP_DOWN),
    ]
    if e.shared == SharedExpert.GATED or (e.shared == SharedExpert.UNGATED and c.n_ff_shexp):
        out += [
            Tensor("blk.{i}.ffn_gate_shexp.weight", _SH_GATE),
            Tensor("blk.{i}.ffn_up_shexp.weight", _SH_GATE),
            Tensor("blk.{i}.ffn_down_shexp.weight", _SH_DOWN),
        ]
    if e.shared == SharedExpert.GATED:
        out.append(Tensor("blk.{i}.ffn_gate_inp_shexp.weight", _embd))
    if e.biases:
        out += [
            Tensor("blk.{i}.ffn_gate_inp.bias", lambda c: (c.n_expert,)),
            Tensor("blk.{i}.ffn_gate_exps.bias", lambda c: (c.n_expert, c.n_ff_exp)),
            Tensor("blk.{i}.ffn_up_exps.bias", lambda c: (c.n_expert, c.n_ff_exp)),
            Tensor("blk.{i}.ffn_down_exps.bias", lambda c: (c.n_expert, c.n_embd)),
        ]
    return out


PRE_NORMS = (Tensor("blk.{i}.attn_norm.weight", _embd), Tensor("blk.{i}.ffn_norm.weight", _embd))
OAI_NORMS = (
    Tensor("blk.{i}.attn_norm.weight", _embd),
    Tensor("blk.{i}.post_attention_norm.weight", _embd, field="ffn_norm"),
)
ATTN_SINKS = (Tensor("blk.{i}.attn_sinks.weight", lambda c: (c.n_head,)),)
POST_NORMS = (
    Tensor("blk.{i}.post_attention_norm.weight", _embd),
    Tensor("blk.{i}.post_ffw_norm.weight", _embd),
)
QK_NORM_SHAPES = {
    QKNorm.PER_HEAD: (lambda c: (c.head_dim,), lambda c: (c.head_dim,)),
    QKNorm.WHOLE: (lambda c: (c.n_head * c.head_dim,), lambda c: (c.n_head_kv * c.head_dim,)),
}


@dataclass(frozen=True)
class Architecture:
    """One ``general.architecture``: the features of its forward pass and its tensors."""

    name: str
    rope: RopeLayout
    activation: Activation = Activation.SILU
    norms: Norms = Norms.PRE
    qk_norm: QKNorm = QKNorm.NONE
    output: Output = Output.OPTIONAL
    embedding: Embedding = Embedding.NONE
    query_scale: QueryScale = QueryScale.HEAD_DIM
    # QueryScale.GEMMA: at this layer count (the 27B model's) the scale is 1/sqrt(n_embd/n_head)
    embd_query_scale_layers: int = 0
    fused_qkv: bool | None = None  # True: only attn_qkv; None: either form (llama.cpp's default)
    fused_gate_up: bool = False  # ffn_up holds gate then up (phi3)
    q_width_is_embd: bool = False  # llama.cpp sizes Q as n_embd: head_dim must be n_embd/n_head
    partial_rotary: bool = False  # rope.dimension_count may be < head_dim
    extra_tensors: tuple[Tensor, ...] = ()  # optional per-arch tensors (biases, rope_freqs)
    # sliding-window attention: the default window (0: none unless the key says so), the
    # default pattern P (layer il slides iff il % P < P - 1), and whether only a window key
    # turns it on (gemma3) rather than the default window
    swa_window: int = 0
    swa_pattern: int = 0
    swa_needs_key: bool = False
    swa_rope_scale_one: bool = False  # sliding layers use freq_scale 1 (gemma3), not the global
    swa_rope_base_key: bool = True  # sliding layers read rope.freq_base_swa (olmo2 never does)
    # the sliding layers' base where rope.freq_base_swa is absent: 0, the global base (gemma2's
    # load_arch_hparams copies it); else this value (gemma3: llama-hparams.h's default, 10000,
    # which files converted before the converter wrote the key run with in llama.cpp)
    swa_rope_base_default: float = 0.0
    # soft-caps: None where llama.cpp does not read the key for this architecture, else the
    # default of {arch}.attn_logit_softcapping / final_logit_softcapping (0: off)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # reads {arch}.logit_scale (required: logits divided by it) and residual_scale (granite)
    scales_logits_and_residuals: bool = False
    rope_off_unless_finetuned: bool = False  # rope.scaling.finetuned = false: no RoPE (granite)
    nope_every: int = 0  # layers with (il + 1) % n skip RoPE (smollm3: 4, fixed in llama.cpp)
    refused_keys: tuple[str, ...] = ()  # keys of features qllama does not compute
    # the rope.scaling.yarn_* keys llama.cpp reads for this family (the rest keep their defaults)
    yarn_keys: tuple[str, ...] = ()
    experts: Experts | None = None  # a mixture-of-experts FFN (with expert_count, if optional)

    def tensors(self, c: Dims, *, fused_qkv: bool) -> list[Tensor]:
        """Every tensor the model may use, the per-block ones once per block."""
        block: list[Tensor] = []
        if self.norms == Norms.PRE_FFN_AS_POST_ATTENTION:
            block += OAI_NORMS
        elif self.norms != Norms.POST:
            block += PRE_NORMS
        block += FUSED_QKV if fused_qkv else SEPARATE_QKV
        if self.qk_norm != QKNorm.NONE:
            q_shape, k_shape = QK_NORM_SHAPES[self.qk_norm]
            block += [
                Tensor("blk.{i}.attn_q_norm.weight", q_shape),
                Tensor("blk.{i}.attn_k_norm.weight", k_shape),
            ]
        block.append(Tensor("blk.{i}.attn_output.weight", _O))
        if self.norms in (Norms.SANDWICH, Norms.POST):
            block += POST_NORMS
        moe = self.experts is not None and c.n_expert > 0
        if moe:
            assert self.experts is not None
            block += expert_tensors(self.experts, c)
        else:
            block += FUSED_GATE_UP if self.fused_gate_up else SEPARATE_GATE_UP
            block.append(Tensor("blk.{i}.ffn_down.weight", _DOWN))
        per_block = [t for t in self.extra_tensors if "{i}" in t.name]
        if moe:  # the dense FFN's biases have no place in a mixture
            per_block = [t for t in per_block if not t.name.startswith("blk.{i}.ffn_")]
        glob = [t for t in self.extra_tensors if "{i}" not in t.name]
        out = [Tensor("token_embd.weight", lambda c: (c.n_vocab, c.n_embd))]
        out.append(Tensor("output_norm.weight", _embd))
        if self.output != Output.TIED:
            out.append(
                Tensor(
                    "output.weight",
                    lambda c: (c.n_vocab, c.n_embd),
                    required=self.output == Output.REQUIRED,
                )
            )
        out += glob
        for i in range(c.n_layer):
            out += [Tensor(t.at(i), t.shape, t.required, t.field) for t in block + per_block]
        return out


LLAMA_OPTIONAL = ROPE_FREQS + ATTN_OUTPUT_BIAS + FFN_BIASES
# mistral3: a llama graph; its attention temperature (Ministral 3) is not computed; it reads
# YaRN's betas and log multiplier (mistral3.cpp), which the other families leave at their defaults
_YARN = (
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    "rope.scaling.yarn_log_multiplier",
)

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        # Llama 2/3.x, Mistral 7B/Nemo/Small (the converter names them "llama"), SmolLM2
        # ... and Mixtral: llama with llama.expert_count set (llama.cpp's llama.cpp graph)
        Architecture(
            "llama",
            RopeLayout.ADJACENT,
            extra_tensors=LLAMA_OPTIONAL,
            experts=Experts(norm=True, width=ExpertWidth.FFN, gate_optional=True, optional=True),
        ),
        Architecture(
            "mistral3",
            RopeLayout.ADJACENT,
            extra_tensors=LLAMA_OPTIONAL,
            refused_keys=("attention.temperature_scale",),
            yarn_keys=_YARN,
        ),
        Architecture("qwen2", RopeLayout.HALVES, q_width_is_embd=True, extra_tensors=OUTPUT_BIAS),
        Architecture("qwen3", RopeLayout.HALVES, qk_norm=QKNorm.PER_HEAD),
        Architecture(
            "phi3",
            RopeLayout.HALVES,
            fused_qkv=True,
            fused_gate_up=True,
            q_width_is_embd=True,
            partial_rotary=True,
        ),
        Architecture(
            "gemma2",
            RopeLayout.HALVES,
            activation=Activation.GELU_TANH,
            norms=Norms.SANDWICH,
            output=Output.TIED,
            embedding=Embedding.SQRT_EMBD,
            query_scale=QueryScale.GEMMA,
            embd_query_scale_layers=46,
            swa_window=4096,
            swa_pattern=2,
            attn_softcap=50.0,
            final_softcap=30.0,
        ),
        Architecture(
            "gemma3",
            RopeLayout.HALVES,
            activation=Activation.GELU_TANH,
            norms=Norms.SANDWICH,
            qk_norm=QKNorm.PER_HEAD,
            embedding=Embedding.SQRT_EMBD,
            query_scale=QueryScale.GEMMA,
            embd_query_scale_layers=62,
            swa_pattern=6,
            swa_needs_key=True,
            swa_rope_scale_one=True,
            swa_rope_base_default=10000.0,
            final_softcap=0.0,
        ),
        Architecture(
            "granite",
            RopeLayout.ADJACENT,
            embedding=Embedding.KEY,
            query_scale=QueryScale.KEY,
            extra_tensors=LLAMA_OPTIONAL,
            scales_logits_and_residuals=True,
            rope_off_unless_finetuned=True,
        ),
        Architecture(
            "olmo2",
            RopeLayout.HALVES,
            norms=Norms.POST,
            qk_norm=QKNorm.WHOLE,
            output=Output.REQUIRED,
            q_width_is_embd=True,
            # Olmo 3: a window key turns on sliding layers (every 4th global by default), rotated
            # with the global base and without the linear scale (olmo2.cpp)
            swa_pattern=4,
            swa_needs_key=True,
            swa_rope_scale_one=True,
            swa_rope_base_key=False,
        ),
        Architecture("smollm3", RopeLayout.ADJACENT, nope_every=4),
        # mixtures of experts (shared/reference/moe_kv_recipes.md 1.10)
        Architecture(
            "qwen3moe",
            RopeLayout.HALVES,
            qk_norm=QKNorm.PER_HEAD,
            experts=Experts(norm=True),
        ),
        Architecture(
            "qwen2moe",
            RopeLayout.HALVES,
            q_width_is_embd=True,
            output=Output.REQUIRED,
            experts=Experts(shared=SharedExpert.GATED),
        ),
        Architecture(
            "olmoe",
            RopeLayout.HALVES,
            qk_norm=QKNorm.WHOLE,
            output=Output.REQUIRED,
            experts=Experts(width=ExpertWidth.FFN),
        ),
        Architecture(
            "granitemoe",
            RopeLayout.ADJACENT,
            embedding=Embedding.KEY,
            query_scale=QueryScale.KEY,
            extra_tensors=ATTN_OUTPUT_BIAS,
            scales_logits_and_residuals=True,
            rope_off_unless_finetuned=True,
            experts=Experts(
                norm=True,
                shared=SharedExpert.UNGATED,
                width=ExpertWidth.FFN,
                gate_optional=True,
            ),
        ),
        # attention sinks, alternating sliding layers (even ones slide), the clamped SwiGLU,
        # biased router and experts, a softmax over the selected logits (openai-moe.cpp);
        # YaRN on every layer, the sliding ones included (their scale is the global one)
        Architecture(
            "gpt-oss",
            RopeLayout.HALVES,
            norms=Norms.PRE_FFN_AS_POST_ATTENTION,
            extra_tensors=ATTN_OUTPUT_BIAS + ATTN_SINKS,
            swa_pattern=2,
            output=Output.REQUIRED,
            experts=Experts(
                gating=Gating.SOFTMAX_WEIGHT,
                width=ExpertWidth.EXPERT_KEY_REQUIRED,
                activation=ExpertActivation.SWIGLU_OAI,
                biases=True,
            ),
        ),
    )
}

# families with experts that qllama knows of and does not compute: what each one lacks
REFUSED_ARCHITECTURES: dict[str, str] = {
    "deepseek2": "multi-head latent attention (MLA), sigmoid gating with a selection bias, "
    "grouped top-k and dense leading layers are not implemented",
    "qwen3next": "hybrid recurrent layers (gated delta net) are not implemented",
    "jamba": "hybrid recurrent (Mamba) layers are not implemented",
    "granitehybrid": "hybrid recurrent (Mamba-2) layers are not implemented",
}


def architecture(name: str) -> Architecture:
    """The declaration of ``general.architecture`` ``name``; a :class:`ModelConfigError` that
    lists what qllama runs for anything else."""
    arch = ARCHITECTURES.get(name)
    if arch is None and name in REFUSED_ARCHITECTURES:
        raise ModelConfigError(
            f"architecture '{name}' is not supported: {REFUSED_ARCHITECTURES[name]}"
        )
    if arch is None:
        raise ModelConfigError(
            f"unsupported architecture '{name}'; qllama runs {', '.join(sorted(ARCHITECTURES))}"
        )
    return arch


@dataclass(frozen=True)
class Yarn:
    """YaRN's parameters as llama.cpp hands them to ``ggml_rope_ext`` (its ext_factor is 1
    under YaRN: no family here reads the key): the context the correction dims are computed
    for, and the betas that place them."""

    n_ctx_orig: int  # rope.scaling.original_context_length, else context_length
    beta_fast: float = 32.0  # llama-hparams.h's defaults
    beta_slow: float = 1.0


@dataclass(frozen=True)
class Rope:
    """The rotation of one layer: base, linear scale (1 / rope.scaling.factor), whether the
    angles are divided by ``rope_freqs.weight`` (Llama 3.1+), the magnitude llama.cpp passes as
    attn_factor (its context's yarn_attn_factor, rope.scaling.attn_factor included) and YaRN's
    parameters where the file scales with YaRN."""

    base: float
    scale: float = 1.0
    factors: bool = False
    attn_factor: float = 1.0
    yarn: Yarn | None = None


@dataclass(frozen=True)
class LayerKind:
    """What varies from block to block: the rotation (None: no RoPE) and the window (0: all
    earlier positions)."""

    rope: Rope | None
    window: int = 0
