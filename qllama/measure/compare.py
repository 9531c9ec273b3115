"""Compare a model with a reference: teacher forcing, free generation, forks, KL statistics.

A :class:`Reference` is a token sequence (a prompt and its continuation) with the reference
model's logits at every position. Given any qllama model (any file, backend, arithmetic):

* :func:`teacher_forcing` feeds the reference tokens, so a flipped argmax never propagates,
  and compares the logits at every step (step ``s`` predicts continuation token ``s``).
  ``mode="steps"`` prefills the prompt then runs one token at a time, as a decoder (and
  candle) must; ``mode="batched"`` runs every position in one forward pass.
* :func:`free_generation` lets the model decode greedily on its own and finds where it first
  leaves the reference (:func:`fork`), with the text around that point.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qllama.array_api import to_numpy
from qllama.atomic import atomic_write
from qllama.errors import QllamaError
from qllama.measure import metrics

Progress = Callable[[int, int], Any]  # (done, total)


@dataclass
class Reference:
    """Tokens (prompt then continuation) and the logits of every position, ``(len, vocab)``."""

    tokens: list[int]
    n_prompt: int
    logits: np.ndarray  # row i: the logits after token i, predicting token i + 1
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def continuation(self) -> list[int]:
        return self.tokens[self.n_prompt :]

    @property
    def step_logits(self) -> np.ndarray:
        """The logits of each teacher-forcing step: ``(len(continuation), vocab)``."""
        return self.logits[self.n_prompt - 1 : len(self.tokens) - 1]

    def save(self, path: str) -> None:
        import json

        with atomic_write(path) as f:
            np.savez(
                f,
                tokens=np.asarray(self.tokens, np.int64),
                n_prompt=self.n_prompt,
                logits=self.logits,
                meta=json.dumps(self.meta),
            )

    @classmethod
    def load(cls, path: str) -> Reference:
        import json

        try:
            with np.load(path) as z:
                return cls(
                    [int(t) for t in z["tokens"]],
                    int(z["n_prompt"]),
                    z["logits"],
                    json.loads(str(z["meta"])),
                )
        except (OSError, KeyError, ValueError) as e:
            raise QllamaError(f"cannot read reference {path}: {e}") from None


def reference_from_model(
    model: Any,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int = 300,
    meta: dict[str, Any] | None = None,
) -> Reference:
    """Greedy-decode with ``model`` to its end-of-turn or ``max_new_tokens``, then take the
    logits of every position from one forward pass over the whole sequence."""
    gen = model.generate(list(prompt_ids), max_new_tokens=max_new_tokens)
    tokens = list(prompt_ids) + gen.ids
    logits = to_numpy(model.forward(tokens, pos=0, all_logits=True)).astype(np.float32)
    return Reference(tokens, len(prompt_ids), logits, meta or {})


@dataclass
class TeacherForcing:
    """Per-step comparison of a model's logits with the reference's."""

    mode: str
    max_abs: np.ndarray  # (steps,) max |Δlogit| per step
    argmax: np.ndarray  # (steps,) the model's argmax
    ref_argmax: np.ndarray
    ref_margin: np.ndarray  # (steps,) reference top-1 minus top-2
    logits: np.ndarray  # (steps, vocab) the model's logits
    kl: metrics.KLStats

    @property
    def flipped(self) -> list[int]:
        """Steps whose argmax differs from the reference's."""
        return [int(s) for s in np.flatnonzero(self.argmax != self.ref_argmax)]

    @property
    def first_flip(self) -> int | None:
        f = self.flipped
        return f[0] if f else None

    def summary(self) -> dict[str, Any]:
        n = int(self.max_abs.size)
        return {
            "mode": self.mode,
            "steps": n,
            "step0_max_abs": float(self.max_abs[0]),
            "median_max_abs": float(np.median(self.max_abs)),
            "max_max_abs": float(self.max_abs.max()),
            "argmax_agree": n - len(self.flipped),
            "first_flip": self.first_flip,
            "flips": [
                {
                    "step": s,
                    "ref_margin": float(self.ref_margin[s]),
                    "ref_token": int(self.ref_argmax[s]),
                    "token": int(self.argmax[s]),
                }
                for s in self.flipped
            ],
            "kl": self.kl.to_dict(),
        }


def teacher_forcing(
    model: Any, ref: Reference, *, mode: str = "steps", progress: Progress | None = None
) -> TeacherForcing:
    """Run the reference tokens through ``model`` and compare every step's logits."""
    n0, cont = ref.n_prompt, ref.continuation
    if not cont:
        raise QllamaError("the reference has no continuation to teacher-force")
    if mode == "batched":
        all_logits = to_numpy(model.forward(ref.tokens[:-1], pos=0, all_logits=True))
        logits = np.asarray(all_logits[n0 - 1 :], dtype=np.float32)
    elif mode == "steps":
        rows = [to_numpy(model.forward(ref.tokens[:n0], pos=0))]
        for s in range(1, len(cont)):
            rows.append(to_numpy(model.forward([ref.tokens[n0 + s - 1]], pos=n0 + s - 1)))
            if progress is not None:
                progress(s, len(cont))
        logits = np.stack(rows).astype(np.float32)
    else:
        raise QllamaError(f"teacher forcing mode must be 'steps' or 'batched', not {mode!r}")
    ref_logits = ref.step_logits
    return TeacherForcing(
        mode=mode,
        max_abs=np.abs(logits - ref_logits).max(axis=-1),
        argmax=np.argmax(logits, axis=-1),
        ref_argmax=np.argmax(ref_logits, axis=-1),
        ref_margin=metrics.margin(ref_logits),
        logits=logits,
        kl=metrics.kl_stats(ref_logits, logits, np.asarray(cont)),
    )


def fork(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token sequences differ; None if one is a prefix of the other
    (a sequence that never forks is a valid outcome, e.g. a short answer)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


@dataclass
class FreeGeneration:
    """A greedy decode of the model on its own, and where it leaves the reference."""

    tokens: list[int]  # the generated tokens (end-of-turn included if hit)
    eos: bool
    fork: int | None  # first generated token that differs from the reference's
    context: dict[str, str]  # common prefix / reference continuation / own continuation

    def summary(self) -> dict[str, Any]:
        return {
            "length": len(self.tokens),
            "eos": self.eos,
            "fork": self.fork,
            "context": self.context,
            "tokens": self.tokens,
        }


def fork_context(
    tokenizer: Any, ref: Sequence[int], own: Sequence[int], at: int | None, width: int = 12
) -> dict[str, str]:
    """The text around a fork: ``width`` tokens before it, and each side's next tokens."""
    if at is None:
        return {}
    return {
        "prefix": tokenizer.decode(list(own[max(0, at - width) : at])),
        "reference": tokenizer.decode(list(ref[at : at + width])),
        "own": tokenizer.decode(list(own[at : at + width])),
    }


FREE_EXTRA = 20  # free generation may run this many tokens past the reference's length


def free_generation(model: Any, ref: Reference, *, extra: int = FREE_EXTRA) -> FreeGeneration:
    """Greedy decoding from the reference prompt, capped at the reference length + ``extra``."""
    gen = model.generate(ref.tokens[: ref.n_prompt], max_new_tokens=len(ref.continuation) + extra)
    at = fork(gen.ids, ref.continuation)
    return FreeGeneration(
        gen.ids,
        gen.finish_reason == "eos",
        at,
        fork_context(model.tokenizer, ref.continuation, gen.ids, at),
    )
