"""Request bodies, in the shapes the ``openai`` client and lm-evaluation-harness send.

Types are strict (a bool is not a token id, a string is not a number) and floats finite;
fields these schemas do not know are ignored, as the OpenAI API does. Sampling options
qllama does not compute (penalties, logit bias, a suffix, tools) are refused when set to
anything but their neutral value: running without them would silently change the numbers.
The limits that depend on the server's configuration (max_tokens, n, stop strings) are checked
by the handlers against :class:`~qllama.serve.limits.Limits`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    """What completions and chat share: the model, sampling, stops, streaming."""

    model: StrictStr | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1)  # vLLM's -1 and 0 both mean all tokens
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**64)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = Field(1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's: decode past end-of-sequence tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, Any] | None = None
    user: StrictStr | None = None

    @model_validator(mode="after")
    def _neutral(self) -> _Sampling:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ValueError(f"{name} is not supported (qllama samples without penalties)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: Prompt
    max_tokens: StrictInt | None = Field(16, ge=0)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0)
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 asks for nothing unless echo is set (the prompt only)")
        return self


class ContentPart(_Body):
    type: Literal["text"]
    text: StrictStr


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None

    def plain(self) -> dict[str, str]:
        """The message as chat templates read it: role and text content."""
        if isinstance(self.content, list):
            return {"role": self.role, "content": "".join(p.text for p in self.content)}
        return {"role": self.role, "content": self.content or ""}


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatRequest:
        if self.tools:
            raise ValueError("tools are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than text is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's shape, which lm-eval's remote tokenizer uses)."""

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt]


class LoadRequest(_Body):
    """``POST /v1/models/load``: add a model, or replace the one of that name."""

    model: StrictStr = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@+-]+$")
    path: StrictStr = Field(min_length=1)
    backend: StrictStr | None = None
    device: StrictStr | None = None
    dequantize_all: StrictBool | None = None
    activations: Literal["q8", "f32"] | None = None
    n_ctx: StrictInt | None = Field(None, ge=1)
    kv_precision: StrictStr = "f32"  # qllama.runtime.kv_types: "f16", "q8_0/q4_0,fa", ...

    @field_validator("kv_precision")
    @classmethod
    def _known_kv(cls, value: str) -> str:
        from qllama.errors import BackendError
        from qllama.runtime.kv_types import parse

        try:
            parse(value)
        except BackendError as e:
            raise ValueError(str(e)) from None
        return value


class UnloadRequest(_Body):
    model: StrictStr
