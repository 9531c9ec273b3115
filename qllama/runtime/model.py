"""The forward pass of every architecture, written once against the array API.

It runs unchanged on numpy, torch, jax and array-api-strict: it uses only ``xp`` (the
namespace of the backend) and calls the backend for the two operations that touch quantized
weights, ``matmul`` (several at once where they share an input: ``matmuls``) and
``embedding``. It never learns a weight's type or the arithmetic of
the backend; that is what lets one model measure several arithmetics.

It never learns the architecture's name either: what differs between llama, qwen, phi3, gemma and
the rest is read from the config (:mod:`qllama.runtime.architectures`): the RoPE layout and each
layer's rotation and window, which norms and biases the weights have, the gate's activation, and the
scalars (query scale, soft-caps, embedding, residual and logit scales); and, where the file has
experts, the mixture's routing (the gating, the normalisation of the weights, the shared expert).
A mixture's products go to the backend as ggml's ``mul_mat_id`` (:func:`expert_matmuls`: up and
gate in one call, as :func:`matmuls` takes Q, K and V): which rows meet which expert is the
backend's business, as any product is.

RoPE follows the GGUF convention: convert_hf_to_gguf permutes the rows of Q and K of the
llama-style architectures so that rotating adjacent pairs (x[2i], x[2i+1]) here equals
Hugging Face's rotate_half on the unpermuted weights (ggml_semantics §3.4; transformers undoes
the permutation at load instead); the qwen, phi3, gemma and olmo2 converters leave Q and K
alone, and their files are rotated in halves.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from qllama.array_api import Array, Namespace, Weight, to_numpy
from qllama.backends.base import (
    Backend,
    attention_bytes,
    attention_scores,
    expert_matmuls,
    glue,
    matmuls,
    router_softmax,
    row_sum,
)
from qllama.errors import (
    BackendError,
    ChatTemplateError,
    ContextOverflowError,
    InvalidTokenError,
    NonFiniteLogitsError,
    SequenceError,
)
from qllama.gguf.reader import GGUFFile
from qllama.quants.base import Rounding
from qllama.runtime import generation, kv_attention, routing
from qllama.runtime import yarn as yarn_math
from qllama.runtime.architectures import (
    Activation,
    ExpertActivation,
    Experts,
    Gating,
    QKNorm,
    Rope,
    RopeLayout,
    SharedExpert,
    Yarn,
)
from qllama.runtime.chat_template import ChatTemplate
from qllama.runtime.config import ModelConfig
from qllama.runtime.generation import Generation
from qllama.runtime.kv_cache import KVCache
from qllama.runtime.scores import NEGLIGIBLE, masked_softmax, softcap, softmax
from qllama.runtime.tokenizer import Tokenizer, token_list

# sees the named intermediate values of a forward pass (qllama.runtime.observe): (name, value);
# what it returns is ignored, but at blk.{i}.experts, where an array replaces the selection
Observer = Callable[[str, Array], object]


@dataclass
class LayerWeights:
    """One transformer block, named as in GGUF (``blk.{i}.*``; ``_bias`` for ``*.bias``).

    A field is None where the architecture or the file has no such tensor: the forward pass
    skips a missing norm or bias, and reads Q, K and V from ``attn_qkv`` when the file fuses
    them. 2-D weights are as the backend prepared them, 1-D ones float32 arrays; a 3-D expert
    tensor is a tuple of its experts' 2-D slices, each as the backend prepared it.
    """

    attn_output: Weight  # (n_embd, n_head * head_dim_v)
    ffn_up: Weight = None  # (n_ff, n_embd); (2 n_ff, n_embd), gate rows first, fused (phi3)
    ffn_down: Weight = None  # (n_embd, n_ff)
    attn_q: Weight = None  # (n_head * head_dim, n_embd)
    attn_k: Weight = None  # (n_head_kv * head_dim, n_embd)
    attn_v: Weight = None  # (n_head_kv * head_dim_v, n_embd)
    attn_qkv: Weight = None  # (n_head * head_dim + n_head_kv * (head_dim + head_dim_v), n_embd)
    ffn_gate: Weight = None  # (n_ff, n_embd)
    attn_norm: Array = None  # (n_embd,)
    ffn_norm: Array = None  # (n_embd,)
    post_attention_norm: Array = None  # (n_embd,), gemma and olmo2
    post_ffw_norm: Array = None  # (n_embd,)
    attn_q_norm: Array = None  # (head_dim,) per head, or (n_head * head_dim,) whole (olmo2)
    attn_k_norm: Array = None  # (head_dim,) or (n_head_kv * head_dim,)
    attn_q_bias: Array = None  # (n_head * head_dim,)
    attn_k_bias: Array = None
    attn_v_bias: Array = None
    attn_qkv_bias: Array = None
    attn_output_bias: Array = None  # (n_embd,)
    attn_sinks: Array = None  # (n_head,): a logit per head joining each softmax's sum (gpt-oss)
    ffn_gate_bias: Array = None  # (n_ff,)
    ffn_up_bias: Array = None
    ffn_down_bias: Array = None  # (n_embd,)
    # a mixture of experts (then ffn_gate/up/down are None)
    ffn_gate_inp: Weight = None  # the router (n_expert, n_embd)
    ffn_gate_exps: tuple[Weight, ...] | None = None  # n_expert x (n_ff_exp, n_embd)
    ffn_up_exps: tuple[Weight, ...] | None = None  # n_expert x (n_ff_exp, n_embd)
    ffn_down_exps: tuple[Weight, ...] | None = None  # n_expert x (n_embd, n_ff_exp)
    ffn_gate_shexp: Weight = None  # the shared expert (n_ff_shexp, n_embd)
    ffn_up_shexp: Weight = None  # (n_ff_shexp, n_embd)
    ffn_down_shexp: Weight = None  # (n_embd, n_ff_shexp)
    ffn_gate_inp_shexp: Array = None  # (n_embd,): the shared expert's gate (qwen2moe)
    ffn_gate_inp_bias: Array = None  # (n_expert,): the router's bias (gpt-oss)
    ffn_gate_exps_bias: Array = None  # (n_expert, n_ff_exp): each expert's bias
    ffn_up_exps_bias: Array = None  # (n_expert, n_ff_exp)
    ffn_down_exps_bias: Array = None  # (n_expert, n_embd)


@dataclass
class Weights:
    """All weights; 2-D ones as the backend prepared them, 1-D ones as float32 arrays."""

    token_embd: Weight  # (n_vocab, n_embd)
    layers: list[LayerWeights]
    output_norm: Array  # (n_embd,)
    output: Weight  # (n_vocab, n_embd); token_embd itself when the file ties them
    output_bias: Array = None  # (n_vocab,), qwen2
    rope_freqs: Array = None  # (n_rot / 2,): each pair's angle is divided by its factor


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's part of :meth:`Model.forward_batch`: run ``ids`` at positions ``pos,
    pos+1, ...`` of ``cache`` (which keeps positions ``< pos``), as ``forward`` runs them on the
    model's own cache; ``all_logits`` asks for the logits of every new position."""

    cache: KVCache
    ids: Sequence[int] | Array
    pos: int = 0
    all_logits: bool = False


@dataclass
class Segment:
    """Rows ``start .. start + n - 1`` of a forward pass: one sequence's new tokens, at
    positions ``pos ..`` of its ``cache``, with the additive mask of each window over it.
    In a compiled step ``pos`` is the array (n,) of the rows' positions, data rather than a
    constant of the compiled graph (:meth:`Model.step`)."""

    cache: KVCache
    pos: int | Array
    start: int
    n: int
    masks: dict[int, Array]  # window -> (n, S), S = the cache's capacity


# --- leaf functions -----------------------------------------------------------------------------


def rms_norm(x: Array, w: Array, eps: float, *, xp: Namespace) -> Array:
    """x / sqrt(mean(x^2) + eps) * w, over the last axis."""
    ms = xp.mean(x * x, axis=-1, keepdims=True)
    return x * (1.0 / xp.sqrt(ms + eps)) * w


def rope_tables(
    n_ctx: int,
    n_rot: int,
    base: float,
    *,
    xp: Namespace,
    scale: float = 1.0,
    factors: Array = None,
    attn_factor: float = 1.0,
    yarn: Yarn | None = None,
) -> tuple[Array, Array]:
    """cos and sin of position * theta_i, theta_i = base^(-2i/n_rot) * scale / factors_i, times
    ``attn_factor``: (n_ctx, n_rot/2). ``scale`` is the linear scaling (1 / rope.scaling.factor),
    ``factors`` Llama 3.1's rope_freqs (ggml_rope_ext divides by them). Under ``yarn`` a pair
    keeps the unscaled angle in the share its ramp says and the magnitude grows by
    1 + 0.1 ln(1 / scale), as ggml's rope_yarn (:mod:`qllama.runtime.yarn`)."""
    exponents = xp.arange(0, n_rot, 2, dtype=xp.float32) / n_rot
    inv_freq = 1.0 / xp.pow(xp.asarray(base, dtype=xp.float32), exponents)
    if factors is not None:
        inv_freq = inv_freq / factors
    if yarn is not None:
        low, high = yarn_math.corr_dims(
            n_rot, yarn.n_ctx_orig, base, yarn.beta_fast, yarn.beta_slow
        )
        mix = yarn_math.ramp(low, high, n_rot // 2, xp=xp)  # (n_rot/2,), ext_factor 1
        inv_freq = inv_freq * scale * (1.0 - mix) + inv_freq * mix
        attn_factor = yarn_math.rope_mscale(attn_factor, scale)
    elif scale != 1.0:
        inv_freq = inv_freq * scale
    angles = xp.arange(n_ctx, dtype=xp.float32)[:, None] * inv_freq[None, :]
    if attn_factor == 1.0:
        return xp.cos(angles), xp.sin(angles)
    return xp.cos(angles) * attn_factor, xp.sin(angles) * attn_factor


def rope(x: Array, cos: Array, sin: Array, *, xp: Namespace) -> Array:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of x (T, H, n_rot) by the angles of its T
    positions (ggml's NORM mode; the converter permuted Q and K for it)."""
    T, H, D = x.shape
    pairs = xp.reshape(x, (T, H, D // 2, 2))  # (T, H, D/2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2)
    out = xp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)  # (T, H, D/2, 2)
    return xp.reshape(out, (T, H, D))


def rope_halves(x: Array, cos: Array, sin: Array, *, xp: Namespace) -> Array:
    """Rotate the pairs (x[i], x[i + n_rot/2]) of x (T, H, n_rot) (ggml's NEOX mode, Hugging
    Face's rotate_half)."""
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]  # (T, H, D/2) each
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2)
    return xp.concat([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)


ROTATIONS = {RopeLayout.ADJACENT: rope, RopeLayout.HALVES: rope_halves}
ROTATION_OPS = {RopeLayout.ADJACENT: "rope", RopeLayout.HALVES: "rope_halves"}  # as glue ops


def silu(x: Array, *, xp: Namespace) -> Array:
    return x * (1.0 / (1.0 + xp.exp(-x)))


def gelu_tanh(x: Array, *, xp: Namespace) -> Array:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + xp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


ACTIVATIONS = {Activation.SILU: silu, Activation.GELU_TANH: gelu_tanh}


def top_k(x: Array, k: int, *, xp: Namespace) -> Array:
    """The indices of the k largest values of each row (T, n) -> (T, k), the largest first,
    equal values by ascending index: ggml's argsort_top_k (a full descending std::sort), whose
    libstdc++ insertion sort keeps that order for rows of up to 16 (longer rows that meet a
    tie: :func:`qllama.runtime.routing.break_ties`)."""
    return xp.argsort(-x, axis=-1, stable=True)[:, :k]  # -x: exact, so ties stay ties


def gather_rows(x: Array, idx: Array, *, xp: Namespace) -> Array:
    """``x[t, idx[t, s]]`` for (T, n) values and (T, k) indices: (T, k)."""
    T, n = x.shape
    k = idx.shape[1]
    rows = xp.arange(T, dtype=idx.dtype)[:, None] * n  # (T, 1)
    flat = xp.reshape(rows + idx, (T * k,))  # (T*k,) offsets into the flattened x
    return xp.reshape(xp.take(xp.reshape(x, (T * n,)), flat, axis=0), (T, k))


def router_gate(
    logits: Array,
    gating: Gating,
    *,
    xp: Namespace,
    softmax: Callable[[Array], Array] | None = None,
) -> Array:
    """The gated values the experts are selected on (T, n_expert): the router softmax of the
    logits (``softmax``: a backend's glue op ``soft_max``, else :func:`router_softmax`), or
    the logits themselves where the weights are a softmax over the selected ones
    (SOFTMAX_WEIGHT)."""
    if gating != Gating.SOFTMAX:
        return logits
    return softmax(logits) if softmax is not None else router_softmax(logits, xp=xp)


def select_experts(
    gated: Array, k: int, *, xp: Namespace, asarray: Callable[[Any], Array]
) -> Array:
    """Each token's k experts (T, k), the best first, as llama.cpp's CPU ranks them: the
    stable top k, and past 16 experts the rows whose top k meets a tie re-ranked by
    :func:`qllama.runtime.routing.break_ties` (``asarray`` brings its numpy answer back to
    ``xp``)."""
    selected = top_k(gated, k, xp=xp)  # (T, k), the best first
    if gated.shape[-1] > routing.THRESHOLD:  # past 16, ggml's std::sort ranks ties its own way
        ranked = routing.break_ties(to_numpy(gated), to_numpy(selected))
        if ranked is not None:
            selected = asarray(ranked)
    return selected


# build_moe_ffn clamps the sum of the top-k weights from below before dividing by it
MIN_WEIGHT_SUM = 2.0**-14


def expert_weights(
    probs: Array,
    selected: Array,
    gating: Gating,
    norm: bool,
    scale: float,
    *,
    xp: Namespace,
    softmax: Callable[[Array], Array] | None = None,
    sum_rows: Callable[[Array], Array] | None = None,
) -> Array:
    """The weight of each token's selected experts (T, k), as build_moe_ffn computes it: the
    gated values of the selected experts (a softmax over the k selected logits under
    SOFTMAX_WEIGHT: ``softmax``, else :func:`router_softmax`), divided by their sum
    (``sum_rows``: a backend's glue op, ggml's ``sum_rows``, else :func:`row_sum`; at least
    2^-14) if ``norm``, times ``scale`` unless it is 0 or 1."""
    w = gather_rows(probs, selected, xp=xp)  # (T, k)
    if gating == Gating.SOFTMAX_WEIGHT:
        w = softmax(w) if softmax is not None else router_softmax(w, xp=xp)
    if norm:
        total = sum_rows(w) if sum_rows is not None else row_sum(w, xp=xp)  # (T, 1)
        w = w / xp.where(total < MIN_WEIGHT_SUM, MIN_WEIGHT_SUM, total)
    if scale not in (0.0, 1.0):
        w = w * scale
    return w


def slot_sum(y: Array, w: Array, *, xp: Namespace) -> Array:
    """Each slot's output ``y`` (T, k, n) times its weight ``w`` (T, k), the slots added one
    by one in slot order (the best expert first), as ggml's chain of adds: (T, n)."""
    y = y * w[:, :, None]  # (T, k, n)
    out = y[:, 0, :]  # (T, n)
    for s in range(1, y.shape[1]):
        out = out + y[:, s, :]
    return out


def softmax_with_sink(x: Array, sink: Array, *, xp: Namespace) -> Array:
    """Softmax over the last axis with one more logit per row, ``sink`` (broadcast against
    ``x[..., :1]``), in the sum only (gpt-oss's attention sinks: not scaled, no value)."""
    m = xp.maximum(xp.max(x, axis=-1, keepdims=True), sink)
    d = x - m
    e = xp.exp(xp.where(d < NEGLIGIBLE, -xp.inf, d))
    return e / (xp.sum(e, axis=-1, keepdims=True) + xp.exp(sink - m))


# gpt-oss's clamped SwiGLU (SWIGLU_OAI; the constants are fixed in llama.cpp's build_moe_ffn)
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0


def swiglu_oai(gate: Array, up: Array, *, xp: Namespace) -> Array:
    """min(gate, 7) / (1 + exp(-1.702 min(gate, 7))) * (clip(up, -7, 7) + 1)."""
    g = xp.where(gate > OAI_LIMIT, OAI_LIMIT, gate)
    u = xp.where(up > OAI_LIMIT, OAI_LIMIT, xp.where(up < -OAI_LIMIT, -OAI_LIMIT, up))
    return g / (1.0 + xp.exp(OAI_ALPHA * -g)) * (u + 1.0)


# --- the model ----------------------------------------------------------------------------------


class Model:
    """A model of any supported architecture bound to a backend, owning its KV cache.

    ``forward(ids, pos)`` runs the tokens ``ids`` at positions ``pos, pos+1, ...``: the cache
    keeps positions ``< pos`` and appends the new ones; ``pos == 0`` starts a new sequence.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        backend: Backend,
        *,
        tokenizer: Tokenizer,
        source: GGUFFile,
        chat_template: ChatTemplate | None = None,
        n_ctx: int | None = None,
        kv_precision: str = "f32",
        kv_rounding: Rounding = "ref",
        trace_nonfinite: bool = False,
    ) -> None:
        self.config = config
        self.features = config.features
        self.weights = weights
        self.backend = backend
        self.xp = backend.xp
        self.n_ctx = n_ctx or config.n_ctx
        self.trace_nonfinite = trace_nonfinite  # name the first layer that makes NaN or inf
        self.attention_bytes = attention_bytes(backend)  # a block of queries' scores, at most
        self.cache = KVCache(
            config.n_layer,
            config.n_head_kv,
            config.head_dim,
            self.xp,
            device=backend.device,
            precision=kv_precision,
            head_dim_v=config.head_dim_v,
            rounding=kv_rounding,
        )
        if self.cache.typed and any(w.attn_sinks is not None for w in weights.layers):
            raise BackendError(
                f"KV cache {kv_precision!r}: llama.cpp's typed caches and flash attention "
                "kernels are not computed with attention sinks (this model has them): use "
                "kv_precision f32, f16 or f16-flash"
            )
        self.kinds = [config.layer(i) for i in range(config.n_layer)]  # rotation, window
        self.windows = sorted({k.window for k in self.kinds})  # a mask each, not one a layer
        self.activation = ACTIVATIONS[self.features.activation]
        self._glue(backend)
        # RoPE tables grow with the cache, not to n_ctx at once: a file may declare a context
        # of 2^24 positions, and tables that long would take gigabytes before any token runs
        self.rope_tables: dict[Rope, tuple[Array, Array]] = {}
        self._rope_positions = 0
        self.compiled_step = self._compile(backend)
        self.tokenizer = tokenizer  # the file's vocabulary
        self.chat_template = chat_template  # the file's template, if it has one
        self.source = source  # the GGUFFile the weights are views of

    def _glue(self, backend: Backend) -> None:
        """The non-product ops of a block: the backend's own forms where it has them (the same
        numbers, in fewer dispatches; a router's ops with its arithmetic's numbers:
        :func:`qllama.backends.base.glue`), else array-API code."""
        xp, f = self.xp, self.features
        self.rms_norm = glue(backend, "rms_norm") or functools.partial(rms_norm, xp=xp)
        turn = glue(backend, ROTATION_OPS[f.rope])
        self.rotate = turn or functools.partial(ROTATIONS[f.rope], xp=xp)
        fused = glue(backend, "swiglu") if f.activation == Activation.SILU else None
        self.gated = fused or self._gated
        self.masked_softmax = glue(backend, "masked_softmax") or functools.partial(
            masked_softmax, xp=xp
        )
        self.attention = glue(backend, "attention") or self._attention_xp
        # a router's softmax and weight sum: under the CPU arithmetic ggml's exps and double sums
        self.gate_softmax = glue(backend, "soft_max") or functools.partial(router_softmax, xp=xp)
        self.gate_sum = glue(backend, "sum_rows") or functools.partial(row_sum, xp=xp)
        self.route = glue(backend, "route")  # the steps above in one call, or None
        self.slot_sum = glue(backend, "slot_sum") or functools.partial(slot_sum, xp=xp)

    def _compile(self, backend: Backend) -> Callable[[Array, Array], Array] | None:
        """The backend's compiled form of :meth:`step` (its class's ``compile_step(step,
        persistent)``; None where it has none or compiles none here). Its shapes must not change
        from token to token: the cache is then fixed at the context's length (RoPE tables too),
        and ``persistent()`` names the arrays that keep their addresses from call to call."""
        own = getattr(type(backend), "compile_step", None)
        step = None if own is None else own(backend, self.step, self._persistent)
        if step is not None:
            self.cache.fix(self.n_ctx)
            self._grow_rope(self.cache.capacity)
        return step

    def _persistent(self) -> tuple[Any, ...]:
        """What a compiled step reads that lives from call to call: the weights, the fixed
        cache's arrays and positions, the RoPE tables."""
        c = self.cache
        return (self.weights, c.k, c.v, c.slots, tuple(self.rope_tables.values()))

    def forward(
        self,
        ids: Sequence[int] | Array,
        pos: int = 0,
        *,
        all_logits: bool = False,
        observer: Observer | None = None,
    ) -> Array:
        """Logits of the last position (vocab,), or of every position (T, vocab).

        ``observer(name, value)``, if given, sees the intermediate values named in
        :mod:`qllama.runtime.observe` as they are computed; without one nothing extra is done.
        """
        tokens = self.backend.asarray(self._check_ids(ids, pos, self.cache))
        if self.compiled_step is not None and self._compiled(tokens.shape[0], observer):
            self.cache.reset(pos)
            logits = self.compiled_step(tokens, self.cache.slots[:1] + pos)  # (1, vocab)
            self.cache.length = pos + 1
            return logits if all_logits else logits[0, :]
        segment, where = self._segment(self.cache, pos, tokens.shape[0], 0)
        self._grow_rope(self.cache.capacity)
        x = self._hidden(tokens, where, [segment], observer)
        self.cache.length = pos + tokens.shape[0]
        if not all_logits:
            x = x[-1:, :]  # only the last position picks the next token
        logits = self._logits(x)
        if self.trace_nonfinite:
            self._check_finite(logits, "the logits", pos)
        return logits if all_logits else logits[0, :]

    def step(self, tokens: Array, where: Array) -> Array:
        """The logits (1, vocab) of one token (1,) at position ``where`` (1,) of the model's
        own cache, as :meth:`forward` computes them: what a backend compiles
        (:meth:`_compile`). The position is an array, so that it is data of the compiled
        graph and not a constant, and the cache's capacity is fixed: nothing the graph
        depends on changes from token to token."""
        masks = self._masks(where, self.cache)  # window -> (1, S)
        return self._logits(self._hidden(tokens, where, [Segment(self.cache, where, 0, 1, masks)]))

    def _compiled(self, n: int, observer: Observer | None) -> bool:
        """Whether a pass of ``n`` tokens on the model's cache may run the compiled step: one
        token on the cache it was compiled for (not one swapped in, as qllama.hf's rows), and
        nothing that looks inside the pass (an observer, the trace of non-finite values)."""
        return n == 1 and self.cache.fixed and observer is None and not self.trace_nonfinite

    def new_cache(self) -> KVCache:
        """An empty KV cache shaped for this model (one per sequence of :meth:`forward_batch`)."""
        c = self.config
        return KVCache(
            c.n_layer,
            c.n_head_kv,
            c.head_dim,
            self.xp,
            device=self.backend.device,
            precision=self.cache.precision,
            head_dim_v=c.head_dim_v,
            rounding=self.cache.rounding,
        )

    def forward_batch(self, steps: Sequence[SequenceStep]) -> list[Array]:
        """One forward pass over several sequences, each at its own position in its own cache.

        Every row-wise operation (embedding, norms, the projections, the MLP, the output
        product) runs once over the new tokens of all sequences stacked as rows; attention runs
        per sequence over its own cache, as :meth:`forward` runs it. Returns, per step, the
        logits of its last position (vocab,) or, with ``all_logits``, of every new position
        (T, vocab). What the batch does to a sequence's numbers: the CPU arithmetic quantizes
        each activation row by itself and sums integer products exactly, so a quantized weight's
        product is bit for bit the same whatever the other rows; float products (F32/F16
        weights, the GPU arithmetic, dequantize-all) may be summed in another order by the
        library's matmul for another number of rows (tests/test_serve_batch.py).
        """
        if not steps:
            return []
        if len({id(s.cache) for s in steps}) != len(steps):
            raise SequenceError("two sequences of one batch share a KV cache")
        checked = [self._check_ids(s.ids, s.pos, s.cache) for s in steps]  # all before any work
        flat: list[int] = []
        segments, wheres = [], []
        for s, ids in zip(steps, checked, strict=True):
            segment, where = self._segment(s.cache, s.pos, len(ids), len(flat))
            segments.append(segment)
            wheres.append(where)
            flat += ids
        self._grow_rope(max(s.cache.capacity for s in steps))
        xp = self.xp
        where = wheres[0] if len(wheres) == 1 else xp.concat(wheres, axis=0)  # (N,)
        x = self._hidden(self.backend.asarray(flat), where, segments)  # (N, n_embd)
        for s, ids in zip(steps, checked, strict=True):
            s.cache.length = s.pos + len(ids)
        # the output product only for the rows whose logits are wanted
        rows = [
            (g.start, g.start + g.n) if s.all_logits else (g.start + g.n - 1, g.start + g.n)
            for s, g in zip(steps, segments, strict=True)
        ]
        picked = [x[a:b, :] for a, b in rows]
        logits = self._logits(picked[0] if len(picked) == 1 else xp.concat(picked, axis=0))
        out, at = [], 0
        for j, (s, (a, b)) in enumerate(zip(steps, rows, strict=True)):
            part = logits[at : at + b - a, :]  # (b - a, vocab)
            if self.trace_nonfinite:
                first = s.pos + a - segments[j].start  # the position of the part's first row
                self._check_finite(part, f"the logits (sequence {j})", first)
            out.append(part if s.all_logits else part[0, :])
            at += b - a
        return out

    def _segment(self, cache: KVCache, pos: int, n: int, start: int) -> tuple[Segment, Array]:
        """Make room in ``cache`` for ``n`` tokens at ``pos``; their rows' positions (n,) and
        the masks of every window over the cache."""
        cache.reset(pos)
        cache.reserve(pos + n)
        # positions as arrays, not Python slices: shapes then stay put from token to token
        where = cache.slots[:n] + pos  # (n,) positions of the new tokens
        return Segment(cache, pos, start, n, self._masks(where, cache)), where

    def _masks(self, where: Array, cache: KVCache) -> dict[int, Array]:
        """The additive mask (n, S) of every window the layers use, for rows at positions
        ``where`` (n,) over ``cache``."""
        return {w: self._mask(where, w, cache) for w in self.windows}

    def _hidden(
        self, tokens: Array, where: Array, segments: list[Segment], observer: Observer | None = None
    ) -> Array:
        """The residual stream after the last block (N, n_embd) for tokens (N,) at positions
        ``where`` (N,), the rows of ``segments`` in order; ``observer`` as in :meth:`forward`."""
        xp, c, w = self.xp, self.config, self.weights
        angles = {  # each rotation's (cos, sin) at these positions: (N, n_rot/2) each
            r: (xp.take(cos, where, axis=0), xp.take(sin, where, axis=0))
            for r, (cos, sin) in self.rope_tables.items()
        }
        x = self.backend.embedding(tokens, w.token_embd)  # (N, n_embd)
        if c.embedding_scale:
            x = x * c.embedding_scale
        if observer is not None:
            observer("embedding", x)
        for i, layer in enumerate(w.layers):
            kind = self.kinds[i]
            rot = None if kind.rope is None else angles[kind.rope]
            x = self._block(x, layer, i, rot, segments, kind.window, observer)
            if observer is not None:
                observer(f"blk.{i}.out", x)
            if self.trace_nonfinite:
                for b, g in enumerate(segments):
                    rows = x if len(segments) == 1 else x[g.start : g.start + g.n, :]
                    what = f"the output of layer {i}"
                    if len(segments) > 1:
                        what += f" (sequence {b})"
                    self._check_finite(rows, what, g.pos)
        return x

    def _block(
        self,
        x: Array,
        layer: LayerWeights,
        i: int,
        rot: Array,
        segments: list[Segment],
        window: int,
        observer: Observer | None = None,
    ) -> Array:
        """One transformer block: attention, then MLP, each added to the residual stream
        (normed before, after, or both, as the weights have norms)."""
        h = self._attention(
            self._norm(x, layer.attn_norm), layer, i, rot, segments, window, observer
        )
        if observer is not None:
            observer(f"blk.{i}.attn_out", h)
        x = x + self._residual(self._norm(h, layer.post_attention_norm))
        h = self._ffn(self._norm(x, layer.ffn_norm), layer, i, observer)
        if observer is not None:
            observer(f"blk.{i}.ffn_out", h)
        return x + self._residual(self._norm(h, layer.post_ffw_norm))

    def _norm(self, x: Array, w: Array) -> Array:
        """RMSNorm with weight ``w``; ``x`` itself where the block has no such norm."""
        return x if w is None else self.rms_norm(x, w, self.config.eps)

    def _residual(self, h: Array) -> Array:
        """A sublayer's output as it joins the residual stream (granite scales it)."""
        scale = self.config.residual_scale
        return h * scale if scale else h

    def _linear(self, x: Array, w: Array, bias: Array = None) -> Array:
        y = self.backend.matmul(x, w)
        return y if bias is None else y + bias

    def _linears(self, x: Array, *pairs: tuple[Array, Array]) -> list[Array]:
        """Several products of one input, (weight, bias or None) each, in one backend call."""
        ys = matmuls(self.backend, x, [w for w, _ in pairs])
        return [y if b is None else y + b for y, (_, b) in zip(ys, pairs, strict=True)]

    def _logits(self, x: Array) -> Array:
        """Final norm, output matrix (+ bias), then the architecture's logit scalars."""
        c, w = self.config, self.weights
        logits = self._linear(self._norm(x, w.output_norm), w.output, w.output_bias)
        if c.logit_scale:
            logits = logits / c.logit_scale
        if c.final_softcap:
            logits = softcap(logits, c.final_softcap, xp=self.xp)
        return logits

    def _mask(self, where: Array, window: int, cache: KVCache) -> Array:
        """Additive mask over (new positions, cache slots): -inf where slot j is after
        position i, or (sliding layers) ``window`` or more positions before it."""
        xp = self.xp
        cols = cache.slots[None, :]  # (1, S)
        zero = xp.zeros_like(cols, dtype=xp.float32)
        hidden = cols > where[:, None]  # (T, S)
        if window:
            hidden = hidden | (where[:, None] - cols >= window)
        return xp.where(hidden, -float("inf"), zero)

    def _grow_rope(self, n: int) -> None:
        """RoPE tables of every rotation the layers use, for positions ``< n`` (row i does
        not depend on n: same values)."""
        if n > self._rope_positions:
            c, xp = self.config, self.xp
            factors = self.weights.rope_freqs
            tables = {}
            for r in {k.rope for k in self.kinds if k.rope is not None}:
                cos, sin = rope_tables(
                    n,
                    c.rope_dim,
                    r.base,
                    xp=xp,
                    scale=r.scale,
                    factors=factors if r.factors else None,
                    attn_factor=r.attn_factor,
                    yarn=r.yarn,
                )
                tables[r] = (self.backend.asarray(cos), self.backend.asarray(sin))
            self.rope_tables = tables
            self._rope_positions = n

    def _check_finite(self, x: Array, where: str, pos: int) -> None:
        """Raise at the first non-finite value, naming where and at which position."""
        xp = self.xp
        bad = ~xp.all(xp.isfinite(x), axis=-1)  # (T,)
        if bool(xp.any(bad)):
            first = int(to_numpy(bad).argmax())
            raise NonFiniteLogitsError(f"{where} is NaN or infinite at position {pos + first}")

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Render the file's chat template and encode it: the prompt ids of a conversation."""
        if self.chat_template is None:
            raise ChatTemplateError("the model file has no tokenizer.chat_template")
        return self.chat_template.encode(
            messages, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def generate(self, prompt: str | Sequence[int], **options: Any) -> Generation:
        """Decode from ``prompt`` (:func:`qllama.runtime.generation.generate` has the options)."""
        return generation.generate(self, prompt, **options)

    def stream(self, prompt: str | Sequence[int], **options: Any) -> Iterator[str]:
        """Decode from ``prompt``, yielding text as it comes
        (:func:`qllama.runtime.generation.stream`)."""
        return generation.stream(self, prompt, **options)

    def _attention(
        self,
        x: Array,
        layer: LayerWeights,
        i: int,
        rot: Array,
        segments: list[Segment],
        window: int,
        observer: Observer | None = None,
    ) -> Array:
        xp, c = self.xp, self.config
        T, hd, hd_v, n_kv = x.shape[0], c.head_dim, c.head_dim_v, c.n_head_kv
        q, k, v = self._qkv(x, layer)  # (T, n_head*hd), (T, n_kv*hd), (T, n_kv*hd_v)
        if observer is not None:  # before norms and RoPE; Q and K rows in the file's order
            observer(f"blk.{i}.q", q)
            observer(f"blk.{i}.k", k)
            observer(f"blk.{i}.v", v)
        if layer.attn_q_norm is not None:
            q = self._qk_norm(q, layer.attn_q_norm, c.n_head)
            k = self._qk_norm(k, layer.attn_k_norm, n_kv)
        q = xp.reshape(q, (T, c.n_head, hd))  # (T, n_head, hd)
        k = xp.reshape(k, (T, n_kv, hd))  # (T, n_kv, hd)
        v = xp.reshape(v, (T, n_kv, hd_v))  # (T, n_kv, hd_v)
        if rot is not None:  # None: a layer without RoPE (smollm3's every fourth)
            q, k = self._rope(q, rot), self._rope(k, rot)
        sinks = layer.attn_sinks  # None but in gpt-oss
        if len(segments) == 1:
            out = self._attend(q, k, v, i, segments[0], window, sinks)
        else:  # each sequence attends over its own cache: rows start..start+n of the batch
            out = xp.concat(
                [
                    self._attend(
                        q[g.start : g.start + g.n, ...],
                        k[g.start : g.start + g.n, ...],
                        v[g.start : g.start + g.n, ...],
                        i,
                        g,
                        window,
                        sinks,
                    )
                    for g in segments
                ],
                axis=0,
            )  # (T, n_head*hd_v)
        return self._linear(out, layer.attn_output, layer.attn_output_bias)

    def _attend(
        self,
        q: Array,
        k: Array,
        v: Array,
        i: int,
        segment: Segment,
        window: int,
        sinks: Array = None,
    ) -> Array:
        """One sequence's attention: its queries (T, n_head, hd) over its cache, after writing
        its keys (T, n_kv, hd) and values (T, n_kv, hd_v) there; (T, n_head*hd_v)."""
        xp, c = self.xp, self.config
        T, cache = q.shape[0], segment.cache
        k, v = cache.update(i, segment.pos, k, v)  # (n_kv, S, hd), S = cache capacity
        mask = segment.masks[window]  # (T, S)
        # a block of queries at a time, whose scores take at most attention_bytes: in cache
        # on a CPU, and bounded for a long prompt (a row's numbers are its own, but BLAS may
        # choose another kernel, and round otherwise, for another block's shape)
        rows = max(1, self.attention_bytes // (4 * c.n_head * k.shape[1]))
        blocks = [(a, min(a + rows, T)) for a in range(0, T, rows)]
        if cache.typed:  # llama.cpp's typed caches and flash attention kernels (numpy)
            read = functools.partial(
                kv_attention.attend,
                cache,
                i,
                queries=T,
                cells=segment.pos + T,
                scale=c.query_scale,
                softcap=c.attn_softcap or 0.0,
            )
            parts = [read(q[a:b, ...], mask[a:b, ...]) for a, b in blocks]
        else:
            parts = [
                self._attend_rows(q[a:b, ...], k, v, mask[a:b, ...], cache, sinks)
                for a, b in blocks
            ]
        return parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)  # (T, n_head*hd_v)

    def _attend_rows(
        self, q: Array, k: Array, v: Array, mask: Array, cache: KVCache, sinks: Array = None
    ) -> Array:
        """Queries (t, n_head, hd) over keys (n_kv, S, hd) and values (n_kv, S, hd_v) under
        ``mask`` (t, S), with a sink logit per head (n_head,) where the model has them;
        (t, n_head*hd_v)."""
        c = self.config
        if sinks is None and not c.attn_softcap and cache.float_operands:
            return self.attention(q, k, v, mask, c.query_scale)  # the backend's, if it has one
        return self._attention_xp(q, k, v, mask, c.query_scale, cache, sinks)

    def _attention_xp(
        self,
        q: Array,
        k: Array,
        v: Array,
        mask: Array,
        scale: float,
        cache: KVCache | None = None,
        sinks: Array = None,
    ) -> Array:
        """:meth:`_attend_rows` in array-API code (``cache`` rounds the operands where its
        precision says so; None: float32 operands)."""
        xp, c = self.xp, self.config
        operand = (lambda a: a) if cache is None else cache.operand
        t, hd, n_kv, n_rep, S = q.shape[0], c.head_dim, c.n_head_kv, c.n_rep, k.shape[1]
        # query head h reads kv head h // n_rep: one product per kv head over its query heads
        q = xp.reshape(
            xp.permute_dims(xp.reshape(operand(q), (t, n_kv, n_rep, hd)), (1, 2, 0, 3)),
            (n_kv, n_rep * t, hd),
        )  # (n_kv, n_rep*t, hd)
        scores = attention_scores(self.backend, q, k)  # (n_kv, n_rep*t, S)
        scores = xp.reshape(scores, (n_kv, n_rep, t, S))  # (n_kv, n_rep, t, S)
        if sinks is None and not c.attn_softcap:
            p = self.masked_softmax(scores, scale, mask)  # (n_kv, n_rep, t, S)
        else:
            scores = scores * scale
            if c.attn_softcap:
                scores = softcap(scores, c.attn_softcap, xp=xp)
            if sinks is None:
                p = softmax(scores + mask, xp=xp)  # (n_kv, n_rep, t, S)
            else:  # query head h = kv * n_rep + r has sink h
                sink = xp.reshape(sinks, (n_kv, n_rep, 1, 1))  # (n_kv, n_rep, 1, 1)
                p = softmax_with_sink(scores + mask, sink, xp=xp)
        p = operand(p)
        out = xp.matmul(xp.reshape(p, (n_kv, n_rep * t, S)), v)  # (n_kv, n_rep*t, hd_v)
        out = xp.reshape(out, (n_kv, n_rep, t, c.head_dim_v))  # (n_kv, n_rep, t, hd_v)
        return xp.reshape(
            xp.permute_dims(out, (2, 0, 1, 3)), (t, c.n_head * c.head_dim_v)
        )  # (t, n_head*hd_v)

    def _qkv(self, x: Array, layer: LayerWeights) -> tuple[Array, Array, Array]:
        """Queries, keys and values: three products, or one of the fused attn_qkv cut in
        three (rows Q, then K, then V)."""
        if layer.attn_qkv is None:
            q, k, v = self._linears(
                x,
                (layer.attn_q, layer.attn_q_bias),
                (layer.attn_k, layer.attn_k_bias),
                (layer.attn_v, layer.attn_v_bias),
            )
            return q, k, v
        c = self.config
        qkv = self._linear(x, layer.attn_qkv, layer.attn_qkv_bias)  # (T, q + k + v widths)
        n_q, n_k = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        return qkv[:, :n_q], qkv[:, n_q : n_q + n_k], qkv[:, n_q + n_k :]

    def _qk_norm(self, y: Array, w: Array, n_heads: int) -> Array:
        """RMSNorm of queries or keys (T, n_heads * hd): per head, or over the whole
        projection (olmo2), as the architecture says."""
        if self.features.qk_norm == QKNorm.WHOLE:
            return self._norm(y, w)
        T, hd = y.shape[0], self.config.head_dim
        heads = self._norm(self.xp.reshape(y, (T, n_heads, hd)), w)  # (T, n_heads, hd)
        return self.xp.reshape(heads, (T, n_heads * hd))

    def _rope(self, x: Array, rot: tuple[Array, Array]) -> Array:
        """RoPE on x (T, H, hd): the first n_rot dimensions rotate, the rest pass (phi3's
        partial rotary)."""
        n_rot = self.config.rope_dim
        if n_rot == x.shape[-1]:
            return self.rotate(x, *rot)
        turned = self.rotate(x[..., :n_rot], *rot)
        return self.xp.concat([turned, x[..., n_rot:]], axis=-1)

    def _ffn(
        self, x: Array, layer: LayerWeights, i: int, observer: Observer | None = None
    ) -> Array:
        """The block's feed-forward part: a mixture of experts where the layer has a router,
        else the dense MLP."""
        if layer.ffn_gate_inp is None:
            return self._mlp(x, layer)
        return self._moe(x, layer, i, observer)

    def _moe(
        self, x: Array, layer: LayerWeights, i: int, observer: Observer | None = None
    ) -> Array:
        """build_moe_ffn (shared/reference/moe_kv_recipes.md 1.2): route, weigh, the k experts'
        SwiGLU products, summed in slot order (the best expert first); then the shared
        expert."""
        xp, e = self.xp, self.features.experts
        assert e is not None  # a router is declared only with experts
        logits = self._linear(x, layer.ffn_gate_inp, layer.ffn_gate_inp_bias)  # (T, n_expert)
        if observer is not None:
            observer(f"blk.{i}.router", logits)
        selected, weights = self._route(logits, i, observer)  # (T, k) each
        flat = xp.reshape(selected, (-1,))  # (T*k,) for the experts' biases
        if layer.ffn_gate_exps is None:  # no gate: the activation of up alone
            (up,) = self._experts(x, selected, flat, (layer.ffn_up_exps, layer.ffn_up_exps_bias))
            h = self.activation(up, xp=xp)
        else:
            up, gate = self._experts(
                x,
                selected,
                flat,
                (layer.ffn_up_exps, layer.ffn_up_exps_bias),
                (layer.ffn_gate_exps, layer.ffn_gate_exps_bias),
            )  # (T, k, n_ff_exp) each
            if e.activation == ExpertActivation.SWIGLU_OAI:
                h = swiglu_oai(gate, up, xp=xp)
            else:
                h = self.gated(gate, up)  # (T, k, n_ff_exp)
        (down,) = self._experts(
            h, selected, flat, (layer.ffn_down_exps, layer.ffn_down_exps_bias)
        )  # (T, k, n_embd)
        out = self.slot_sum(down, weights)  # (T, n_embd)
        if layer.ffn_up_shexp is not None:  # after the routed experts, as llama.cpp adds it
            out = out + self._shared_expert(x, layer, e)
        return out

    def _route(self, logits: Array, i: int, observer: Observer | None) -> tuple[Array, Array]:
        """Block ``i``'s routing of its router logits (T, n_expert): each token's k experts
        (T, k), the best first, and their weights (T, k). The backend's one call where it has
        one (``route``, the same numbers) and no observer looks between the steps; else step
        by step: the gated values, the top k (an observer may replace it), the weights."""
        xp, c = self.xp, self.config
        e = self.features.experts
        assert e is not None  # a router is declared only with experts
        k = c.n_expert_used
        if self.route is not None and observer is None:
            routed = self.route(
                logits,
                k,
                e.gating == Gating.SOFTMAX,
                c.expert_weights_norm,
                c.expert_weights_scale,
                MIN_WEIGHT_SUM,
                routing.THRESHOLD,
            )
            if routed is not None:  # None: a NaN, or a tie the steps below rank
                return routed
        probs = router_gate(logits, e.gating, xp=xp, softmax=self.gate_softmax)
        selected = select_experts(probs, k, xp=xp, asarray=self.backend.asarray)  # (T, k)
        if observer is not None:  # an observer may route otherwise (a counterfactual)
            forced = observer(f"blk.{i}.experts", selected)
            if forced is not None:
                selected = self._forced_selection(forced, selected.shape, i)
        weights = expert_weights(
            probs,
            selected,
            e.gating,
            c.expert_weights_norm,
            c.expert_weights_scale,
            xp=xp,
            softmax=self.gate_softmax,
            sum_rows=self.gate_sum,
        )  # (T, k)
        return selected, weights

    def _forced_selection(self, forced: Any, shape: tuple[int, ...], i: int) -> Array:
        """An observer's replacement for block ``i``'s selection, checked: (T, k) experts of
        this model."""
        xp, n = self.xp, self.config.n_expert
        got = self.backend.asarray(forced)
        if tuple(got.shape) != tuple(shape) or not xp.isdtype(got.dtype, "integral"):
            raise SequenceError(
                f"blk.{i}.experts: a forced selection must be integers of shape {tuple(shape)}, "
                f"not {got.dtype} {tuple(got.shape)}"
            )
        if bool(xp.any(got < 0)) or bool(xp.any(got >= n)):
            raise SequenceError(f"blk.{i}.experts: a forced expert is outside [0, {n})")
        return got

    def _experts(
        self, x: Array, selected: Array, flat: Array, *pairs: tuple[Any, Array]
    ) -> list[Array]:
        """Each token's products with its selected experts (T, k, rows) for each (expert
        tensor, bias or None) of one input, in one backend call; plus each selected expert's
        bias row where the file has biases (ggml_add_id)."""
        ys = expert_matmuls(self.backend, x, [ws for ws, _ in pairs], selected)
        xp = self.xp
        return [
            y if b is None else y + xp.reshape(xp.take(b, flat, axis=0), y.shape)
            for y, (_, b) in zip(ys, pairs, strict=True)
        ]

    def _shared_expert(self, x: Array, layer: LayerWeights, e: Experts) -> Array:
        """The always-on expert (T, n_embd); qwen2moe's is gated by silu(g)/g, llama.cpp's
        spelling of sigmoid(g), g = x . ffn_gate_inp_shexp (NaN where g is 0, as there)."""
        xp = self.xp
        gate, up = self._linears(x, (layer.ffn_gate_shexp, None), (layer.ffn_up_shexp, None))
        sh = self._linear(self.gated(gate, up), layer.ffn_down_shexp)  # (T, n_embd)
        if e.shared != SharedExpert.GATED:
            return sh
        g = xp.matmul(x, layer.ffn_gate_inp_shexp[:, None])  # (T, 1)
        return sh * (silu(g, xp=xp) / g)

    def _mlp(self, x: Array, layer: LayerWeights) -> Array:
        # down(act(gate(x)) * up(x)); phi3's ffn_up holds gate and up, gate in the first half
        if self.features.fused_gate_up:
            gate_up = self._linear(x, layer.ffn_up, layer.ffn_up_bias)  # (T, 2 n_ff)
            gate, up = gate_up[:, : self.config.n_ff], gate_up[:, self.config.n_ff :]
        else:
            gate, up = self._linears(
                x, (layer.ffn_gate, layer.ffn_gate_bias), (layer.ffn_up, layer.ffn_up_bias)
            )
        return self._linear(self.gated(gate, up), layer.ffn_down, layer.ffn_down_bias)

    def _gated(self, gate: Array, up: Array) -> Array:
        """act(gate) * up, in array-API code."""
        return self.activation(gate, xp=self.xp) * up

    def _check_ids(self, ids: Sequence[int] | Array, pos: int, cache: KVCache) -> list[int]:
        """Check ids and positions against ``cache`` before any work; the ids as ints."""
        flat = token_list(ids)
        if not flat:
            raise InvalidTokenError("no tokens to run (empty prompt)")
        try:
            pos = operator.index(pos)
        except TypeError:
            raise SequenceError(f"pos must be an integer, not {pos!r}") from None
        bad = [(j, t) for j, t in enumerate(flat) if not 0 <= t < self.config.n_vocab]
        if bad:
            j, t = bad[0]
            raise InvalidTokenError(f"token[{j}] = {t} is outside [0, {self.config.n_vocab})")
        if not 0 <= pos <= cache.length:
            raise SequenceError(f"pos {pos} is past the cached sequence of {cache.length} tokens")
        if pos + len(flat) > self.n_ctx:
            raise ContextOverflowError(
                f"{pos + len(flat)} tokens do not fit in the context of {self.n_ctx}",
                n_tokens=pos + len(flat),
                n_ctx=self.n_ctx,
            )
        return flat
