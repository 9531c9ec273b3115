"""Perplexity and KL divergence over a corpus, as ``llama-perplexity`` computes them.

The protocol is llama.cpp's (tools/perplexity/perplexity.cpp), so that numbers line up with
the tables the community publishes:

* the text is tokenized once (BOS first where the vocabulary adds one) and cut into
  non-overlapping windows of ``n_ctx`` tokens, ``len // n_ctx`` of them (at most ``n_chunks``);
  at least ``2 * n_ctx`` tokens are needed;
* each window starts a new sequence (the KV cache is cleared), with its first token replaced
  by BOS where the vocabulary adds one;
* only the second half is scored: positions ``n_ctx/2 ... n_ctx-2`` predict the next token,
  ``n_ctx - 1 - n_ctx/2`` predictions per window (the first half gives them context);
* perplexity is ``exp`` of the mean negative log-likelihood, printed as llama.cpp prints it:
  ``Final estimate: PPL = 14.3767 +/- 0.12345`` with ``PPL * sqrt(var(nll) / (n - 1))``;
* against a base (``--kl-divergence-base``), per scored position: KL(base || model),
  Δp = p_model(token) - p_base(token), whether both argmaxes agree, and both NLLs; their statistics
  (:func:`qllama.measure.metrics.summarize`) and lines
  (:func:`qllama.measure.metrics.format_kl_stats`) are llama-perplexity's, and statistics need at
  least 100 positions, as there.

Bases are written and read window by window (:mod:`qllama.measure.kld_base`), so memory stays at one
window's logits. A window's logits come from a *scorer*: a qllama model on any backend and
arithmetic (:func:`qllama_scorer`), or the transformers f32 reference (:func:`transformers_scorer`).
The model runs the first half of each window for its cache only (one row of logits), then the
scored half with the logits of every position, skipping the window's last token, whose
prediction is never scored (by causality, nothing else depends on it).

:func:`evaluate` is a whole run (the windows reconciled with a base, the model loaded, the
windows scored, a base saved), the one piece of code behind both ``qllama perplexity`` and the
study's ``corpus`` measure.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qllama.array_api import to_numpy
from qllama.backends.base import describe
from qllama.errors import QllamaError
from qllama.measure import metrics
from qllama.measure.kld_base import BaseFile, BaseFileError, BaseWriter, scored

MIN_STATISTICS = 100  # llama-perplexity prints no KL statistics over fewer positions

# The CPU arithmetic as llama.cpp's CPU backend computes it (``qllama.load`` options; numpy
# backend): activations quantized by the x86/ARM SIMD quantizers (ties to even, id = 127/amax)
# and llama-perplexity's attention, an f16 KV cache read by the tiled CPU flash attention.
# docs/perplexity.md says what each part moves and what remains.
LLAMA_CPP_CPU: dict[str, Any] = {"activation_rounding": "simd", "kv_precision": "f16-flash"}

# (window tokens (n_ctx,), first scored position) -> logits of positions first ... n_ctx-2
Scorer = Callable[[np.ndarray, int], np.ndarray]
Progress = Callable[[int], Any]  # called with the tokens of each window done


class CorpusError(QllamaError):
    """The text is too short for the windows, or does not match the base."""


@dataclass(frozen=True)
class Windows:
    """The corpus cut into llama-perplexity's windows."""

    tokens: np.ndarray  # (n_chunk, n_ctx) int32, as the text gave them
    bos: int | None = None  # put at each window's start, where the vocabulary adds BOS

    @property
    def n_chunk(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_ctx(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def first(self) -> int:
        """The first scored position."""
        return self.n_ctx // 2

    @property
    def n_scored(self) -> int:
        """Scored positions per window."""
        return scored(self.n_ctx)

    def evaluated(self, i: int) -> np.ndarray:
        """Window ``i`` as the model sees it: BOS in place of its first token if added."""
        w = self.tokens[i].copy()
        if self.bos is not None:
            w[0] = self.bos
        return w

    def targets(self, i: int) -> np.ndarray:
        """The tokens the scored positions of window ``i`` predict."""
        return self.tokens[i, self.first + 1 :]


def windows(
    ids: Sequence[int] | np.ndarray,
    n_ctx: int,
    *,
    n_chunks: int | None = None,
    bos: int | None = None,
) -> Windows:
    """Cut token ids into ``len(ids) // n_ctx`` windows (at most ``n_chunks``)."""
    if n_ctx < 4:
        raise CorpusError(f"the context must be at least 4 tokens, not {n_ctx}")
    if n_chunks is not None and n_chunks < 1:
        raise CorpusError(f"the number of windows must be at least 1, not {n_chunks}")
    arr = np.asarray(ids, dtype=np.int32).reshape(-1)
    if arr.size < 2 * n_ctx:
        raise CorpusError(
            f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of "
            f"{n_ctx}; the text tokenizes to only {arr.size}"
        )
    n = arr.size // n_ctx if n_chunks is None else min(n_chunks, arr.size // n_ctx)
    return Windows(arr[: n * n_ctx].reshape(n, n_ctx), bos)  # (n_chunk, n_ctx)


def tokenize(tokenizer: Any, text: str) -> list[int]:
    """The corpus ids as llama-perplexity makes them: BOS first if the file adds one, special
    tokens written in the text left as text (``common_tokenize(..., add_special=true)``)."""
    return tokenizer.encode(text, special=False)


def windows_of_base(base: BaseFile, tokenizer: Any) -> Windows:
    """The windows a base was made on (its tokens), BOS as this model's vocabulary adds it."""
    if base.header.n_vocab != tokenizer.n_vocab:
        raise BaseFileError(
            f"{base.path} was made over a vocabulary of {base.header.n_vocab}; this model has "
            f"{tokenizer.n_vocab}"
        )
    return Windows(base.tokens, tokenizer.bos_id if tokenizer.add_bos else None)


# --- scorers ------------------------------------------------------------------------------------


def qllama_scorer(model: Any) -> Scorer:
    """Logits of a window's scored positions from a qllama model (any backend, arithmetic)."""

    def score(tokens: np.ndarray, first: int) -> np.ndarray:
        model.forward(tokens[:first], 0)  # a new sequence: the context half, into the cache
        logits = model.forward(tokens[first:-1], first, all_logits=True)
        return np.asarray(to_numpy(logits), dtype=np.float32)  # (n_ctx - 1 - first, vocab)

    return score


def transformers_scorer(model: Any) -> Scorer:
    """Logits of a window's scored positions from a transformers model (the f32 reference of
    :func:`qllama.measure.reference.load_transformers`), one forward pass per window."""
    import torch

    def score(tokens: np.ndarray, first: int) -> np.ndarray:
        with torch.no_grad():
            ids = torch.tensor(tokens[None, :-1].astype(np.int64))
            logits = model(ids).logits[0, first:]  # (n_ctx - 1 - first, vocab)
        return np.ascontiguousarray(logits.float().numpy())

    return score


# --- scoring ------------------------------------------------------------------------------------


@dataclass
class Scores:
    """Per-position results of a run: NLLs, and against a base every per-token value."""

    n_ctx: int
    nll: list[np.ndarray] = field(default_factory=list)  # per window, float64
    values: list[metrics.TokenValues] = field(default_factory=list)  # per window, with a base

    @property
    def count(self) -> int:
        return sum(x.size for x in self.nll)

    def all_nll(self) -> np.ndarray:
        return np.concatenate(self.nll) if self.nll else np.zeros(0)

    def ppl(self) -> tuple[float, float]:
        """Perplexity and its ± as llama-perplexity prints them."""
        x = self.all_nll()
        mean = float(x.mean())
        var = float(np.mean(x * x) - mean * mean)
        ppl = math.exp(mean)
        unc = ppl * math.sqrt(var / (x.size - 1)) if var > 0 and x.size > 1 else 0.0
        return ppl, unc

    def token_values(self) -> metrics.TokenValues:
        if not self.values:
            raise CorpusError("no base was given: there are no KL values")
        return metrics.TokenValues.concat(self.values)

    def kl(self) -> metrics.KLStats:
        """llama-perplexity's KL statistics (at least :data:`MIN_STATISTICS` positions)."""
        v = self.token_values()
        if len(v) < MIN_STATISTICS:
            raise CorpusError(
                f"{len(v)} scored positions: llama-perplexity gives no statistics below "
                f"{MIN_STATISTICS}; use more windows"
            )
        return metrics.summarize(v)


def run(
    scorer: Scorer,
    wins: Windows,
    *,
    base: BaseFile | None = None,
    save: BaseWriter | None = None,
    progress: Progress | None = None,
    on_window: Callable[[int, Scores], Any] | None = None,
) -> Scores:
    """Score every window; compare with ``base`` and/or write the logits to ``save``."""
    if base is not None and not np.array_equal(base.tokens, wins.tokens):
        raise BaseFileError(f"{base.path} holds other windows than these")
    scores = Scores(wins.n_ctx)
    for i in range(wins.n_chunk):
        logits = scorer(wins.evaluated(i), wins.first)
        targets = wins.targets(i)
        if logits.shape[0] != targets.size:
            raise QllamaError(f"the scorer gave {logits.shape[0]} rows for {targets.size}")
        if save is not None:
            save.write(logits)
        if base is not None:
            v = base.token_values(i, logits, targets)
            scores.values.append(v)
            scores.nll.append(v.nll_test)
        else:
            scores.nll.append(metrics.nll(logits, targets))
        if progress is not None:
            progress(wins.n_ctx)
        if on_window is not None:
            on_window(i, scores)
    return scores


# --- what llama-perplexity prints ---------------------------------------------------------------

KL_TABLE_HEAD = (
    "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
    "              Δp RMS            Same top p"
)


def ppl_running(scores: Scores) -> str:
    """The perplexity so far, as llama-perplexity prints it after window ``i``: ``[i]14.3767,``."""
    return f"[{len(scores.nll)}]{math.exp(scores.all_nll().mean()):.4f},"


def ppl_final(scores: Scores) -> str:
    """``Final estimate: PPL = ... +/- ...``."""
    ppl, unc = scores.ppl()
    return f"Final estimate: PPL = {ppl:.4f} +/- {unc:.5f}"


def kl_running(scores: Scores) -> str:
    """The running KL line llama-perplexity prints after each window."""
    v = scores.token_values()
    a, b, n = v.nll_test, v.nll_ref, len(v)
    ua, ub, cov = metrics.uncertainty(a), metrics.uncertainty(b), metrics.covariance(a, b)
    ppl = math.exp(a.mean())
    ratio_unc = math.sqrt(max(ua * ua + ub * ub - 2 * cov, 0.0))
    dp2 = v.dp * v.dp
    rms = math.sqrt(dp2.mean())
    rms_unc = 0.5 / rms * metrics.uncertainty(dp2) if rms > 0 else 0.0
    same = float(v.same.mean())
    same_unc = math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0
    return (
        f"{len(scores.values):4d}    {ppl:9.4f} ± {ppl * ua:9.4f}"
        f"    {a.mean() - b.mean():10.5f} ± {ratio_unc:10.5f}"
        f"    {v.kld.mean():10.5f} ± {metrics.uncertainty(v.kld):10.5f}"
        f"    {100 * rms:6.3f} ± {100 * rms_unc:6.3f} %"
        f"    {100 * same:6.3f} ± {100 * same_unc:6.3f} %"
    )


# --- a run over a corpus: what ``qllama perplexity`` and the study's corpus measure share ------

Hook = Callable[[Windows, dict[str, Any]], Any]  # (the windows, the setting) before the first


@dataclass(frozen=True)
class CorpusRun:
    """What :func:`evaluate` measured: the windows, their scores, and where they came from."""

    file: str | None  # the model file, as given (None for a model given loaded)
    setting: dict[str, Any]  # who scored: the engine and its load options
    text: dict[str, Any]  # the text's origin (:func:`qllama.measure.corpus.from_spec`)
    windows: Windows
    scores: Scores
    base: BaseFile | None  # the base compared with (its first windows), if one was given
    kl: metrics.KLStats | None  # against the base, at least MIN_STATISTICS positions
    seconds: float  # the scoring's wall time (the base written with it, if one was)

    @property
    def tokens_per_s(self) -> float:
        """Tokens evaluated a second, both halves of every window."""
        return self.windows.n_chunk * self.windows.n_ctx / self.seconds

    def to_dict(self) -> dict[str, Any]:
        """Every number, as ``qllama perplexity --json`` writes them."""
        ppl, unc = self.scores.ppl()
        doc: dict[str, Any] = {
            "model": self.file,
            "setting": self.setting,
            "text": self.text,
            "n_ctx": self.windows.n_ctx,
            "windows": self.windows.n_chunk,
            "scored": self.scores.count,
            "ppl": ppl,
            "ppl_unc": unc,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
        }
        if self.kl is not None:
            doc["kl"] = self.kl.to_dict()
        if self.base is not None:
            h = self.base.header
            doc["base"] = {"path": str(self.base.path), "format": h.fmt, **h.meta}
        return doc


def _windows(
    tokenizer: Any,
    text: str | None,
    n_ctx: int,
    n_chunks: int | None,
    base: BaseFile | None,
) -> tuple[Windows, BaseFile | None, dict[str, Any]]:
    """The windows a run scores, reconciled with its base: the base's own (its first
    ``n_chunks``), checked against ``text`` if given too; else ``text`` cut into windows of
    ``n_ctx``. Returns them, the base cut to them, and the text's origin."""
    from qllama.measure.corpus import from_spec

    if base is not None:
        wins = windows_of_base(base, tokenizer)
        if n_chunks is not None:
            base = base.head(min(n_chunks, base.header.n_chunk))
            wins = Windows(base.tokens, wins.bos)
        if text:
            ids = tokenize(tokenizer, from_spec(text)[0])
            given = windows(ids, n_ctx, n_chunks=wins.n_chunk, bos=wins.bos)
            if not np.array_equal(given.tokens, wins.tokens):
                raise CorpusError(f"--text does not give the tokens {base.path} was made on")
        return wins, base, base.header.meta.get("text", {})
    if not text:
        raise CorpusError("give --text (a file, or corpus:NAME) or --kl-divergence-base")
    body, origin = from_spec(text)
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    return windows(tokenize(tokenizer, body), n_ctx, n_chunks=n_chunks, bos=bos), None, origin


def evaluate(
    file: str | os.PathLike[str] | None = None,
    *,
    model: Any = None,
    text: str | None = None,
    n_ctx: int | None = None,
    n_chunks: int | None = None,
    base: str | os.PathLike[str] | BaseFile | None = None,
    engine: str = "qllama",
    options: Mapping[str, Any] | None = None,
    as_llama_cpp: bool = False,
    kv_precision: str | None = None,
    threads: int | None = None,
    save_base: str | os.PathLike[str] | None = None,
    base_format: str = "llama",
    save_meta: Mapping[str, Any] | None = None,
    on_start: Hook | None = None,
    progress: Progress | None = None,
    on_window: Callable[[int, Scores], Any] | None = None,
) -> CorpusRun:
    """Perplexity (and KL divergence against a base) of a model over a corpus, as
    ``llama-perplexity`` runs it.

    The model is ``file``, loaded by ``engine`` (``"qllama"`` with the :func:`qllama.load`
    ``options``, ``as_llama_cpp`` adding :data:`LLAMA_CPP_CPU`, then ``kv_precision`` and
    ``threads``; or ``"transformers"``, the f32 reference), or ``model``, a qllama model
    already loaded. The windows are ``base``'s (a base file: its first ``n_chunks``; ``text``,
    if given too, must give its tokens), or ``text`` (a UTF-8 file, or ``corpus:NAME``) cut
    into at most ``n_chunks`` windows of ``n_ctx`` tokens (default 512). ``save_base`` writes
    the logits as a base in ``base_format``, with ``save_meta`` (default: the file's name and
    sha256, the setting, the text's origin); an interrupted run leaves no file.

    ``on_start(windows, setting)`` is called once the windows are cut and the model is
    loaded, before the first window is scored (to say what runs, or to refuse it);
    ``progress`` and ``on_window`` as :func:`run` calls them.
    """
    from qllama.runtime.tokenizer import Tokenizer

    if (model is None) == (file is None):
        raise QllamaError("give a model file or a loaded model, one of them")
    if engine not in ("qllama", "transformers"):
        raise QllamaError(f"engine must be qllama or transformers, not {engine!r}")
    b = base if base is None or isinstance(base, BaseFile) else BaseFile.open(base)
    if b is not None and n_ctx is not None and n_ctx != b.header.n_ctx:
        raise CorpusError(f"{b.path} was made with a context of {b.header.n_ctx}")
    n_ctx = b.header.n_ctx if b is not None else (n_ctx or 512)
    tokenizer = model.tokenizer if file is None else Tokenizer.from_gguf(file)
    wins, b, origin = _windows(tokenizer, text, n_ctx, n_chunks, b)

    setting: dict[str, Any]
    if file is None:  # the model given loaded
        scorer = qllama_scorer(model)
        setting = {"engine": "qllama", "computes": describe(model.backend)}
    elif engine == "transformers":
        from qllama.measure.reference import load_transformers

        scorer = transformers_scorer(load_transformers(file))
        setting = {"engine": "transformers f32 eager"}
    else:
        from qllama.runtime.loader import load

        opts = dict(options or {})
        if as_llama_cpp:
            opts.update(LLAMA_CPP_CPU)
        if kv_precision:
            opts["kv_precision"] = kv_precision
        if threads:
            opts["threads"] = threads
        loaded = load(file, n_ctx=n_ctx, **opts)
        scorer = qllama_scorer(loaded)
        setting = {"engine": "qllama", **{k: v for k, v in opts.items() if v is not None}}
        setting["computes"] = describe(loaded.backend)
    if on_start is not None:
        on_start(wins, setting)

    save = None
    if save_base is not None:
        if save_meta is None:
            from qllama.model_files import sha256_file

            if file is None:
                raise QllamaError("a base saved from a loaded model needs its save_meta")
            save_meta = {
                "model": os.path.basename(file),
                "model_sha256": sha256_file(file),
                "setting": setting,
                "text": origin,
            }
        save = BaseWriter(
            save_base,
            base_format,
            n_ctx=wins.n_ctx,
            n_vocab=tokenizer.n_vocab,
            tokens=wins.tokens,
            meta=dict(save_meta),
        )
    started = time.perf_counter()
    with save if save is not None else contextlib.nullcontext():
        scores = run(scorer, wins, base=b, save=save, progress=progress, on_window=on_window)
    seconds = time.perf_counter() - started
    kl = scores.kl() if b is not None and scores.count >= MIN_STATISTICS else None
    return CorpusRun(
        file=None if file is None else str(file),
        setting=setting,
        text=origin,
        windows=wins,
        scores=scores,
        base=b,
        kl=kl,
        seconds=seconds,
    )


def measure(
    model: Any,
    base: str | os.PathLike[str] | BaseFile,
    *,
    n_chunks: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """The corpus measure: a qllama model against a base file, as numbers.

    Returns llama-perplexity's statistics (:class:`qllama.measure.metrics.KLStats` as a dict) with
    ``ppl`` and ``ppl_unc`` (the model's perplexity and its ±), ``tokens`` (positions scored)
    and ``windows``. The windows are the base's (at most its first ``n_chunks``), scored by
    :func:`evaluate`.
    """
    r = evaluate(model=model, base=base, n_chunks=n_chunks, progress=progress)
    kl = r.kl if r.kl is not None else r.scores.kl()  # the latter refuses: too few positions
    ppl, unc = r.scores.ppl()
    assert r.base is not None  # evaluate was given one
    return {
        **kl.to_dict(),
        "ppl": ppl,
        "ppl_unc": unc,
        "tokens": r.scores.count,
        "windows": r.windows.n_chunk,
        "n_ctx": r.windows.n_ctx,
        "base_format": r.base.header.fmt,
    }


__all__ = [
    "LLAMA_CPP_CPU",
    "MIN_STATISTICS",
    "CorpusError",
    "CorpusRun",
    "Scorer",
    "Scores",
    "Windows",
    "evaluate",
    "measure",
    "qllama_scorer",
    "run",
    "tokenize",
    "transformers_scorer",
    "windows",
    "windows_of_base",
]
