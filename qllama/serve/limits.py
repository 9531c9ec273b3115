"""What one server accepts and holds at once: the limits every request is checked against."""

from __future__ import annotations

from dataclasses import dataclass

from qllama.errors import QllamaError


@dataclass(frozen=True)
class Limits:
    """Bounds on requests, sequences and the engine's batches (``qllama serve`` options)."""

    max_sequences: int = 8  # sequences decoded together (llama.cpp's slots)
    max_queue: int = 64  # sequences waiting for a slot; a request that would pass it gets 429
    max_tokens: int = 4096  # the largest max_tokens a request may ask for
    max_n: int = 8  # choices per prompt
    max_prompts: int = 64  # prompts in one completions request
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters of one stop string
    max_top_logprobs: int = 20  # top entries per position (OpenAI's limit)
    max_body_bytes: int = 8 << 20  # a request body larger than this gets 413
    prefill_chunk: int = 256  # prompt tokens of one sequence per engine step
    batch_tokens: int | None = None  # tokens per step (None: 512, or room for a chunk)
    prefix_caches: int | None = (
        None  # idle caches kept per model for prefix reuse (None: max_sequences)
    )

    def __post_init__(self) -> None:
        for name in ("max_sequences", "max_queue", "max_tokens", "max_n", "max_prompts"):
            if getattr(self, name) < 1:
                raise QllamaError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.prefill_chunk < 1:
            raise QllamaError(f"prefill_chunk must be at least 1, not {self.prefill_chunk}")
        least = self.prefill_chunk + self.max_sequences
        if self.batch_tokens is not None and self.batch_tokens < least:
            raise QllamaError(
                f"batch_tokens ({self.batch_tokens}) must hold a token of every sequence and a "
                f"whole prompt chunk: at least max_sequences + prefill_chunk = {least}"
            )
        if self.prefix_caches is not None and self.prefix_caches < 0:
            raise QllamaError(f"prefix_caches must be >= 0, not {self.prefix_caches}")

    @property
    def step_tokens(self) -> int:
        """Tokens of all sequences in one engine step."""
        least = self.prefill_chunk + self.max_sequences
        return self.batch_tokens if self.batch_tokens is not None else max(512, least)

    @property
    def idle_caches(self) -> int:
        """Finished sequences' caches kept per model, for a later request with the same prefix."""
        return self.max_sequences if self.prefix_caches is None else self.prefix_caches
