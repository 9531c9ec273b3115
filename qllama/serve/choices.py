"""The HTTP side of the engine's jobs: their events, turned into text pieces and scores.

A :class:`Run` submits one request's jobs (one per prompt and choice) and yields each
:class:`Delta` as the engine's events arrive: text that became final (stop strings cut, end
tokens left out, as :func:`qllama.runtime.generation.stream` does it), the tokens it scored, and the
finish reason. When a stop string appears the job is cancelled, so its slot frees at once; a
client that goes away cancels every job of its request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from qllama.runtime.generation import StopText
from qllama.serve.engine import Engine, Failed, Finished, Job, PromptScored, Sampled, Scored
from qllama.serve.errors import APIError


@dataclass
class Delta:
    """What one event adds to a choice."""

    index: int
    text: str = ""
    prompt: list[tuple[int, Scored | None]] = field(default_factory=list)  # echoed, scored
    tokens: list[tuple[int, Scored | None]] = field(default_factory=list)  # sampled
    finish_reason: str | None = None


class Choice:
    """One job's text and scores as its events come."""

    def __init__(self, index: int, job: Job, tokenizer: Any, stops: list[str]) -> None:
        self.index, self.job = index, job
        self.final = StopText(tokenizer, stops)
        self.finish_reason: str | None = None
        self.n_generated = 0

    def on(self, event: Any) -> Delta | None:
        """The delta of ``event`` (None: nothing to tell); raises what the engine failed with."""
        if isinstance(event, Failed):
            raise event.error
        if self.finish_reason is not None:
            return None  # a stop string ended it; the rest is the engine catching up
        d = Delta(self.index)
        if isinstance(event, PromptScored):
            d.prompt = list(zip(self.job.prompt, event.scores, strict=True))
        elif isinstance(event, Sampled):
            self.n_generated += 1
            d.tokens = [(event.token, event.score)]
            if event.token not in self.job.stop_ids:
                d.text = self.final.feed(event.token)
                if self.final.stopped:
                    d.finish_reason = self.finish_reason = "stop"
        elif isinstance(event, Finished):
            d.text = self.final.finish(flush=event.reason == "length")
            d.finish_reason = self.finish_reason = "length" if event.reason == "length" else "stop"
        return d


class Run:
    """A request's jobs on the engine, their events as deltas (in arrival order)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.choices: list[Choice] = []

    def emitter(self, index: int) -> Callable[[Any], None]:
        """The ``emit`` of job ``index``: called on the engine thread, read here."""

        def emit(event: Any) -> None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

        return emit

    def add(self, job: Job, tokenizer: Any, stops: list[str]) -> None:
        self.choices.append(Choice(len(self.choices), job, tokenizer, stops))

    def submit(self) -> None:
        self.engine.submit([c.job for c in self.choices])

    def cancel(self) -> None:
        for c in self.choices:
            self.engine.cancel(c.job)

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """Every delta until each job has ended; jobs still running are cancelled if the
        consumer stops early (a disconnect) or a job fails."""
        open_jobs = len(self.choices)
        try:
            while open_jobs:
                index, event = await self.queue.get()
                choice = self.choices[index]
                if isinstance(event, Finished | Failed):
                    open_jobs -= 1
                delta = choice.on(event)
                if delta is not None:
                    if delta.finish_reason is not None and not isinstance(event, Finished):
                        self.engine.cancel(choice.job)  # a stop string: free the slot now
                    yield delta
        finally:
            if open_jobs:
                self.cancel()


async def collect(run: Run, disconnected: Callable[[], Any]) -> list[Delta]:
    """All deltas of a run (non-streaming), cancelling it when the client goes away."""
    out: list[Delta] = []

    async def gather() -> None:
        async for d in run.deltas():
            out.append(d)

    task = asyncio.ensure_future(gather())
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await disconnected():
                task.cancel()
                run.cancel()
                raise APIError(499, "the client closed the connection")
        task.result()
    finally:
        if not task.done():
            task.cancel()
    return out
