"""The llama forward pass, written once against the array API.

It runs unchanged on numpy, torch, jax and array-api-strict: it uses only ``xp`` (the
namespace of the backend) and calls the backend for the two operations that touch quantized
weights, ``matmul`` and ``embedding``. It never learns a weight's type or the arithmetic of
the backend; that is what lets one model measure several arithmetics.

RoPE follows the GGUF convention: convert_hf_to_gguf permutes the rows of Q and K so that
rotating adjacent pairs (x[2i], x[2i+1]) here equals Hugging Face's rotate_half on the
unpermuted weights (ggml_semantics §3.4; transformers undoes the permutation at load instead).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from qllama import generation
from qllama.array_api import to_numpy
from qllama.backends.base import Backend
from qllama.config import LlamaConfig
from qllama.errors import (
    ChatTemplateError,
    ContextOverflowError,
    InvalidTokenError,
    NonFiniteLogitsError,
    SequenceError,
)
from qllama.generation import Generation
from qllama.kv_cache import KVCache


@dataclass
class LayerWeights:
    """One transformer block, named as in GGUF (``blk.{i}.*``)."""

    attn_norm: Any  # (n_embd,)
    attn_q: Any  # (n_head * head_dim, n_embd)
    attn_k: Any  # (n_head_kv * head_dim, n_embd)
    attn_v: Any  # (n_head_kv * head_dim, n_embd)
    attn_output: Any  # (n_embd, n_head * head_dim)
    ffn_norm: Any  # (n_embd,)
    ffn_gate: Any  # (n_ff, n_embd)
    ffn_up: Any  # (n_ff, n_embd)
    ffn_down: Any  # (n_embd, n_ff)


@dataclass
class Weights:
    """All weights; 2-D ones as the backend prepared them, norms as float32 arrays."""

    token_embd: Any  # (n_vocab, n_embd)
    layers: list[LayerWeights]
    output_norm: Any  # (n_embd,)
    output: Any  # (n_vocab, n_embd); token_embd itself when the file ties them


# --- leaf functions -----------------------------------------------------------------------------


def rms_norm(x: Any, w: Any, eps: float, *, xp: Any) -> Any:
    """x / sqrt(mean(x^2) + eps) * w, over the last axis."""
    ms = xp.mean(x * x, axis=-1, keepdims=True)
    return x * (1.0 / xp.sqrt(ms + eps)) * w


def rope_tables(n_ctx: int, head_dim: int, base: float, *, xp: Any) -> tuple[Any, Any]:
    """cos and sin of position * theta_i, theta_i = base^(-2i/head_dim): (n_ctx, head_dim/2)."""
    exponents = xp.arange(0, head_dim, 2, dtype=xp.float32) / head_dim
    inv_freq = 1.0 / xp.pow(xp.asarray(base, dtype=xp.float32), exponents)
    angles = xp.arange(n_ctx, dtype=xp.float32)[:, None] * inv_freq[None, :]
    return xp.cos(angles), xp.sin(angles)


def rope(x: Any, cos: Any, sin: Any, *, xp: Any) -> Any:
    """Rotate adjacent pairs of x (T, H, head_dim) by the angles of its T positions."""
    T, H, D = x.shape
    pairs = xp.reshape(x, (T, H, D // 2, 2))  # (T, H, D/2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2)
    out = xp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)  # (T, H, D/2, 2)
    return xp.reshape(out, (T, H, D))


def softmax(x: Any, *, xp: Any) -> Any:
    """Softmax over the last axis, max-subtracted."""
    e = xp.exp(x - xp.max(x, axis=-1, keepdims=True))
    return e / xp.sum(e, axis=-1, keepdims=True)


def silu(x: Any, *, xp: Any) -> Any:
    return x * (1.0 / (1.0 + xp.exp(-x)))


def token_list(ids: Sequence[int] | Any) -> list[int]:
    """Token ids as a list of ints: a 1-D sequence or array of integers, nothing else (a float
    such as 1.5 is refused, not truncated to 1)."""
    seq = ids
    if not isinstance(ids, list | tuple):
        arr = to_numpy(ids)
        if arr.ndim != 1:
            raise InvalidTokenError(f"token ids must be 1-D, got shape {tuple(arr.shape)}")
        seq = arr.tolist()
    out = []
    for j, t in enumerate(seq):
        try:
            out.append(operator.index(t))
        except TypeError:
            raise InvalidTokenError(f"token[{j}] = {t!r} is not an integer") from None
    return out


# --- the model ----------------------------------------------------------------------------------


class Llama:
    """A llama model bound to a backend, owning its KV cache.

    ``forward(ids, pos)`` runs the tokens ``ids`` at positions ``pos, pos+1, ...``: the cache
    keeps positions ``< pos`` and appends the new ones; ``pos == 0`` starts a new sequence.
    """

    def __init__(
        self,
        config: LlamaConfig,
        weights: Weights,
        backend: Backend,
        *,
        n_ctx: int | None = None,
        kv_precision: str = "f32",
        trace_nonfinite: bool = False,
    ) -> None:
        self.config = config
        self.weights = weights
        self.backend = backend
        self.xp = backend.xp
        self.n_ctx = n_ctx or config.n_ctx
        self.trace_nonfinite = trace_nonfinite  # name the first layer that makes NaN or inf
        self.cache = KVCache(
            config.n_layer,
            config.n_head_kv,
            config.head_dim,
            self.xp,
            device=backend.device,
            precision=kv_precision,
        )
        # RoPE tables grow with the cache, not to n_ctx at once: a file may declare a context
        # of 2^24 positions, and tables that long would take gigabytes before any token runs
        self.rope_cos: Any = None
        self.rope_sin: Any = None
        self._rope_positions = 0
        self.tokenizer: Any = None  # set by qllama.load from the file's vocabulary
        self.chat_template: Any = None
        self.source: Any = None  # the GGUFFile the weights are views of

    def forward(
        self,
        ids: Sequence[int] | Any,
        pos: int = 0,
        *,
        all_logits: bool = False,
        observer: Callable[[str, Any], object] | None = None,
    ) -> Any:
        """Logits of the last position (vocab,), or of every position (T, vocab).

        ``observer(name, value)``, if given, sees the intermediate values named in
        :mod:`qllama.observe` as they are computed; without one nothing extra is done.
        """
        xp, c, w = self.xp, self.config, self.weights
        tokens = self._tokens(ids, pos)
        T = tokens.shape[0]
        self.cache.reset(pos)
        self.cache.reserve(pos + T)
        self._grow_rope(self.cache.capacity)
        # positions as arrays, not Python slices: shapes then stay put from token to token
        where = self.cache.slots[:T] + pos  # (T,) positions of the new tokens
        cos = xp.take(self.rope_cos, where, axis=0)  # (T, head_dim/2)
        sin = xp.take(self.rope_sin, where, axis=0)
        # causal mask over (new positions, cache slots): -inf where slot j > position i
        cols = self.cache.slots[None, :]  # (1, S)
        zero = xp.zeros_like(cols, dtype=xp.float32)
        mask = xp.where(cols > where[:, None], -float("inf"), zero)  # (T, S)
        x = self.backend.embedding(tokens, w.token_embd)  # (T, n_embd)
        if observer is not None:
            observer("embedding", x)
        for i, layer in enumerate(w.layers):
            h = rms_norm(x, layer.attn_norm, c.eps, xp=xp)
            attn = self._attention(h, layer, i, pos, cos, sin, mask, observer)
            x = x + attn
            mlp = self._mlp(rms_norm(x, layer.ffn_norm, c.eps, xp=xp), layer)
            x = x + mlp
            if observer is not None:
                observer(f"blk.{i}.attn_out", attn)
                observer(f"blk.{i}.ffn_out", mlp)
                observer(f"blk.{i}.out", x)
            if self.trace_nonfinite:
                self._check_finite(x, f"the output of layer {i}", pos)
        self.cache.length = pos + T
        if not all_logits:
            x = x[-1:, :]  # only the last position picks the next token
        logits = self.backend.matmul(rms_norm(x, w.output_norm, c.eps, xp=xp), w.output)
        if self.trace_nonfinite:
            self._check_finite(logits, "the logits", pos)
        return logits if all_logits else logits[0, :]

    def _grow_rope(self, n: int) -> None:
        """RoPE tables for positions ``< n`` (row i does not depend on n: same values)."""
        if n > self._rope_positions:
            c = self.config
            cos, sin = rope_tables(n, c.head_dim, c.rope_base, xp=self.xp)
            self.rope_cos, self.rope_sin = self.backend.asarray(cos), self.backend.asarray(sin)
            self._rope_positions = n

    def _check_finite(self, x: Any, where: str, pos: int) -> None:
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
        """Decode from ``prompt``; see :func:`qllama.generation.generate` for the options."""
        return generation.generate(self, prompt, **options)

    def stream(self, prompt: str | Sequence[int], **options: Any) -> Iterator[str]:
        """Decode from ``prompt``, yielding text as it comes (:func:`qllama.generation.stream`)."""
        return generation.stream(self, prompt, **options)

    def _attention(
        self,
        x: Any,
        layer: LayerWeights,
        i: int,
        pos: int,
        cos: Any,
        sin: Any,
        mask: Any,
        observer: Callable[[str, Any], object] | None = None,
    ) -> Any:
        xp, c, mm = self.xp, self.config, self.backend.matmul
        T, hd, n_kv, n_rep = x.shape[0], c.head_dim, c.n_head_kv, c.n_rep
        q, k, v = mm(x, layer.attn_q), mm(x, layer.attn_k), mm(x, layer.attn_v)
        if observer is not None:  # before RoPE; Q and K rows in the file's (GGUF) order
            observer(f"blk.{i}.q", q)
            observer(f"blk.{i}.k", k)
            observer(f"blk.{i}.v", v)
        q = xp.reshape(q, (T, c.n_head, hd))  # (T, n_head, hd)
        k = xp.reshape(k, (T, n_kv, hd))  # (T, n_kv, hd)
        v = xp.reshape(v, (T, n_kv, hd))  # (T, n_kv, hd)
        q, k = rope(q, cos, sin, xp=xp), rope(k, cos, sin, xp=xp)
        k, v = self.cache.update(i, pos, k, v)  # (S, n_kv, hd), S = cache capacity
        # query head h reads kv head h // n_rep: group the query heads by their kv head
        q = xp.permute_dims(
            xp.reshape(self.cache.operand(q), (T, n_kv, n_rep, hd)), (1, 2, 0, 3)
        )  # (n_kv, n_rep, T, hd)
        kt = xp.permute_dims(k, (1, 2, 0))[:, None, :, :]  # (n_kv, 1, hd, S)
        scores = xp.matmul(q, kt) * (1.0 / hd**0.5) + mask  # (n_kv, n_rep, T, S)
        p = self.cache.operand(softmax(scores, xp=xp))
        out = xp.matmul(p, xp.permute_dims(v, (1, 0, 2))[:, None, :, :])  # (n_kv, n_rep, T, hd)
        out = xp.reshape(xp.permute_dims(out, (2, 0, 1, 3)), (T, c.n_head * hd))  # (T, n_head*hd)
        return mm(out, layer.attn_output)

    def _mlp(self, x: Any, layer: LayerWeights) -> Any:
        # down(silu(gate(x)) * up(x))
        mm, xp = self.backend.matmul, self.xp
        return mm(silu(mm(x, layer.ffn_gate), xp=xp) * mm(x, layer.ffn_up), layer.ffn_down)

    def _tokens(self, ids: Sequence[int] | Any, pos: int) -> Any:
        """Check ids and positions before any work; ids as an integer array of the backend."""
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
        if not 0 <= pos <= self.cache.length:
            raise SequenceError(
                f"pos {pos} is past the cached sequence of {self.cache.length} tokens"
            )
        if pos + len(flat) > self.n_ctx:
            raise ContextOverflowError(
                f"{pos + len(flat)} tokens do not fit in the context of {self.n_ctx}",
                n_tokens=pos + len(flat),
                n_ctx=self.n_ctx,
            )
        return self.backend.asarray(flat)
