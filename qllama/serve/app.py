"""The FastAPI application: routes, the API key, the body limit, errors, the access log.

Routes (docs/serving.md has the shapes):

- ``GET /health``; ``GET /v1/models``, ``GET /v1/models/{model}``;
- ``POST /v1/completions``, ``POST /v1/chat/completions`` (:mod:`qllama.serve.completions`);
- ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` at the root, as vLLM
  serves them (lm-eval's remote tokenizer then needs no tokenizer download);
- ``POST /v1/models/load``, ``POST /v1/models/unload``: admin, always behind the API key.

With an API key every route needs ``Authorization: Bearer KEY`` (compared in constant time).
Every refusal is an OpenAI-style JSON error with a 4xx status, malformed JSON and wrong types
included (400, not FastAPI's 422); bodies over the limit get 413 before they are parsed. The
access log escapes control characters, so a request cannot forge log lines.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from qllama.errors import QllamaError
from qllama.serve.completions import Context, handle
from qllama.serve.engine import Engine
from qllama.serve.errors import APIError, error_body, from_qllama
from qllama.serve.limits import Limits
from qllama.serve.models import LoadedModel, ModelRegistry, load_model
from qllama.serve.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadRequest,
    TokenizeRequest,
    UnloadRequest,
)

log = logging.getLogger("qllama.serve")
access_log = logging.getLogger("qllama.serve.access")

ASGIApp = Callable[
    [dict[str, Any], Callable[..., Awaitable[Any]], Callable[..., Awaitable[Any]]], Awaitable[None]
]


def printable(text: str, limit: int = 300) -> str:
    """``text`` with control and non-printing characters escaped (CWE-117), cut to ``limit``."""
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
    return out if len(out) <= limit else out[: limit - 3] + "..."


async def _send_json(
    send: Callable[..., Awaitable[Any]], status: int, body: dict[str, Any]
) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class BodyLimit:
    """Refuse bodies over ``limit`` bytes with 413 (declared or counted), before the app
    parses anything; the app then reads the buffered body as usual."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = error_body(
            f"the request body is over this server's limit of {self.limit} bytes",
            code="request_too_large",
        )
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await _send_json(send, 413, too_big)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await _send_json(send, 413, too_big)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        return await self.app(scope, replay, send)


class AccessLog:
    """One escaped line per request: method, path, status, milliseconds."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [0]

        async def watch(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            query = scope.get("query_string", b"").decode("latin-1")
            path = scope.get("path", "") + (f"?{query}" if query else "")
            access_log.info(
                "%s %s %d %.0f ms",
                printable(scope.get("method", "")),
                printable(path),
                status[0],
                1000 * (time.perf_counter() - start),
            )


def create_app(
    registry: ModelRegistry,
    *,
    limits: Limits | None = None,
    api_key: str | None = None,
    load_defaults: dict[str, Any] | None = None,
) -> FastAPI:
    """The server's application over ``registry``; its engine starts and stops with it."""
    limits = limits or Limits()
    engine = Engine(limits)
    ctx = Context(registry, engine, limits)
    defaults = dict(load_defaults or {})

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()
            registry.close()

    app = FastAPI(
        title="qllama", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.engine, app.state.registry = engine, registry

    key = api_key.encode() if api_key else None

    def authorized(request: Request) -> bool:
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        return (
            key is not None
            and scheme.lower() == "bearer"
            and hmac.compare_digest(token.strip().encode(), key)
        )

    def check_key(request: Request) -> None:
        if key is not None and not authorized(request):
            raise APIError(
                401,
                "a valid API key is needed (Authorization: Bearer KEY)",
                type="authentication_error",
                code="invalid_api_key",
            )

    def check_admin(request: Request) -> None:
        if key is None:
            raise APIError(
                403,
                "admin endpoints are off: start the server with --api-key",
                type="permission_error",
            )
        check_key(request)

    auth, admin = [Depends(check_key)], [Depends(check_admin)]

    # -- errors ----------------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(QllamaError)
    async def qllama_error(request: Request, e: QllamaError) -> JSONResponse:
        return await api_error(request, from_qllama(e))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            message, where = "the body is not valid JSON", ""
        else:
            message = f"{where or 'body'}: {first.get('msg', 'invalid')}"
        return JSONResponse(error_body(printable(message), param=where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail)), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception) -> JSONResponse:
        log.exception("request failed: %s %s", request.method, printable(request.url.path))
        return JSONResponse(
            error_body("the server failed to compute this request", type="server_error"),
            status_code=500,
        )

    # -- routes ----------------------------------------------------------------------------------

    def model_card(entry: LoadedModel) -> dict[str, Any]:
        return {
            "id": entry.name,
            "object": "model",
            "created": entry.info.loaded,
            "owned_by": "qllama",
            "max_model_len": entry.info.n_ctx,
            "qllama": entry.info.to_dict(),
        }

    @app.get("/health", dependencies=auth)
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "models": registry.names(),
            "retired_models_held": registry.retired_alive(),
            **engine.stats(),
        }

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(e) for e in registry.entries()]}

    def with_model(name: str | None, work: Callable[[LoadedModel], Any]) -> Any:
        """``work`` on the model ``name`` names, held while it runs."""
        entry = registry.acquire(name)
        try:
            return work(entry)
        finally:
            entry.release()

    @app.get("/v1/models/{name}", dependencies=auth)
    async def model(name: str) -> dict[str, Any]:
        return dict(with_model(name, model_card))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await handle(ctx, body, request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatRequest, request: Request) -> Any:
        return await handle(ctx, body, request)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        special = None if body.add_special_tokens else False

        def work(e: LoadedModel) -> dict[str, Any]:
            assert e.model is not None
            ids = e.model.tokenizer.encode(body.prompt, add_bos=special, add_eos=special)
            return {"tokens": ids, "count": len(ids), "max_model_len": e.info.n_ctx}

        return await run_in_threadpool(with_model, body.model, work)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        def work(e: LoadedModel) -> dict[str, Any]:
            assert e.model is not None
            return {"prompt": e.model.tokenizer.decode(body.tokens)}

        return with_model(body.model, work)

    @app.get("/tokenizer_info", dependencies=auth)
    async def tokenizer_info(model: str | None = None) -> dict[str, Any]:
        def work(e: LoadedModel) -> dict[str, Any]:
            assert e.model is not None
            tok, template = e.model.tokenizer, e.model.chat_template
            text = lambda i: None if i is None else tok.tokens[i]  # noqa: E731
            return {
                "tokenizer_class": f"qllama.Tokenizer[{tok.kind}]",
                "bos_token": text(tok.bos_id),
                "eos_token": text(tok.eos_id),
                "pad_token": text(tok.pad_id),
                "add_bos_token": tok.add_bos,
                "vocab_size": tok.n_vocab,
                "model_max_length": e.info.n_ctx,
                "chat_template": template.source if template is not None else None,
            }

        return with_model(model, work)

    @app.post("/v1/models/load", dependencies=admin)
    async def load(body: LoadRequest) -> dict[str, Any]:
        path = registry.resolve(body.path)
        asked = body.model_dump(exclude={"model", "path"}, exclude_none=True)
        # the server's backend options hold unless the request names a backend of its own
        options = asked if body.backend else {**defaults, **asked}
        try:
            entry = await run_in_threadpool(load_model, body.model, path, **options)
        except QllamaError as e:
            raise from_qllama(e) from None
        old = registry.put(entry)
        return {"loaded": model_card(entry), "replaced": old.info.to_dict() if old else None}

    @app.post("/v1/models/unload", dependencies=admin)
    async def unload(body: UnloadRequest) -> dict[str, Any]:
        entry = registry.remove(body.model)
        return {"unloaded": entry.name, "held_by_running_requests": not entry.closed}

    app.add_middleware(BodyLimit, limit=limits.max_body_bytes)
    app.add_middleware(AccessLog)  # outermost: it logs the 413s too
    return app
