"""One error hierarchy for everything qllama refuses.

Every class derives from :class:`QllamaError`, itself a :class:`ValueError`, so a caller can
catch bad input with one ``except``. Messages name the field or tensor, the byte offset where
that applies, the value found and the limit it broke.
"""

from __future__ import annotations


class QllamaError(ValueError):
    """Base class of every error qllama raises on purpose."""


# --- GGUF container -------------------------------------------------------------------------


class GGUFError(QllamaError):
    """The file is not a well-formed GGUF."""


class GGUFOpenError(GGUFError, OSError):
    """The path cannot be opened as a regular, readable file."""


class GGUFTruncatedError(GGUFError):
    """A read would run past the end of the file."""


class GGUFMagicError(GGUFError):
    """The file does not start with ``GGUF``."""


class GGUFVersionError(GGUFError):
    """The format version is not one qllama reads (2 or 3)."""


class GGUFLimitError(GGUFError):
    """A count, length or size is larger than the file or a fixed cap allows."""


class GGUFSizeError(GGUFLimitError, GGUFTruncatedError):
    """A declared count needs more bytes than the file has left: a hostile count, or a
    truncated file; the reader cannot tell which, so the error is both."""


class GGUFTypeError(GGUFError):
    """A metadata value type or a tensor type id is unknown, or of the wrong kind."""


class GGUFFormatError(GGUFError):
    """A field's bytes are not valid for its type (bad UTF-8, a bool that is not 0 or 1...)."""


class GGUFLayoutError(GGUFError):
    """Tensor data is misaligned, overlapping or outside the data section."""


class GGUFDuplicateError(GGUFError):
    """A key or tensor name appears twice."""


# --- tensors and formats --------------------------------------------------------------------


class UnsupportedTensorTypeError(QllamaError):
    """A valid GGML type that qllama cannot (de)quantize, such as F64."""


class TensorShapeError(QllamaError):
    """A tensor's shape does not fit its type or what the model expects."""


class WeightValueError(QllamaError):
    """A weight or block scale is NaN or infinite."""


class ImatrixError(QllamaError):
    """An importance matrix is missing where a type needs one, or does not fit the tensor."""


# --- model, tokenizer, runtime --------------------------------------------------------------


class ModelConfigError(QllamaError):
    """Metadata or tensors do not describe a model qllama can build."""


class TokenizerError(QllamaError):
    """The vocabulary in the file is missing or inconsistent."""


class ChatTemplateError(QllamaError):
    """The chat template failed, was refused by the sandbox, or ran past its limits."""


class ContextOverflowError(QllamaError):
    """The sequence would not fit in the model's context."""

    def __init__(self, message: str, *, n_tokens: int, n_ctx: int) -> None:
        super().__init__(message)
        self.n_tokens = n_tokens
        self.n_ctx = n_ctx


class InvalidTokenError(QllamaError):
    """A token id is outside ``[0, n_vocab)``, or the prompt is empty."""


class SequenceError(QllamaError):
    """A forward call's position does not continue the cached sequence."""


class NonFiniteLogitsError(QllamaError):
    """The forward pass produced NaN or infinite values."""


class BackendError(QllamaError):
    """A backend is missing, lacks a device, or does not support a type."""


class FetchError(QllamaError):
    """A model file could not be downloaded or failed its checksum."""
