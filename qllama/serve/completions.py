"""``/v1/completions`` and ``/v1/chat/completions``: a request -> checked prompts -> jobs on the
engine -> one JSON response, or a stream of server-sent events.

Prompts are checked whole before any job starts: ids in range, not empty, prompt plus
``max_tokens`` within the context (a 400 naming the numbers, as vLLM answers). Text prompts
are encoded with the file's tokenizer (BOS as the file asks); token-id prompts run as given,
so echoed arrays line up one to one with the ids sent. ``n`` choices of one prompt sample with
seeds ``seed, seed + 1, ...``. With ``echo``, completions return the prompt's text (its ids
decoded) before the new text, and with ``logprobs`` every prompt token's score, the first
null; sampled end tokens stay in the logprobs arrays (lm-eval counts on one entry per token)
but not in the text.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from qllama.errors import QllamaError
from qllama.runtime.generation import Sampler, SamplingError
from qllama.serve import responses as R
from qllama.serve.choices import Delta, Run, collect
from qllama.serve.engine import Engine, Job
from qllama.serve.errors import APIError, error_body, from_qllama
from qllama.serve.limits import Limits
from qllama.serve.models import LoadedModel, ModelRegistry
from qllama.serve.schemas import ChatRequest, CompletionRequest, _Sampling


@dataclass
class Context:
    """What the handlers share: the models, the engine, the limits."""

    registry: ModelRegistry
    engine: Engine
    limits: Limits


def _check_ids(ids: list[int], n_vocab: int, which: int) -> list[int]:
    if not ids:
        raise APIError(400, f"prompt {which} has no tokens", code="empty_prompt", param="prompt")
    bad = next((j for j, t in enumerate(ids) if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise APIError(
            400,
            f"prompt {which}: token[{bad}] = {ids[bad]} is outside the vocabulary [0, {n_vocab})",
            code="invalid_token",
            param="prompt",
        )
    return ids


def encode_prompts(entry: LoadedModel, prompt: Any) -> list[list[int]]:
    """Every prompt of a completions request as token ids."""
    assert entry.model is not None
    tok = entry.model.tokenizer
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    out = []
    for i, p in enumerate(items):
        ids = tok.encode(p) if isinstance(p, str) else list(p)
        out.append(_check_ids(ids, entry.model.config.n_vocab, i))
    return out


def token_budget(limits: Limits, n_ctx: int, lengths: list[int], asked: int | None) -> int:
    """max_tokens checked against the limits and every prompt's room in the context; None
    asks for all the room there is (up to the server's max_tokens)."""
    longest = max(lengths)
    if longest > n_ctx:
        raise APIError(
            400,
            f"the prompt has {longest} tokens, more than the model's context of {n_ctx}",
            code="context_length_exceeded",
            param="prompt",
        )
    if asked is None:
        return max(min(limits.max_tokens, n_ctx - longest), 0)
    if asked > limits.max_tokens:
        raise APIError(
            400,
            f"max_tokens {asked} is over this server's limit of {limits.max_tokens}",
            param="max_tokens",
        )
    if longest + asked > n_ctx:
        raise APIError(
            400,
            f"this model's context is {n_ctx} tokens; the request asks for {longest + asked} "
            f"({longest} in the prompt, {asked} to generate)",
            code="context_length_exceeded",
            param="max_tokens",
        )
    return asked


def _check_sampling(body: _Sampling, limits: Limits) -> None:
    if body.n > limits.max_n:
        raise APIError(400, f"n {body.n} is over this server's limit of {limits.max_n}", param="n")
    stops = body.stops
    if len(stops) > limits.max_stop:
        raise APIError(
            400, f"at most {limits.max_stop} stop strings, not {len(stops)}", param="stop"
        )
    if any(not s or len(s) > limits.max_stop_chars for s in stops):
        raise APIError(
            400, f"stop strings must have 1 to {limits.max_stop_chars} characters", param="stop"
        )


def _sampler(body: _Sampling, choice: int) -> Sampler:
    seed = None if body.seed is None else (body.seed + choice) % 2**64
    try:
        return Sampler(body.temperature, max(body.top_k, 0), body.top_p, seed)
    except SamplingError as e:
        raise APIError(400, str(e)) from None


def _top_k(asked: int | None, limits: Limits, param: str) -> None:
    if asked is not None and asked > limits.max_top_logprobs:
        raise APIError(
            400, f"{param} is at most {limits.max_top_logprobs}, not {asked}", param=param
        )


async def _prepare(ctx: Context, entry: LoadedModel, body: Any, chat: bool) -> list[list[int]]:
    """The request's prompts as ids (tokenizing and templating off the event loop)."""
    assert entry.model is not None
    model = entry.model
    try:
        if chat:
            messages = [m.plain() for m in body.messages]
            ids = await run_in_threadpool(model.apply_chat_template, messages)
            return [_check_ids(ids, model.config.n_vocab, 0)]
        prompts = await run_in_threadpool(encode_prompts, entry, body.prompt)
    except QllamaError as e:
        raise from_qllama(e) from None
    if len(prompts) > ctx.limits.max_prompts:
        raise APIError(
            400, f"at most {ctx.limits.max_prompts} prompts, not {len(prompts)}", param="prompt"
        )
    return prompts


def _jobs(
    ctx: Context, entry: LoadedModel, body: Any, prompts: list[list[int]], max_tokens: int
) -> Run:
    assert entry.model is not None
    tok = entry.model.tokenizer
    chat = isinstance(body, ChatRequest)
    n_jobs = len(prompts) * body.n
    if n_jobs > ctx.limits.max_queue:
        raise APIError(
            400, f"the request needs {n_jobs} sequences; the queue holds {ctx.limits.max_queue}"
        )
    stop_ids = frozenset() if body.ignore_eos else frozenset(tok.stop_ids)
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs = False
    else:
        logprobs, prompt_logprobs = body.logprobs, body.echo and body.logprobs is not None
    run = Run(ctx.engine)
    for p in prompts:
        for j in range(body.n):
            job = Job(
                entry=entry,
                prompt=p,
                max_tokens=max_tokens,
                sampler=_sampler(body, j),
                stop_ids=stop_ids,
                emit=run.emitter(len(run.choices)),
                prompt_logprobs=prompt_logprobs,
                logprobs=logprobs,
            )
            run.add(job, tok, body.stops)
    return run


async def handle(ctx: Context, body: CompletionRequest | ChatRequest, request: Request) -> Any:
    """Either endpoint: check, submit, answer."""
    chat = isinstance(body, ChatRequest)
    _check_sampling(body, ctx.limits)
    if isinstance(body, ChatRequest):
        _top_k(body.top_logprobs, ctx.limits, "top_logprobs")
        asked = body.token_limit
    else:
        _top_k(body.logprobs, ctx.limits, "logprobs")
        asked = body.max_tokens
    entry = ctx.registry.acquire(body.model)
    try:
        assert entry.model is not None
        prompts = await _prepare(ctx, entry, body, chat)
        max_tokens = token_budget(ctx.limits, entry.model.n_ctx, [len(p) for p in prompts], asked)
        run = _jobs(ctx, entry, body, prompts, max_tokens)
        run.submit()  # every job now holds the model; this request's hold can go
    finally:
        entry.release()
    writer = ChatWriter(entry, body, run) if chat else CompletionWriter(entry, body, run)
    if body.stream:
        return StreamingResponse(writer.stream(), media_type="text/event-stream")
    deltas = await collect(run, request.is_disconnected)
    return JSONResponse(writer.whole(deltas))


class _Writer:
    """Deltas -> one response or chunks; ``kind`` and ``_choice_*`` differ per endpoint."""

    kind = ""
    chunk_kind = ""

    def __init__(self, entry: LoadedModel, body: Any, run: Run) -> None:
        assert entry.model is not None
        self.info, self.body, self.run = entry.info, body, run
        self.tok = entry.model.tokenizer
        self.rid = R.new_id("chatcmpl" if isinstance(body, ChatRequest) else "cmpl")
        self.n_prompt = sum(len(c.job.prompt) for c in run.choices[:: body.n])

    def usage(self) -> dict[str, int]:
        return R.usage(self.n_prompt, sum(c.n_generated for c in self.run.choices))

    def whole(self, deltas: list[Delta]) -> dict[str, Any]:
        per: dict[int, list[Delta]] = {c.index: [] for c in self.run.choices}
        for d in deltas:
            per[d.index].append(d)
        choices = [self._choice_whole(i, ds) for i, ds in per.items()]
        return R.envelope(self.kind, self.rid, self.info, choices=choices, usage=self.usage())

    async def stream(self) -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(self.run.deltas()) as deltas:
                for frame in self._opening():
                    yield frame
                async for d in deltas:
                    choice = self._choice_chunk(d)
                    if choice is not None:
                        yield R.sse(self._chunk([choice]))
            if self.body.include_usage:
                yield R.sse(self._chunk([], usage=self.usage()))
        except APIError as e:
            yield R.sse(e.body())
        except QllamaError as e:
            yield R.sse(from_qllama(e).body())
        except Exception:  # the stream has begun: end it with an error the client can read
            yield R.sse(
                error_body("the server failed to compute this request", type="server_error")
            )
        finally:
            self.run.cancel()
        yield R.DONE

    def _chunk(self, choices: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
        return R.envelope(self.chunk_kind, self.rid, self.info, choices=choices, **more)

    def _opening(self) -> list[str]:
        return []

    def _choice_whole(self, index: int, deltas: list[Delta]) -> dict[str, Any]:
        raise NotImplementedError

    def _choice_chunk(self, d: Delta) -> dict[str, Any] | None:
        raise NotImplementedError


class CompletionWriter(_Writer):
    kind = chunk_kind = "text_completion"

    def __init__(self, entry: LoadedModel, body: Any, run: Run) -> None:
        super().__init__(entry, body, run)
        # the prompt's text (echo) and the logprobs builders, per choice
        self.echo = [self.tok.decode(c.job.prompt) if body.echo else "" for c in run.choices]
        self.logprobs = [
            R.LegacyLogprobs(self.tok, body.logprobs) if body.logprobs is not None else None
            for _ in run.choices
        ]
        self.echoed = [False] * len(run.choices)

    def _part(self, d: Delta) -> tuple[str, dict[str, list[Any]] | None]:
        """This delta's text and logprobs (the echo comes with a choice's first delta)."""
        text = d.text
        if not self.echoed[d.index]:
            self.echoed[d.index] = True
            text = self.echo[d.index] + text
        builder = self.logprobs[d.index]
        if builder is None:
            return text, None
        return text, builder.entries(d.prompt + d.tokens)

    def _choice_whole(self, index: int, deltas: list[Delta]) -> dict[str, Any]:
        text, logprobs = "", None
        for d in deltas:
            piece, more = self._part(d)
            text += piece
            if more is not None:
                logprobs = R.merge(logprobs, more)
        reason = next((d.finish_reason for d in deltas if d.finish_reason), None)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def _choice_chunk(self, d: Delta) -> dict[str, Any] | None:
        text, logprobs = self._part(d)
        if not (text or d.finish_reason or (logprobs and logprobs["tokens"])):
            return None
        return {
            "index": d.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": d.finish_reason,
        }


class ChatWriter(_Writer):
    kind, chunk_kind = "chat.completion", "chat.completion.chunk"

    def _logprobs(self, d: Delta) -> list[dict[str, Any]]:
        k = self.body.top_logprobs or 0
        return R.chat_logprobs(self.tok, d.tokens, k, self.run.choices[d.index].job.stop_ids)

    def _choice_whole(self, index: int, deltas: list[Delta]) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        reason = next((d.finish_reason for d in deltas if d.finish_reason), None)
        logprobs = None
        if self.body.logprobs:
            logprobs = {"content": [e for d in deltas for e in self._logprobs(d)]}
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": reason,
        }

    def _opening(self) -> list[str]:
        first = [
            {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            for c in self.run.choices
        ]
        for choice in first:
            choice["finish_reason"] = None
        return [R.sse(self._chunk(first))]

    def _choice_chunk(self, d: Delta) -> dict[str, Any] | None:
        entries = self._logprobs(d) if self.body.logprobs else []
        if not (d.text or d.finish_reason or entries):
            return None
        delta = {"content": d.text} if d.text else {}
        logprobs = {"content": entries} if self.body.logprobs else None
        return {
            "index": d.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": d.finish_reason,
        }
