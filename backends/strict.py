"""array-api-strict: the GPU arithmetic on the strictest namespace there is.

It exists to prove the model uses nothing outside the array API standard; it is slow.
"""

from __future__ import annotations

from typing import Any, ClassVar

import array_api_strict

from qllama.backends.array_api import ArrayBackend
from qllama.errors import BackendError


class StrictBackend(ArrayBackend):
    name: ClassVar[str] = "array_api_strict"

    def __init__(
        self, *, device: str | None = None, dequantize_all: bool = False, **options: Any
    ) -> None:
        if options:
            raise BackendError(f"backend array_api_strict takes no options {sorted(options)}")
        if device not in (None, "cpu"):
            raise BackendError(f"backend array_api_strict has no device {device!r}; it runs on cpu")
        super().__init__(array_api_strict, dequantize_all=dequantize_all)
