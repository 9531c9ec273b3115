"""Greedy and sampled decoding on top of a model's ``forward``.

Prefill runs the prompt in one forward pass; then one token per step at the next position
(the KV cache holds the rest). Sampling happens in numpy on the logits of the step, so every
backend samples identically for a seed. Text streams out as it becomes complete UTF-8.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from qllama.array_api import to_numpy
from qllama.errors import ContextOverflowError, NonFiniteLogitsError, QllamaError
from qllama.runtime.tokenizer import Tokenizer, token_list


class Decoder(Protocol):
    """What decoding needs of a model (:class:`qllama.runtime.model.Model` is one): its
    context, its tokenizer, and ``forward`` appending tokens at a position of its cache."""

    @property
    def n_ctx(self) -> int: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    def forward(self, ids: Sequence[int], pos: int = 0) -> Any: ...


class SamplingError(QllamaError):
    """A sampling parameter is out of range."""


@dataclass(frozen=True)
class Sampler:
    """Greedy when ``temperature == 0``; else softmax(logits / T) cut to the ``top_k`` most
    likely tokens (0: all) and to the smallest set whose mass reaches ``top_p``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingError(f"temperature must be finite and >= 0, not {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise SamplingError(f"top_k must be an integer >= 0, not {self.top_k}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise SamplingError(f"top_p must be in (0, 1], not {self.top_p}")

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)

    def pick(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        if self.temperature == 0:
            return int(np.argmax(logits))  # the first maximum, as llama.cpp's greedy sampler
        z = logits.astype(np.float64) / self.temperature
        order = np.argsort(-z, kind="stable")
        if self.top_k:
            order = order[: self.top_k]
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
        if self.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p)) + 1
            order, p = order[:keep], p[:keep] / p[:keep].sum()
        return int(order[rng.choice(len(order), p=p)])


@dataclass
class Generation:
    """The outcome of a generate call."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # the new tokens only
    text: str = ""
    finish_reason: str = ""  # "eos", "stop" (a stop string), "length" (max tokens or context)


def _check_finite(logits: np.ndarray, step: int, pos: int) -> None:
    if not np.isfinite(logits).all():
        n = int((~np.isfinite(logits)).sum())
        raise NonFiniteLogitsError(
            f"step {step} (the logits of position {pos - 1}): {n} of {logits.size} logits are "
            "NaN or infinite; load with trace_nonfinite=True to find the first layer"
        )


def generate_ids(
    model: Decoder,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    sampler: Sampler,
    stop_ids: Sequence[int] = (),
) -> Iterator[int]:
    """Yield new token ids until a stop id, ``max_new_tokens`` or the end of the context.

    The stop id itself is yielded last, so callers can tell why it ended.
    """
    if max_new_tokens < 0:
        raise SamplingError(f"max_new_tokens must be >= 0, not {max_new_tokens}")
    prompt = list(prompt_ids)
    if len(prompt) > model.n_ctx:
        raise ContextOverflowError(
            f"the prompt has {len(prompt)} tokens, more than the context of {model.n_ctx}",
            n_tokens=len(prompt),
            n_ctx=model.n_ctx,
        )
    if max_new_tokens == 0:
        return
    rng = sampler.rng()
    logits = to_numpy(model.forward(prompt, pos=0))
    pos = len(prompt)
    for step in range(max_new_tokens):
        _check_finite(logits, step, pos)
        token = sampler.pick(logits, rng)
        yield token
        if token in stop_ids or pos >= model.n_ctx or step == max_new_tokens - 1:
            return
        logits = to_numpy(model.forward([token], pos=pos))
        pos += 1


class StopText:
    """The text of generated tokens as it becomes final: cut at the first of the ``stop``
    strings, and held back while its end may still begin one; a partial UTF-8 character waits
    for the token that completes it."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.decoder = tokenizer.decoder()
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # may begin a stop string
        self.pending = ""
        self.stopped = False  # a stop string appeared; feed nothing more

    def feed(self, token: int) -> str:
        """The text that ``token`` makes final (all that is left, cut, once a stop string
        appears: then ``stopped`` is set)."""
        self.pending += self.decoder.feed(token)
        cut = min((i for s in self.stop if (i := self.pending.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            final, self.pending = self.pending[:cut], ""
            return final
        split = max(0, len(self.pending) - self.hold)
        final, self.pending = self.pending[:split], self.pending[split:]
        return final

    def finish(self, *, flush: bool) -> str:
        """The text held back; with ``flush``, a partial character too (as U+FFFD)."""
        rest = self.pending + (self.decoder.flush() if flush else "")
        self.pending = ""
        return rest


def stream(
    model: Decoder,
    prompt: str | bytes | Sequence[int],
    result: Generation | None = None,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
) -> Iterator[str]:
    """Yield text pieces as they become complete; fill ``result`` (ids, reason) as it goes.

    Stops at an end-of-sequence/end-of-turn token (not part of the text), at any of the
    ``stop`` strings (cut from the text), after ``max_new_tokens``, or at the end of the
    context. ``prompt`` is text (``str`` or UTF-8 ``bytes``, encoded with the model's
    tokenizer) or token ids.
    """
    tok = model.tokenizer
    # bytes are text too (invalid UTF-8 becomes U+FFFD), not a sequence of token ids
    prompt_ids = tok.encode(prompt) if isinstance(prompt, str | bytes) else token_list(prompt)
    out = result if result is not None else Generation(prompt_ids=[])
    out.prompt_ids = prompt_ids
    sampler = Sampler(temperature, top_k, top_p, seed)
    stop_ids = tuple(tok.stop_ids)
    final = StopText(tok, stop)
    ids = generate_ids(
        model, prompt_ids, max_new_tokens=max_new_tokens, sampler=sampler, stop_ids=stop_ids
    )
    for token in ids:
        out.ids.append(token)
        if token in stop_ids:
            out.finish_reason = "eos"
            break
        piece = final.feed(token)
        if final.stopped:
            out.finish_reason = "stop"
        if piece:
            out.text += piece
            yield piece
        if final.stopped:
            break
    piece = final.finish(flush=not out.finish_reason)
    out.finish_reason = out.finish_reason or "length"
    if piece:
        out.text += piece
        yield piece


def generate(
    model: Decoder,
    prompt: str | bytes | Sequence[int],
    *,
    on_text: Callable[[str], Any] | None = None,
    **options: Any,
) -> Generation:
    """Run :func:`stream` to the end; ``on_text`` receives each piece as it comes."""
    out = Generation(prompt_ids=[])
    for piece in stream(model, prompt, out, **options):
        if on_text is not None:
            on_text(piece)
    return out
