"""The GPU arithmetic, written once against the array API.

Weights stay as blocks (the file's bytes, unpacked into field arrays and put on the device
once); each matmul dequantizes the weight to float32 and multiplies it with float32
activations, as candle's Metal decode kernels and torch do. With ``dequantize_all`` the
weights are widened to float32 once, at load, and each matmul is a plain one (candle's
``CANDLE_DEQUANTIZE_ALL``, transformers' ``gguf_file=``).

Any namespace works; the torch, jax and array-api-strict backends are this class with a
namespace and a device, and the numpy backend overrides only ``matmul``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from qllama import quants
from qllama.backends.base import QuantTensor, check_supported
from qllama.ggml_types import GGMLType
from qllama.quants.base import QuantType

ALL_TYPES = frozenset(GGMLType[name] for name in quants.supported())


@dataclass
class Blocks:
    """A weight kept as blocks: its format's field arrays, on the backend's device."""

    tensor: QuantTensor
    fmt: type[QuantType]
    fields: dict[str, Any]

    @property
    def blocks_per_row(self) -> int:
        return self.tensor.row_length // self.fmt.block_size


@dataclass
class Dense:
    """A weight widened to float32 ``(rows, row_length)``."""

    tensor: QuantTensor
    w: Any


class ArrayBackend:
    """Float32 activations; weights dequantized inside each matmul, or once at load."""

    name: ClassVar[str] = "array_api"
    types: ClassVar[frozenset[GGMLType]] = ALL_TYPES

    def __init__(self, xp: Any, *, device: Any = None, dequantize_all: bool = False) -> None:
        self.xp = xp
        self.device = device
        self.dequantize_all = dequantize_all

    def describe(self) -> str:
        """One line for a run's first output: the backend, its device and its arithmetic."""
        where = f"{self.name} on {self.device}" if self.device is not None else self.name
        if self.dequantize_all:
            return f"{where}, dequantize-all arithmetic (every weight widened to f32 at load)"
        return f"{where}, gpu arithmetic (f32 activations, weights dequantized in each matmul)"

    # -- protocol ------------------------------------------------------------------------------

    def supports(self, ggml_type: GGMLType) -> bool:
        return ggml_type in self.types

    def asarray(self, x: Any) -> Any:
        if self.device is None:
            return self.xp.asarray(x)
        return self.xp.asarray(x, device=self.device)

    def prepare(self, tensor: QuantTensor) -> Blocks | Dense:
        check_supported(self, tensor, self.types)
        fmt = quants.get(tensor.ggml_type)
        fields = {
            k: self.asarray(v)
            for k, v in quants.unpack(tensor.data, fmt.ggml_type, tensor.shape).items()
        }
        blocks = Blocks(tensor, fmt, fields)
        if self.dequantize_all or tensor.ggml_type == GGMLType.F32:  # F32: nothing to widen
            return Dense(tensor, self._widen(blocks))
        return blocks

    def matmul(self, x: Any, w: Blocks | Dense) -> Any:
        dense = w.w if isinstance(w, Dense) else self._widen(w)
        return self.xp.matmul(x, self.xp.matrix_transpose(dense))

    def embedding(self, ids: Any, w: Blocks | Dense) -> Any:
        xp = self.xp
        if isinstance(w, Dense):
            return xp.take(w.w, ids, axis=0)
        # the blocks of the wanted rows only: row r holds blocks r*bpr .. r*bpr + bpr - 1
        bpr = w.blocks_per_row
        itype = xp.int32 if w.tensor.rows * bpr < 2**31 else xp.int64  # jax has no int64 by default
        offsets = self.asarray(np.arange(bpr, dtype=np.int32 if itype == xp.int32 else np.int64))
        idx = xp.reshape(xp.astype(ids, itype)[:, None] * bpr + offsets[None, :], (-1,))
        rows = {k: xp.take(v, idx, axis=0) for k, v in w.fields.items()}
        return xp.reshape(w.fmt.dequantize_fields(rows, xp=xp), (ids.shape[0], w.tensor.row_length))

    # -- helpers -------------------------------------------------------------------------------

    def _widen(self, w: Blocks) -> Any:
        """The whole weight as float32 ``(rows, row_length)``."""
        return self.xp.reshape(w.fmt.dequantize_fields(w.fields, xp=self.xp), w.tensor.shape)
