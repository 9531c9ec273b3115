"""jax: the GPU arithmetic, each product jit-compiled (with its dequantization, per format)."""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from qllama.backends.array_api import ArrayBackend, Blocks, Dense
from qllama.errors import BackendError

# float32 matmuls in full float32 (XLA would otherwise use TF32/bf16 passes on accelerators)
jax.config.update("jax_default_matmul_precision", "highest")


def _product(x: Any, w: Any) -> Any:
    return jnp.matmul(x, w.T)


# Compiled, the transpose is how the product reads ``w``; run eagerly, it copied the whole
# weight at every call (F32 SmolLM2's decode on one idle core: 0.38 s a token eager, 0.11 s
# compiled).
_dense_matmul = jax.jit(_product)


@partial(jax.jit, static_argnums=(2, 3))
def _dequantize_matmul(x: Any, fields: dict[str, Any], fmt: Any, shape: tuple[int, int]) -> Any:
    return _product(x, jnp.reshape(fmt.dequantize_fields(fields, xp=jnp), shape))


class JaxBackend(ArrayBackend):
    """Weights as blocks on the device; dequantize + matmul compiled by XLA."""

    name: ClassVar[str] = "jax"

    def __init__(
        self, *, device: str | None = None, dequantize_all: bool = False, **options: Any
    ) -> None:
        if options:
            raise BackendError(f"backend jax takes no options {sorted(options)}")
        try:
            dev = jax.devices(device)[0] if device else jax.devices()[0]
        except RuntimeError as e:
            raise BackendError(f"backend jax has no device {device!r}: {e}") from None
        super().__init__(jnp, device=dev, dequantize_all=dequantize_all)

    def matmul(self, x: Any, w: Blocks | Dense) -> Any:
        if isinstance(w, Dense):
            return _dense_matmul(x, w.w)
        return _dequantize_matmul(x, w.fields, w.fmt, w.tensor.shape)
