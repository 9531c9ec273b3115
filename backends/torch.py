"""torch: the GPU arithmetic on MPS, CUDA or the CPU (see :mod:`qllama.backends.array_api`).

With ``compile=True`` the model's one-token decode step (:meth:`qllama.runtime.model.Model.step`)
runs as one ``torch.compile``d function: on CUDA in ``mode="reduce-overhead"``, which replays
the step as a CUDA graph (one launch a token instead of one per op), elsewhere in the default
mode (inductor's fused kernels). The model fixes its KV cache at the context's length for it,
and passes the position as an array, so no shape and no constant of the step changes from
token to token: it is compiled once (docs/gpu.md). Prefill, teacher forcing and batches run
eagerly, as without the option.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
        self,
        *,
        device: str | None = None,
        dequantize_all: bool = False,
        compile: bool = False,
        **options: Any,
    ) -> None:
        if options:
            raise BackendError(
                f"backend torch takes no options {sorted(options)}; its one option is compile"
            )
        if not isinstance(compile, bool):
            raise BackendError(f"backend torch: compile must be true or false, not {compile!r}")
        self.compile = compile
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
        # torch cannot hold read-only memory (the file's map): copy such arrays once; in a
        # compiled step an ndarray is dynamo's own (a traced tensor, with no flags to read)
        compiling = torch.compiler.is_compiling()
        if isinstance(x, np.ndarray) and not compiling and not x.flags.writeable:
            x = x.copy()
        return super().asarray(x)

    def describe(self) -> str:
        line = super().describe()
        if not self.compile:
            return line
        return f"{line}, decode step compiled ({compile_mode(self.device)})"

    def compile_step(
        self, step: Callable[..., Any], persistent: Callable[[], Any]
    ) -> Callable[..., Any] | None:
        """``step`` compiled, where the ``compile`` option asks for it (None otherwise): the
        model's capability hook (:meth:`qllama.runtime.model.Model._compile`). The arrays of
        ``persistent()`` keep their addresses from call to call (weights, the fixed KV cache,
        RoPE tables): marked static at the first call, so that a CUDA graph reads them in
        place and writes the cache in place, rather than copying them in at each replay."""
        if not self.compile:
            return None
        mode = compile_mode(self.device)
        compiled = torch.compile(step, mode=mode, dynamic=False)
        marked = False

        def run(*args: Any) -> Any:
            nonlocal marked
            if not marked:
                for t in tensors(persistent()):
                    torch._dynamo.mark_static_address(t)
                marked = True
            if mode == "reduce-overhead":  # the last replay's outputs are no longer read
                torch.compiler.cudagraph_mark_step_begin()
            out = compiled(*args)
            # a CUDA graph's output lives in its pool, overwritten by the next replay
            return out.clone() if mode == "reduce-overhead" else out

        return run


def compile_mode(device: Any) -> str:
    """torch.compile's mode for ``device``: CUDA graphs on CUDA, inductor's default elsewhere
    (a CPU and MPS have no graphs to replay)."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else "default"


def tensors(root: Any) -> list[torch.Tensor]:
    """Every torch tensor reachable from ``root`` through dataclasses, lists, tuples and
    dicts (the model's weights and cache), each once."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo = [root]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            found[id(x)] = x
        elif isinstance(x, list | tuple):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            todo.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return list(found.values())
