"""The engine: one thread that owns every forward pass and decodes the active sequences together.

Requests become :class:`Job` s (one per prompt and choice) in a bounded queue. Each step the engine
admits queued jobs into free sequence slots, then runs one :meth:`Model.forward_batch` per model
with work: one token for every sequence that is generating, and prompt chunks of the sequences still
prefilling, up to a token budget (llama.cpp's server builds its batches the same way). It samples
each sequence with :class:`qllama.runtime.generation.Sampler` and sends what it computed to the
job's ``emit`` (thread-safe; the HTTP side turns it into text and JSON).

A finished sequence's KV cache stays, with the tokens it holds, among its model's idle caches.
A new job takes the idle cache that shares the longest prefix with its prompt and runs only
the rest. It always runs the prompt's last token again (its logits pick the first new token);
a job that scores its prompt also needs, for every reused position, the log-probability of the
next token and the top entries: a cache keeps those where a scoring job computed them
(lm-eval sends one request per answer choice, each with the same context).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qllama.array_api import to_numpy
from qllama.errors import QllamaError
from qllama.measure.metrics import log_softmax
from qllama.runtime.generation import Sampler, _check_finite
from qllama.runtime.kv_cache import KVCache
from qllama.runtime.model import SequenceStep
from qllama.serve.errors import APIError, queue_full
from qllama.serve.limits import Limits
from qllama.serve.models import LoadedModel

log = logging.getLogger("qllama.serve")

Top = list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass(frozen=True)
class Scored:
    """A position's score: log p(token | the tokens before it), and the top entries there."""

    logprob: float
    top: Top


@dataclass(frozen=True)
class PromptScored:
    """Every prompt token's score; the first is None (nothing comes before it)."""

    scores: list[Scored | None]


@dataclass(frozen=True)
class Sampled:
    token: int
    score: Scored | None  # with logprobs asked for: log p of the token, top entries


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (a stop token), "length" (max_tokens or the context), "cancelled"


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = PromptScored | Sampled | Finished | Failed


@dataclass
class Job:
    """One sequence to run: a prompt, how to sample it, where its events go."""

    entry: LoadedModel
    prompt: list[int]
    max_tokens: int  # 0: score the prompt only
    sampler: Sampler
    stop_ids: frozenset[int]
    emit: Callable[[Event], Any]
    prompt_logprobs: bool = False  # score every prompt token
    logprobs: int | None = None  # top entries per sampled token (None: no scores)
    cancelled: bool = False  # set by the HTTP side (a disconnect, a stop string)


def top_entries(lp: np.ndarray, k: int) -> Top:
    """The ``k`` most likely tokens of a row of log-probabilities, ties by id."""
    k = min(k, lp.shape[-1])
    if k <= 0:
        return []
    idx = np.argpartition(-lp, k - 1)[:k]
    idx = idx[np.lexsort((idx, -lp[idx]))]
    return [(int(i), float(lp[i])) for i in idx]


@dataclass
class _Cache:
    """A KV cache with the tokens at its positions and, from position 0 on, the scores of
    the next token where a scoring job computed them (``scores[p]`` is about ``tokens[p+1]``)."""

    kv: KVCache
    tokens: list[int] = field(default_factory=list)
    scores: list[Scored] = field(default_factory=list)
    used: float = 0.0


@dataclass
class _Sequence:
    job: Job
    cache: _Cache
    pos: int  # tokens in the cache: the position of the next one fed
    rng: np.random.Generator
    scores: list[Scored] = field(default_factory=list)  # the prompt's, for PromptScored
    generated: list[int] = field(default_factory=list)
    next_token: int = -1
    prefilled: bool = False


def _usable(job: Job, cache: _Cache) -> tuple[int, int]:
    """(positions of ``cache`` that ``job`` can keep, its common prefix with the prompt)."""
    common = 0
    for a, b in zip(job.prompt, cache.tokens, strict=False):
        if a != b:
            break
        common += 1
    reuse = min(common, len(job.prompt) - 1)  # the last prompt token always runs
    if job.prompt_logprobs:  # and each kept position's next-token score must be known
        reuse = min(reuse, common - 1, len(cache.scores))
    return max(reuse, 0), common


class Engine:
    """The engine thread; :meth:`submit` and :meth:`cancel` may be called from any thread."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._pending: collections.deque[Job] = collections.deque()
        self._active: list[_Sequence] = []
        self._idle: dict[LoadedModel, list[_Cache]] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self.step_lock = threading.Lock()  # held during each step (tests hold it to pause)
        self.steps = 0
        self.tokens = 0
        self._thread = threading.Thread(target=self._run, name="qllama-engine", daemon=True)

    # -- the HTTP side ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, jobs: list[Job]) -> None:
        """Queue all of ``jobs`` or none (429 when the queue would pass its limit)."""
        with self._cond:
            if self._stopping:
                raise APIError(503, "the server is shutting down", type="server_error")
            n = len(self._pending) + len(jobs)
            if n > self.limits.max_queue:
                raise queue_full(n, self.limits.max_queue)
            taken = []
            try:
                for job in jobs:
                    taken.append(job.entry.acquire())  # the weights stay until the job ends
            except APIError:
                for entry in taken:
                    entry.release()
                raise
            self._pending.extend(jobs)
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """Stop ``job`` at the next step; its cache is kept for reuse."""
        job.cancelled = True
        with self._cond:
            self._cond.notify_all()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "active": len(self._active),
                "queued": len(self._pending),
                "idle_caches": sum(len(v) for v in self._idle.values()),
                "steps": self.steps,
                "tokens": self.tokens,
            }

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._pending or self._active):
                    self._cond.wait()
                if self._stopping:
                    break
            with self.step_lock:
                try:
                    self._step()
                except Exception as e:  # a bug: fail what is running, keep serving
                    log.exception("engine step failed")
                    for s in list(self._active):
                        self._fail(s, e)
        with self._cond:
            pending, self._pending = list(self._pending), collections.deque()
        gone = APIError(503, "the server is shutting down", type="server_error")
        for job in pending:
            self._emit(job, Failed(gone))
            job.entry.release()
        for s in list(self._active):
            self._fail(s, gone)
        self._idle.clear()

    def _step(self) -> None:
        with self._cond:
            self._admit()
        for s in [s for s in self._active if s.job.cancelled]:
            self._finish(s, "cancelled")
        self._idle = {e: c for e, c in self._idle.items() if not e.retired}
        plan = self._plan()
        if not plan:
            return
        groups: dict[LoadedModel, list[tuple[_Sequence, list[int], bool]]] = {}
        for item in plan:
            groups.setdefault(item[0].job.entry, []).append(item)
        for entry, items in groups.items():
            model = entry.model
            assert model is not None  # every job holds a reference
            steps = [SequenceStep(s.cache.kv, ids, s.pos, every) for s, ids, every in items]
            try:
                outs = model.forward_batch(steps)
            except QllamaError as e:
                for s, _, _ in items:
                    self._fail(s, e)
                continue
            self.steps += 1
            self.tokens += sum(len(ids) for _, ids, _ in items)
            for (s, ids, every), out in zip(items, outs, strict=True):
                try:
                    self._advance(s, ids, every, np.asarray(to_numpy(out)))
                except QllamaError as e:
                    self._fail(s, e)

    def _admit(self) -> None:
        """Queued jobs into free slots, each with the idle cache that saves the most work;
        cancelled jobs leave the queue at once (they would hold its room and their model)."""
        for job in [j for j in self._pending if j.cancelled]:
            self._pending.remove(job)
            self._emit(job, Finished("cancelled"))
            job.entry.release()
        while self._pending and len(self._active) < self.limits.max_sequences:
            job = self._pending.popleft()
            pool = self._idle.get(job.entry, [])
            best, reuse, common = None, 0, 0
            for c in sorted(pool, key=lambda c: -c.used):  # ties: the most recently used
                r, k = _usable(job, c)
                if r > reuse:
                    best, reuse, common = c, r, k
            running = sum(1 for s in self._active if s.job.entry is job.entry)
            if best is None and pool and running + len(pool) >= self.limits.max_sequences:
                # as llama.cpp's slots: a model holds at most max_sequences caches in all, so
                # without a prefix to reuse the least recently used idle one starts afresh
                best = min(pool, key=lambda c: c.used)
            if best is not None:
                pool.remove(best)
            else:
                assert job.entry.model is not None
                best = _Cache(job.entry.model.new_cache())
            keep = max(0, min(len(best.scores), reuse, common - 1))
            best.tokens, best.scores = best.tokens[:reuse], best.scores[:keep]
            rng = job.sampler.rng()
            s = _Sequence(job, best, reuse, rng, scores=list(best.scores[:reuse]))
            self._active.append(s)

    def _plan(self) -> list[tuple[_Sequence, list[int], bool]]:
        """This step's work: a token per generating sequence, then prompt chunks.

        A prompt runs in chunks of ``prefill_chunk`` tokens from where it starts, whatever else
        runs: a chunk that does not fit this step waits for the next (the limits leave room for
        at least one), so how a prompt is chunked never depends on the traffic.
        """
        budget = self.limits.step_tokens
        plan = []
        for s in self._active:
            if s.prefilled:
                plan.append((s, [s.next_token], False))
                budget -= 1
        for s in self._active:
            n = min(self.limits.prefill_chunk, len(s.job.prompt) - s.pos)
            if s.prefilled or n > budget:
                continue
            plan.append((s, s.job.prompt[s.pos : s.pos + n], s.job.prompt_logprobs))
            budget -= n
        return plan

    def _advance(self, s: _Sequence, ids: list[int], every: bool, logits: np.ndarray) -> None:
        """Take in one step's logits: score prompt positions, or sample the next token."""
        start = s.pos
        s.cache.tokens += ids
        s.pos += len(ids)
        s.cache.used = time.monotonic()
        if s.prefilled:
            self._sample(s, logits)
            return
        prompt = s.job.prompt
        if every:  # (n, vocab): the score of each next prompt token
            lp = log_softmax(logits)
            k = self.limits.max_top_logprobs
            for j in range(len(ids) - (1 if s.pos == len(prompt) else 0)):
                p = start + j
                score = Scored(float(lp[j, prompt[p + 1]]), top_entries(lp[j], k))
                s.scores.append(score)
                if len(s.cache.scores) == p:
                    s.cache.scores.append(score)
            logits = logits[-1]
        if s.pos < len(prompt):
            return
        s.prefilled = True
        if s.job.prompt_logprobs:
            self._emit(s.job, PromptScored([None, *s.scores]))
        if s.job.max_tokens == 0:
            self._finish(s, "length")
        else:
            self._sample(s, logits)

    def _sample(self, s: _Sequence, logits: np.ndarray) -> None:
        job = s.job
        _check_finite(logits, len(s.generated), s.pos)
        token = job.sampler.pick(logits, s.rng)
        score = None
        if job.logprobs is not None:
            lp = log_softmax(logits)
            score = Scored(float(lp[token]), top_entries(lp, job.logprobs))
        s.generated.append(token)
        self._emit(job, Sampled(token, score))
        assert job.entry.model is not None
        if token in job.stop_ids:
            self._finish(s, "stop")
        elif len(s.generated) >= job.max_tokens or s.pos >= job.entry.model.n_ctx:
            self._finish(s, "length")
        else:
            s.next_token = token

    def _finish(self, s: _Sequence, reason: str) -> None:
        self._active.remove(s)
        if not s.job.entry.retired and self.limits.idle_caches:
            pool = self._idle.setdefault(s.job.entry, [])
            pool.append(s.cache)
            if len(pool) > self.limits.idle_caches:
                pool.remove(min(pool, key=lambda c: c.used))  # the least recently used
        self._emit(s.job, Finished(reason))
        s.job.entry.release()

    def _fail(self, s: _Sequence, error: BaseException) -> None:
        """End a sequence with an error; its cache may be half written, so it goes."""
        if s in self._active:
            self._active.remove(s)
        self._emit(s.job, Failed(error))
        s.job.entry.release()

    @staticmethod
    def _emit(job: Job, event: Event) -> None:
        try:
            job.emit(event)
        except RuntimeError:  # the request's event loop is gone: nobody listens any more
            job.cancelled = True
