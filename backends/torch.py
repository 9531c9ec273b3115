"""torch: the GPU arithmetic on MPS, CUDA or the CPU (see :mod:`qllama.backends.array_api`)."""

from __future__ import annotations

from typing import Any, ClassVar

import array_api_compat.torch
import numpy as np
import torch

from qllama.backends.array_api import ArrayBackend
from qllama.errors import BackendError


def devices() -> tuple[str, ...]:
    """The torch devices usable here, the best first."""
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    if torch.backends.mps.is_available():
        found.append("mps")
    return (*found, "cpu")


class TorchBackend(ArrayBackend):
    """Weights as blocks on the device, dequantized to float32 inside each matmul."""

    name: ClassVar[str] = "torch"

    def __init__(
        self, *, device: str | None = None, dequantize_all: bool = False, **options: Any
    ) -> None:
        if options:
            raise BackendError(f"backend torch takes no options {sorted(options)}")
        here = devices()
        kind = (device or here[0]).split(":")[0]
        if kind not in ("cpu", "cuda", "mps"):
            raise BackendError(f"backend torch has no device {device!r}; use cpu, cuda or mps")
        if kind not in here:
            raise BackendError(
                f"backend torch: device {device!r} is not available here (have: {', '.join(here)})"
            )
        # float32 matmuls stay float32: no TF32 on CUDA
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        super().__init__(
            array_api_compat.torch,
            device=torch.device(device or here[0]),
            dequantize_all=dequantize_all,
        )

    def asarray(self, x: Any) -> Any:
        # torch cannot hold read-only memory (the file's map): copy such arrays once
        if isinstance(x, np.ndarray) and not x.flags.writeable:
            x = x.copy()
        return super().asarray(x)
