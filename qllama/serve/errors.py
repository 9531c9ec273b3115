"""OpenAI-style errors: every refusal is ``{"error": {message, type, param, code}}`` with a 4xx
status, never a traceback; what qllama itself refuses maps to 400 with its message."""

from __future__ import annotations

from typing import Any

from qllama.errors import (
    ChatTemplateError,
    ContextOverflowError,
    GGUFError,
    GGUFOpenError,
    InvalidTokenError,
    NonFiniteLogitsError,
    QllamaError,
)

INVALID = "invalid_request_error"


class APIError(Exception):
    """A request the server refuses (or, with status 5xx, could not compute)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.code, self.param, self.headers = code, param, headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, code=self.code, param=self.param)


def error_body(
    message: str, *, type: str = INVALID, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The JSON of an error, as the OpenAI API and its clients spell it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# what qllama raises, by class: (status, code, param); the rest of QllamaError is a 400
CODES: list[tuple[type[QllamaError], int, str, str | None]] = [
    (ContextOverflowError, 400, "context_length_exceeded", "prompt"),
    (InvalidTokenError, 400, "invalid_token", "prompt"),
    (ChatTemplateError, 400, "chat_template_error", "messages"),
    (GGUFOpenError, 400, "model_file_not_found", "path"),
    (GGUFError, 400, "invalid_model_file", "path"),
    (NonFiniteLogitsError, 500, "non_finite_logits", None),  # the model's fault, not the request's
]


def from_qllama(e: QllamaError) -> APIError:
    """A qllama error as an API error naming its kind (400: what the request asked for)."""
    for cls, status, code, param in CODES:
        if isinstance(e, cls):
            kind = INVALID if status < 500 else "server_error"
            return APIError(status, str(e), type=kind, code=code, param=param)
    return APIError(400, str(e), code=type(e).__name__)


def not_found(what: str, name: str, known: list[str]) -> APIError:
    shown = ", ".join(repr(k) for k in known) or "none"
    return APIError(
        404, f"the {what} {name!r} does not exist (loaded: {shown})", code="model_not_found"
    )


def queue_full(n: int, limit: int) -> APIError:
    return APIError(
        429,
        f"the server is busy: {n} sequences would pass the queue's limit of {limit}; retry",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": "1"},
    )
